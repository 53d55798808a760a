"""shoal.keras (Keras 3): model.fit with DistributedOptimizer on N ranks x batch B equals one process with N*B, on the
TensorFlow and the torch backend; the callbacks (broadcast, metric average, warm-up and schedule); load_model; the
Keras digits example."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import REPO, SHOALRUN, clean_env
from shoal.testing import run_ranks

# Checked without importing: a rank unpickling a test function imports this module before it sets KERAS_BACKEND.
for _needed in ("keras", "tensorflow"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"{_needed} is not installed (pip install 'shoal[tensorflow]')", allow_module_level=True)

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
TOLERANCE = 1e-5
"""Largest weight difference between 2 ranks and one process: float32 sums in another order."""


def _keras() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
    return keras


def _fit(global_batch: int, steps: int) -> dict[str, Any]:
    """Fit a regression for one epoch of ``steps`` global batches (rank r takes block r of each global batch), with
    gradients exchanged every batch and, again from the same start, with ``backward_passes_per_step=2`` (summed, as
    Horovod does) and with Keras's ``gradient_accumulation_steps=2`` (averaged). Also: what a
    ``PartialDistributedOptimizer`` makes of known per-rank gradients."""
    keras = _keras()
    import shoal.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    generator = np.random.default_rng(3)
    x = generator.standard_normal((steps * global_batch, 6)).astype(np.float32)
    y = (np.tanh(x @ generator.standard_normal((6, 1))) + 0.1).astype(np.float32)
    local = global_batch // size
    mine = np.concatenate(
        [np.arange(k * global_batch + rank * local, k * global_batch + (rank + 1) * local) for k in range(steps)]
    )
    results: dict[str, Any] = {"backend": hvd.backend()}
    variants = {
        "every_batch": (keras.optimizers.SGD(learning_rate=0.1, momentum=0.9), {}),
        "passes_2_sum": (keras.optimizers.SGD(learning_rate=0.05), {"backward_passes_per_step": 2}),
        "keras_accumulation_2": (keras.optimizers.SGD(learning_rate=0.1, gradient_accumulation_steps=2), {}),
        "loss_scaled": (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)), {}),
    }
    for label, (optimizer, options) in variants.items():
        keras.utils.set_random_seed(rank)  # ranks start apart: the broadcast callback must make them equal
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer, **options), loss="mse", jit_compile=False)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
        history = model.fit(x[mine], y[mine], batch_size=local, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        results[label] = {
            "weights": np.concatenate([np.asarray(w).ravel() for w in model.get_weights()]).tolist(),
            "loss": history.history["loss"][-1],
            "iterations": int(np.asarray(model.optimizer.iterations)),
        }

    # A LossScaleOptimizer's check agrees over the ranks: one rank's overflow makes every rank skip the step.
    scaled = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    own = [keras.ops.full((2,), float("inf") if rank == size - 1 else 1.0)]
    results["loss_scale"] = [type(scaled).__name__, hvd.is_distributed(scaled), bool(np.asarray(scaled.check_finite(own)))]

    dense = keras.layers.Dense(2)
    head = keras.layers.Dense(1)
    keras.Sequential([keras.Input((2,)), dense, head])
    partial = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(), local_layers=[head])
    variables = dense.trainable_weights + head.trainable_weights
    grads = [keras.ops.full(v.shape, float(rank + 1)) for v in variables]
    partial.build(variables)
    reduced = partial._shoal_reducer.reduce(grads, variables)
    results["partial"] = [float(np.asarray(keras.ops.convert_to_numpy(g)).ravel()[0]) for g in reduced]
    return results


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_fit_on_two_ranks_matches_one_process_with_the_global_batch(backend: str) -> None:
    env = {**ENV, "KERAS_BACKEND": backend}
    fresh = backend != "tensorflow"  # the forked ranks have TensorFlow's Keras loaded already (conftest)
    two = run_ranks(_fit, 2, args=(8, 6), env=env, timeout_s=150, fresh=fresh)
    one = run_ranks(_fit, 1, args=(8, 6), env=env, timeout_s=150, fresh=fresh)[0]
    assert two[0]["backend"] == one["backend"] == backend
    for label in ("every_batch", "passes_2_sum", "keras_accumulation_2", "loss_scaled"):
        assert two[0][label]["weights"] == two[1][label]["weights"], label  # the ranks agree exactly
        difference = max(abs(a - b) for a, b in zip(two[0][label]["weights"], one[label]["weights"], strict=True))
        assert difference <= TOLERANCE, (label, difference)
        assert two[0][label]["loss"] == two[1][label]["loss"]  # MetricAverageCallback: the same loss on every rank
    # Accumulating over 2 batches is not the same training as updating every batch.
    assert max(abs(a - b) for a, b in zip(one["every_batch"]["weights"], one["passes_2_sum"]["weights"], strict=True)) > 1e-3
    assert one["keras_accumulation_2"]["iterations"] == 3  # Keras counts updates: 6 batches / 2
    # Horovod's sum of 2 batches at half the learning rate is Keras's mean at the full one.
    for result in (one, two[0]):
        both = zip(result["passes_2_sum"]["weights"], result["keras_accumulation_2"]["weights"], strict=True)
        assert max(abs(a - b) for a, b in both) <= TOLERANCE
    # PartialDistributedOptimizer: shared layers averaged ((1 + 2) / 2), the local layer kept and divided by size.
    assert two[0]["partial"] == [1.5, 1.5, 0.5, 0.5] and two[1]["partial"] == [1.5, 1.5, 1.0, 1.0]
    assert one["partial"] == [1.0, 1.0, 1.0, 1.0]
    for result in (*two, one):
        assert result["loss_scale"] == ["LossScaleOptimizer", True, False]  # the last rank's inf reaches every rank


def _callbacks() -> dict[str, Any]:
    keras = _keras()
    import shoal.keras as hvd

    hvd.init()
    rank = hvd.rank()
    averaged: dict[str, Any] = {"loss": rank + 1.0, "accuracy": 2.0 * rank, "name": "kept"}
    hvd.callbacks.MetricAverageCallback().on_epoch_end(0, averaged)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0), loss="mse")
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2, steps_per_epoch=4)
    warmup.set_model(model)
    warmup.on_train_begin()
    ramp = []
    for epoch in range(3):
        warmup.on_epoch_begin(epoch)
        for batch in range(4):
            warmup.on_train_batch_begin(batch)
            ramp.append(float(np.asarray(model.optimizer.learning_rate)))
            warmup.on_train_batch_end(batch)
    logs: dict[str, Any] = {}
    warmup.on_epoch_end(2, logs)

    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.4, multiplier=0.5, start_epoch=1)
    schedule.set_model(model)
    model.optimizer.learning_rate.assign(0.4)
    stairs = []
    for epoch in range(4):
        schedule.on_epoch_begin(epoch)
        schedule.on_train_batch_begin(0)
        stairs.append(float(np.asarray(model.optimizer.learning_rate)))
    return {"averaged": averaged, "ramp": ramp, "lr_logged": logs["lr"], "stairs": stairs}


def test_callbacks_average_metrics_and_follow_horovods_schedules() -> None:
    results = run_ranks(_callbacks, 2, env=ENV, timeout_s=120)
    size, initial, warmup_epochs, steps = 2, 0.4, 2, 4
    expected_ramp = [
        initial / size * ((epoch + (batch + 1) / steps) * (size - 1) / warmup_epochs + 1)
        for epoch in range(warmup_epochs)
        for batch in range(steps)
    ]
    for got in results:
        assert got["averaged"] == {"loss": 1.5, "accuracy": 1.0, "name": "kept"}
        np.testing.assert_allclose(got["ramp"][:8], expected_ramp, rtol=1e-6)
        assert got["ramp"][7] == pytest.approx(initial)  # the ramp ends at initial_lr
        np.testing.assert_allclose(got["ramp"][8:], [initial] * 4, rtol=1e-6)  # after warm-up: left alone
        assert got["lr_logged"] == pytest.approx(initial)
        np.testing.assert_allclose(got["stairs"], [0.4, 0.4, 0.2, 0.1], rtol=1e-6)


def _save_and_load(path: str) -> dict[str, Any]:
    keras = _keras()
    import shoal.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(learning_rate=0.01)), loss="mse", jit_compile=False)
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    if hvd.rank() == 0:
        model.save(path)
    hvd.allreduce(0.0, name="saved")  # every rank waits for rank 0's file
    loaded = hvd.load_model(path)
    before = int(np.asarray(loaded.optimizer.iterations))
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)
    after = int(np.asarray(loaded.optimizer.iterations))
    best = hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=f"{path}.best.{hvd.rank()}.keras")
    loaded.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[best])
    unset = hvd.callbacks.BestModelCheckpoint()
    try:
        loaded.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[unset])
        refused = "trained"
    except ValueError as error:
        refused = str(error)
    return {
        "distributed": hvd.is_distributed(loaded.optimizer),
        "class": type(loaded.optimizer).__name__,
        "iterations": (before, after),
        "best_saved": os.path.exists(f"{path}.best.{hvd.rank()}.keras") and float(best.best) < float("inf"),
        "refused": refused,
    }


def test_load_model_restores_a_distributed_optimizer_with_its_state(tmp_path: Path) -> None:
    for got in run_ranks(_save_and_load, 2, args=(str(tmp_path / "model.keras"),), env=ENV, timeout_s=120):
        assert "needs a filepath" in got.pop("refused")
        assert got == {"distributed": True, "class": "Adam", "iterations": (2, 4), "best_saved": True}


@pytest.mark.parametrize("workers", [1, 2])
def test_keras_digits_example_reaches_95_percent(workers: int, tmp_path: Path) -> None:
    script = [sys.executable, str(REPO / "examples" / "keras_digits.py"), "--checkpoint", str(tmp_path / "digits.keras")]
    command = script if workers == 1 else [*SHOALRUN, "-np", str(workers), *script]
    result = subprocess.run(command, env={**clean_env(), **ENV}, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    summary = json.loads(line.split(":", 1)[1] if line.startswith("[0]") else line)
    assert summary["example"] == "keras_digits" and summary["world"] == workers and summary["backend"] == "tensorflow"
    assert summary["test_accuracy"] >= 0.95, summary
    assert (tmp_path / "digits.keras").exists()


def _fit_balanced(slow_rank: int) -> dict[str, Any]:
    """Fit on hvd.BalancedData (B=16, b=4; 60 samples: three steps of 16, one of 12) for 3 epochs; ``slow_rank``
    sleeps 20 ms in each batch, so the shares follow."""
    keras = _keras()
    import time

    import torch

    import shoal.keras as hvd

    hvd.init()
    torch.set_num_threads(1)
    generator = np.random.default_rng(5)
    x = generator.standard_normal((60, 6)).astype(np.float32)
    y = (np.tanh(x @ generator.standard_normal((6, 1))) + 0.1).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    data = hvd.BalancedData(x, y, global_batch_size=16, micro_batch_size=4, seed=1)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1, momentum=0.9), loader=data)
    model.compile(optimizer=optimizer, loss="mse")
    shares: list[list[int]] = []

    class Record(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if hvd.rank() == slow_rank:
                time.sleep(0.02)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            assert data.plan is not None
            shares.append(list(data.plan.shares))

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), Record()]
    model.fit(data, epochs=3, verbose=0, callbacks=callbacks)
    weights = [float(v) for w in model.get_weights() for v in np.asarray(w).ravel()]
    return {"weights": weights, "shares": shares}


def _balanced_misuse() -> list[str]:
    """The errors of ``loader=`` with arguments a balanced global batch cannot honour (the rule torch's optimizer
    shares, ``core.balance.check_balanced_reduction``)."""
    keras = _keras()
    import shoal.keras as hvd

    hvd.init()
    x = np.zeros((8, 2), dtype=np.float32)
    data = hvd.BalancedData(x, x[:, :1], global_batch_size=4, micro_batch_size=2)
    cases = [
        ({"op": hvd.Sum}, {}),
        ({"backward_passes_per_step": 2}, {}),
        ({}, {"gradient_accumulation_steps": 2}),
    ]
    messages = []
    for arguments, own in cases:
        try:
            hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1, **own), loader=data, **arguments)
        except ValueError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    return messages


def test_balanced_data_refuses_a_sum_and_any_gradient_accumulation() -> None:
    env = {**ENV, "KERAS_BACKEND": "torch"}
    messages = run_ranks(_balanced_misuse, 1, env=env, timeout_s=120, fresh=True)[0]
    assert "needs op=Average, not Sum" in messages[0], messages
    assert all("leave backward_passes_per_step and gradient_accumulation_steps at 1" in m for m in messages[1:]), messages


def test_balanced_data_on_two_ranks_matches_one_process() -> None:
    """Keras 3 on torch: BalancedData with shares that follow a slow rank gives one process's weights (1e-5)."""
    env = {**ENV, "KERAS_BACKEND": "torch"}
    two = run_ranks(_fit_balanced, 2, args=(1,), env=env, timeout_s=150, fresh=True)
    one = run_ranks(_fit_balanced, 1, args=(-1,), env=env, timeout_s=150, fresh=True)[0]
    assert len(one["shares"]) == len(two[0]["shares"]) == 12  # 4 steps an epoch, 3 epochs
    assert two[0]["weights"] == two[1]["weights"]
    difference = max(abs(a - b) for a, b in zip(two[0]["weights"], one["weights"], strict=True))
    assert difference <= TOLERANCE, difference
    assert any(s[0] > s[1] for s in two[0]["shares"]), two[0]["shares"]  # the slow rank got fewer micro-batches
