"""Keras 2 (``tf_keras``, what ``tf.keras`` is under ``TF_USE_LEGACY_KERAS=1``) with Horovod's Keras 2 idioms:
``model.fit`` on 2 ranks x batch 4 equals one process x batch 8 (a ``tf_keras`` optimizer and a legacy one, and a
``SyncBatchNormalization`` layer); the callbacks; ``load_model`` of an ``.h5`` file; elastic ``KerasState``;
``backward_passes_per_step`` and ``LossScaleOptimizer``; the Keras collectives in a TF1 graph."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import keras_collectives
from shoal.testing import run_ranks

for _needed in ("tf_keras", "tensorflow"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"{_needed} is not installed (pip install 'shoal[dev]')", allow_module_level=True)

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}
TOLERANCE = 1e-5
"""Largest weight difference between 2 ranks and one process: float32 sums in another order."""


def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__  # TF_USE_LEGACY_KERAS=1: tf.keras is Keras 2
    return tf


def _fit(global_batch: int, steps: int) -> dict[str, Any]:
    """Fit a small regression with Horovod's Keras 2 idioms, one epoch of ``steps`` global batches (rank r takes
    block r of each): a tf_keras optimizer, a legacy one, and a model with SyncBatchNormalization."""
    tf = _tf()
    import shoal.tensorflow as hvd_tf
    import shoal.tensorflow.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    generator = np.random.default_rng(3)
    x = generator.standard_normal((steps * global_batch, 6)).astype(np.float32)
    y = (np.tanh(x @ generator.standard_normal((6, 1))) + 0.1).astype(np.float32)
    local = global_batch // size
    mine = np.concatenate(
        [np.arange(k * global_batch + rank * local, k * global_batch + (rank + 1) * local) for k in range(steps)]
    )
    variants = {
        "sgd_momentum": (lambda: tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9), False),
        "legacy_adam": (lambda: tf.keras.optimizers.legacy.Adam(learning_rate=0.01), False),
        "sync_batch_norm": (lambda: tf.keras.optimizers.SGD(learning_rate=0.1), True),
    }
    results: dict[str, Any] = {}
    for label, (make, batch_norm) in variants.items():
        tf.keras.utils.set_random_seed(rank)  # ranks start apart: the broadcast callback must make them equal
        layers = [tf.keras.layers.Dense(8, activation="tanh", input_shape=(6,))]
        if batch_norm:
            layers.append(hvd_tf.SyncBatchNormalization(fused=False))
        layers.append(tf.keras.layers.Dense(1))
        model = tf.keras.Sequential(layers)
        optimizer = hvd.DistributedOptimizer(make())
        model.compile(optimizer=optimizer, loss="mse", experimental_run_tf_function=False)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
        history = model.fit(x[mine], y[mine], batch_size=local, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        results[label] = {
            "weights": np.concatenate([np.asarray(w).ravel() for w in model.get_weights()]).tolist(),
            "loss": history.history["loss"][-1],
            "class": type(model.optimizer).__name__,
            "variables": len(optimizer.variables()),  # Horovod's Keras 2 idiom: a method
        }
    return results


def test_fit_on_two_ranks_matches_one_process_with_the_global_batch() -> None:
    two = run_ranks(_fit, 2, args=(8, 6), env=ENV, timeout_s=150)
    one = run_ranks(_fit, 1, args=(8, 6), env=ENV, timeout_s=150)[0]
    for label in ("sgd_momentum", "legacy_adam", "sync_batch_norm"):
        assert two[0][label]["weights"] == two[1][label]["weights"], label  # the ranks agree exactly
        difference = max(abs(a - b) for a, b in zip(two[0][label]["weights"], one[label]["weights"], strict=True))
        assert difference <= TOLERANCE, (label, difference)
        assert two[0][label]["loss"] == two[1][label]["loss"]  # MetricAverageCallback
    assert two[0]["legacy_adam"]["class"] == "Adam" and two[0]["sgd_momentum"]["class"] == "SGD"
    assert two[0]["legacy_adam"]["variables"] > 1


UPDATES = 4
"""Updates in the accumulation test: each takes 2 passes x 2 ranks x 4 samples, or one process's batch of 16."""


def _fit_accumulated_and_loss_scaled() -> dict[str, Any]:
    """Keras 2's backward_passes_per_step and LossScaleOptimizer. On 2 ranks: passes of 4 samples, 2 per update (the
    mean at lr 0.1, the sum at lr 0.05, a legacy optimizer's mean), and a LossScaleOptimizer on batches of 4. In one
    process, the references: batches of 16 at lr 0.1, and the LossScaleOptimizer on batches of 8."""
    tf = _tf()
    import shoal.tensorflow.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    generator = np.random.default_rng(5)
    x = generator.standard_normal((16 * UPDATES, 6)).astype(np.float32)
    y = (np.tanh(x @ generator.standard_normal((6, 1))) + 0.1).astype(np.float32)
    # Update j takes samples 16j..16j+15: rank r's first pass is 16j+4r.., its second 16j+8+4r..
    passes_of = np.concatenate(
        [np.arange(16 * j + 8 * p + 4 * rank, 16 * j + 8 * p + 4 * rank + 4) for j in range(UPDATES) for p in range(2)]
    )
    halves = np.concatenate([np.arange(8 * k + 4 * rank, 8 * k + 4 * rank + 4) for k in range(2 * UPDATES)])

    def fit(make: Any, rows: Any, batch: int, **options: Any) -> dict[str, Any]:
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh", input_shape=(6,)), tf.keras.layers.Dense(1)])
        optimizer = hvd.DistributedOptimizer(make(), **options)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x[rows], y[rows], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        return {
            "weights": np.concatenate([np.asarray(w).ravel() for w in model.get_weights()]).tolist(),
            "iterations": int(np.asarray(model.optimizer.iterations)),
            "class": type(model.optimizer).__name__,
        }

    sgd = lambda lr: lambda: tf.keras.optimizers.SGD(learning_rate=lr, momentum=0.9)  # noqa: E731
    scaled = lambda: tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(learning_rate=0.1))  # noqa: E731
    if size == 1:
        return {"batch_16": fit(sgd(0.1), np.arange(16 * UPDATES), 16), "loss_scale": fit(scaled, np.arange(16 * UPDATES), 8)}
    legacy = lambda: tf.keras.optimizers.legacy.SGD(learning_rate=0.1, momentum=0.9)  # noqa: E731
    out = {
        "passes_2_mean": fit(sgd(0.1), passes_of, 4, backward_passes_per_step=2, average_aggregated_gradients=True),
        "passes_2_sum": fit(sgd(0.05), passes_of, 4, backward_passes_per_step=2),
        "legacy_passes_2_mean": fit(legacy, passes_of, 4, backward_passes_per_step=2, average_aggregated_gradients=True),
        "loss_scale": fit(scaled, halves, 4),
    }
    try:
        hvd.DistributedOptimizer(scaled(), backward_passes_per_step=2)
        out["loss_scale_passes"] = "none"
    except NotImplementedError as error:
        out["loss_scale_passes"] = str(error)
    return out


def test_backward_passes_and_loss_scale_optimizer_on_two_ranks_match_one_process() -> None:
    """Two passes per update on 2 ranks (sum or mean, a tf_keras and a legacy optimizer) equal one process's batch of
    all four passes; a Keras 2 LossScaleOptimizer trains, the ranks agree, and it equals one process (1e-5)."""
    two = run_ranks(_fit_accumulated_and_loss_scaled, 2, env=ENV, timeout_s=150)
    one = run_ranks(_fit_accumulated_and_loss_scaled, 1, env=ENV, timeout_s=150)[0]
    for label, reference in (
        ("passes_2_mean", "batch_16"),
        ("passes_2_sum", "batch_16"),  # Horovod's sum of 2 passes at half the learning rate is the mean at the full one
        ("legacy_passes_2_mean", "batch_16"),
        ("loss_scale", "loss_scale"),
    ):
        assert two[0][label]["weights"] == two[1][label]["weights"], label  # the ranks agree exactly
        difference = max(abs(a - b) for a, b in zip(two[0][label]["weights"], one[reference]["weights"], strict=True))
        assert difference <= TOLERANCE, (label, difference)
    assert two[0]["passes_2_mean"]["iterations"] == 2 * UPDATES, "Horovod counts every pass"
    assert one["batch_16"]["iterations"] == UPDATES
    assert two[0]["loss_scale"]["class"] == "LossScaleOptimizerV3"
    assert "backward_passes_per_step > 1 with a Keras 2 LossScaleOptimizer" in two[0]["loss_scale_passes"]


def _collectives_in_a_tf1_graph() -> dict[str, Any]:
    """Keras 2 with eager execution off (TF1 style): the Keras collectives return the values evaluated in Keras's
    session, as Horovod's do, and broadcast_global_variables assigns in that session."""
    tf = _tf()
    tf.compat.v1.disable_eager_execution()
    import shoal.tensorflow.keras as hvd

    hvd.init()
    rank = hvd.rank()
    results = keras_collectives(hvd, rank, "g")
    out: dict[str, Any] = {name: [type(r).__name__, np.asarray(r).tolist()] for name, r in results.items()}
    variable = tf.compat.v1.Variable([1.0 + rank, 10.0 * (rank + 1)])
    session = tf.compat.v1.keras.backend.get_session()
    session.run(variable.initializer)
    hvd.broadcast_global_variables(1)
    out["global_variable"] = session.run(variable).tolist()
    return out


def test_keras_collectives_in_a_tf1_graph_return_session_values() -> None:
    results = run_ranks(_collectives_in_a_tf1_graph, 2, env=ENV, timeout_s=120, fresh=True)
    for rank, result in enumerate(results):
        assert result["allreduce"] == ["ndarray", [[0.5, 1.5], [2.5, 3.5]]]
        assert result["allgather"] == ["ndarray", [[0.0, 1.0], [2.0, 3.0], [1.0, 2.0], [3.0, 4.0]]]
        assert result["broadcast"] == ["ndarray", [[1.0, 2.0], [3.0, 4.0]]]
        assert result["reducescatter"] == ["ndarray", [[[1.0, 3.0], [5.0, 7.0]][rank]]]
        assert result["global_variable"] == [2.0, 20.0], "rank 1's global variables on every rank"


def _callbacks_and_load(path: str) -> dict[str, Any]:
    tf = _tf()
    import shoal.tensorflow.keras as hvd

    hvd.init()
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
    model.compile(optimizer=tf.keras.optimizers.legacy.SGD(learning_rate=1.0, momentum=0.5), loss="mse")
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2, steps_per_epoch=4)
    warmup.set_model(model)
    warmup.on_train_begin()
    ramp = []
    for epoch in range(2):
        warmup.on_epoch_begin(epoch)
        for batch in range(4):
            warmup.on_train_batch_begin(batch)
            ramp.append(float(np.asarray(model.optimizer.learning_rate)))
            warmup.on_train_batch_end(batch)

    tf.keras.utils.set_random_seed(0)
    trained = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
    trained.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(learning_rate=0.01)), loss="mse")
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
    trained.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    if hvd.rank() == 0:
        trained.save(path)
    hvd.allreduce(0.0, name="saved")  # every rank waits for rank 0's file
    loaded = hvd.load_model(path)
    before = int(np.asarray(loaded.optimizer.iterations))
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)
    after = int(np.asarray(loaded.optimizer.iterations))
    best = hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=f"{path}.best.{hvd.rank()}.h5")
    loaded.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[best])

    state = hvd.elastic.KerasState(loaded, epoch=3)
    saved = np.asarray(loaded.get_weights()[0]).copy()
    loaded.set_weights([w + 1.0 for w in loaded.get_weights()])
    state.restore()
    return {
        "ramp": ramp,
        "distributed": hvd.is_distributed(loaded.optimizer),
        "keras2": type(loaded).__module__.startswith("tf_keras"),
        "iterations": (before, after),
        "best_saved": os.path.exists(f"{path}.best.{hvd.rank()}.h5"),
        "restored": bool(np.allclose(np.asarray(loaded.get_weights()[0]), saved)),
        "epoch": state.epoch,
    }


def test_callbacks_load_model_and_elastic_state_on_keras2(tmp_path: Path) -> None:
    size, initial, warmup_epochs, steps = 2, 0.4, 2, 4
    expected_ramp = [
        initial / size * ((epoch + (batch + 1) / steps) * (size - 1) / warmup_epochs + 1)
        for epoch in range(warmup_epochs)
        for batch in range(steps)
    ]
    for got in run_ranks(_callbacks_and_load, 2, args=(str(tmp_path / "model.h5"),), env=ENV, timeout_s=150):
        np.testing.assert_allclose(got.pop("ramp"), expected_ramp, rtol=1e-6)
        assert got == {
            "distributed": True,
            "keras2": True,
            "iterations": (2, 4),
            "best_saved": True,
            "restored": True,
            "epoch": 3,
        }
