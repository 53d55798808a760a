"""``shoal.spark.TorchEstimator`` on a local Spark (``local[2]``, one session for the module): fit on the digits as a
DataFrame, transform, save and load, the single-process reference (2 ranks x batch 4 against 1 x batch 8), and the
errors a user meets before anything trains."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'shoal[spark]')")
pytestmark = pytest.mark.xdist_group("spark")  # one worker runs them: one Spark session (JVM) for all three modules

import torch  # noqa: E402

from shoal.spark import LightningEstimator, Store, TorchEstimator, TorchModel  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


def digits_frames(spark: Any) -> tuple[Any, Any]:
    """The digits as (features: ML vector of 64 pixels in [0, 1], label: long), split 80/20 with a fixed seed."""
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(digits.data / 16.0, digits.target, test_size=0.2, random_state=0)

    def frame(x: np.ndarray, y: np.ndarray) -> Any:
        rows = [(Vectors.dense(row.tolist()), int(label)) for row, label in zip(x, y, strict=True)]
        return spark.createDataFrame(rows, ["features", "label"])

    return frame(x_train, y_train), frame(x_test, y_test)


def digits_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 64, 10)
    )


def accuracy(rows: list[Any]) -> float:
    """Of collected (label, label__output) rows: the share whose largest output is the label."""
    return float(np.mean([int(np.argmax(row["label__output"].toArray())) == row["label"] for row in rows]))


@pytest.mark.timeout(120)
def test_fit_transform_save_and_load_on_the_digits(spark: Any, tmp_path: Any, capfd: pytest.CaptureFixture[str]) -> None:
    train, test = digits_frames(spark)
    model = digits_model()
    estimator = TorchEstimator(
        num_proc=2,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        input_shapes=[[-1, 1, 8, 8]],
        label_cols=["label"],
        validation=0.1,
        batch_size=32,
        epochs=6,
        store=Store.create(str(tmp_path / "store")),
        random_seed=1,
    )
    fitted = estimator.fit(train)
    output = capfd.readouterr().out
    assert "[0]<stdout>:epoch 1/6: loss " in output and "[0]<stdout>:epoch 6/6: loss " in output, output[-2000:]
    history = fitted.getHistory()
    assert len(history["loss"]) == 6 and len(history["val_loss"]) == 6, history
    assert history["loss"][-1] < history["loss"][0] / 3, history
    predicted = fitted.transform(test)
    assert predicted.columns == ["features", "label", "label__output"]
    before = predicted.select("label", "label__output").collect()  # once: each collect runs the model again
    first = accuracy(before)
    print(f"estimator on 2 processes: test accuracy {first:.4f}, history {history}")
    assert first >= 0.95, first
    assert os.path.exists(tmp_path / "store" / "runs" / fitted.getRunId() / "checkpoint" / "checkpoint.pt")
    assert not os.path.exists(tmp_path / "store" / f"intermediate_train_data.{fitted.getRunId()}")  # cleaned up

    fitted.save(str(tmp_path / "model"))
    with pytest.raises(FileExistsError, match="overwrite"):
        fitted.save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getHistory() == history and loaded.getFeatureColumns() == ["features"]
    again = loaded.transform(test).select("label__output").collect()
    assert [row[0] for row in again] == [row["label__output"] for row in before]
    assert isinstance(loaded.getOptimizer(), torch.optim.Adam) and loaded.getOptimizer().state


def lightning_digits() -> Any:
    import lightning.pytorch as pl

    class Digits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = digits_model()

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.net(features)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"])
            self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
            return loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            loss = torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"])
            self.log("val_loss", loss, sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    return Digits()


@pytest.mark.timeout(150)
def test_lightning_estimator_fits_a_lightning_module(spark: Any, tmp_path: Any, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install 'shoal[lightning]')")
    train, test = digits_frames(spark)
    fitted = LightningEstimator(
        num_proc=2,
        model=lightning_digits(),
        feature_cols=["features"],
        input_shapes=[[-1, 1, 8, 8]],
        label_cols=["label"],
        validation=0.1,
        batch_size=32,
        epochs=6,
        store=Store.create(str(tmp_path / "store")),
    ).fit(train)
    output = capfd.readouterr().out
    assert "[0]<stdout>:epoch 6/6: train_loss " in output, output[-2000:]
    history = fitted.getHistory()
    assert len(history["train_loss"]) == 6 and len(history["val_loss"]) == 6, history
    score = accuracy(fitted.transform(test).select("label", "label__output").collect())
    print(f"Lightning estimator on 2 processes: test accuracy {score:.4f}, history {history}")
    assert score >= 0.95, score
    with pytest.raises(TypeError, match="LightningModule"):
        LightningEstimator(model=torch.nn.Linear(2, 2), feature_cols=["x"], label_cols=["y"]).fit(train)


def reference_data(rows: int = 48) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(3)
    x = generator.normal(size=(rows, 6))
    y = x @ generator.normal(size=6) + 0.1 * generator.normal(size=rows)
    return x, y


def reference_frame(spark: Any, rows: int = 48) -> Any:
    x, y = reference_data(rows)
    return spark.createDataFrame([(row.tolist(), float(t)) for row, t in zip(x, y, strict=True)], ["x", "y"])


def reference_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), torch.nn.Flatten(0))


def one_process_weights(batch_size: int, steps: int) -> dict[str, torch.Tensor]:
    """Plain torch in this process, no Spark and no Shoal: ``steps`` SGD steps over the rows in order."""
    x, y = reference_data()
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    features, labels = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    for step in range(steps):
        rows = slice(step * batch_size, (step + 1) * batch_size)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(features[rows]), labels[rows]).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def fitted_weights(
    df: Any, num_proc: int, batch_size: int, store: Any, run_id: str | None = None, epochs: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    model = reference_model()
    fitted = TorchEstimator(
        num_proc=num_proc,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=batch_size,
        epochs=epochs,
        train_steps_per_epoch=3,
        shuffle=False,
        store=store,
        run_id=run_id,
        verbose=0,
    ).fit(df)
    weights = {name: value.detach().clone() for name, value in fitted.getModel().state_dict().items()}
    return weights, fitted.getHistory()


@pytest.mark.timeout(120)
def test_two_ranks_at_batch_four_match_one_process_at_batch_eight(spark: Any, tmp_path: Any) -> None:
    """Rank r reads rows r, r+2, ...: with shuffling off, step i of 2 ranks x 4 rows covers the 8 rows of step i of
    one process, and the mean loss's gradient is the same. The reference is plain torch in this process, batch 8 over
    the rows in order. Tolerance 1e-5 (float32 sums in another order)."""
    df = reference_frame(spark)
    store = Store.create(str(tmp_path / "store"))
    two, history = fitted_weights(df, 2, 4, store, run_id="two")
    one = one_process_weights(batch_size=8, steps=3)
    torch.manual_seed(0)
    untouched = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).state_dict()
    assert any(not torch.allclose(two[name], untouched[name]) for name in two)  # three steps moved the weights
    print(f"2 x 4 against 1 x 8, largest weight difference: {max(float((two[n] - one[n]).abs().max()) for n in one):.2e}")
    for name in one:
        assert torch.allclose(two[name], one[name], atol=1e-5, rtol=0), (name, (two[name] - one[name]).abs().max())
    # The same run_id with a second epoch resumes from the first's checkpoint: one more epoch, not two. (Marked: a
    # fresh run would compute the same first loss, so the checkpoint's history is changed to tell them apart.)
    checkpoint = os.path.join(store.get_checkpoint_path("two"), store.get_checkpoint_filename())
    saved = torch.load(checkpoint, weights_only=False)
    saved["history"]["loss"] = [123.0]
    torch.save(saved, checkpoint)
    resumed, more = fitted_weights(df, 2, 4, store, run_id="two", epochs=2)
    assert len(more["loss"]) == 2 and more["loss"][0] == 123.0 and history["loss"][0] != 123.0, (history, more)
    assert any(not torch.allclose(resumed[name], two[name]) for name in two)


def test_what_cannot_train_is_refused_before_anything_starts(spark: Any, tmp_path: Any) -> None:
    df = reference_frame(spark, rows=6)
    model = torch.nn.Linear(6, 1)
    base = {
        "num_proc": 2, "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "loss": torch.nn.MSELoss(), "feature_cols": ["x"], "label_cols": ["y"], "store": str(tmp_path), "verbose": 0,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"has no column\(s\) \['z'\]"):
        TorchEstimator(**{**base, "feature_cols": ["z"]}).fit(df)
    with pytest.raises(ValueError, match="6 training rows are fewer than batch_size"):
        TorchEstimator(**base).fit(df)
    other = torch.nn.Linear(6, 1)
    with pytest.raises(ValueError, match="not the model's"):
        TorchEstimator(**{**base, "optimizer": torch.optim.SGD(other.parameters(), lr=0.1)}).fit(df)
    with pytest.raises(ValueError, match="loss is required"):
        TorchEstimator(**{**base, "loss": None}).fit(df)
    with pytest.raises(ValueError, match="2 loss"):
        TorchEstimator(**{**base, "loss": [torch.nn.MSELoss()] * 2}).fit(df)
    with pytest.raises(ValueError, match="not a local or shared path"):
        Store.create("hdfs://namenode/data")
    words = spark.createDataFrame([("a", 1.0)], ["x", "y"])
    with pytest.raises(TypeError, match="column 'x' is string"):
        TorchEstimator(**base).fit(words)
    with pytest.raises(ValueError, match=r"2 loss weight\(s\) for 1 loss"):
        TorchEstimator(**{**base, "loss_weights": [1.0, 2.0]}).fit(df)
    with pytest.raises(ValueError, match="6 training rows for 8 processes"):
        TorchEstimator(**{**base, "num_proc": 8, "train_steps_per_epoch": 1}).fit(df)
    from decimal import Decimal

    decimals = spark.createDataFrame([(Decimal("1.5"), 1.0)], "x decimal(4,2), y double")
    with pytest.raises(TypeError, match="cast decimals to double"):
        TorchEstimator(**base).fit(decimals)
    with pytest.raises(ValueError, match="not a local or shared path"):
        TorchModel(model=model, feature_columns=["x"], label_columns=["y"]).save("hdfs://namenode/models/m")
    with pytest.raises(TypeError, match="metrics"):
        TorchEstimator(**base, metrics=["accuracy"])
    estimator = TorchEstimator(**base)
    assert estimator.getBatchSize() == 32 and estimator.setBatchSize(2).getBatchSize() == 2


def test_horovod_spark_imports_map_to_shoal_spark_under_horovod_compat() -> None:
    """``import horovod.spark`` and the estimators' and store's Horovod module paths resolve to ``shoal.spark``."""
    import subprocess

    from conftest import SHOALRUN, clean_env

    code = (
        "import horovod.spark, shoal.spark, shoal.spark.estimator as e, shoal.spark.store as s\n"
        "from horovod.spark.torch import TorchEstimator, TorchModel\n"
        "from horovod.spark.lightning import TorchEstimator as LightningTorchEstimator\n"
        "from horovod.spark.common.store import Store, LocalStore\n"
        "print(horovod.spark is shoal.spark, horovod.spark.run is shoal.spark.run,\n"
        "      horovod.spark.run_elastic is shoal.spark.run_elastic, TorchEstimator is e.TorchEstimator,\n"
        "      TorchModel is e.TorchModel, LightningTorchEstimator is e.LightningEstimator, Store is s.Store,\n"
        "      LocalStore is s.LocalStore)\n"
    )
    command = [*SHOALRUN, "--horovod-compat", "-np", "1", sys.executable, "-c", code]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[0]<stdout>:" + " ".join(["True"] * 8), result.stdout
