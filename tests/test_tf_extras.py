"""shoal.tensorflow's SyncBatchNormalization (2 ranks x 3 rows equal one BatchNormalization over the 6 rows, eager
and in tf.function), its DistributedOptimizer, size ops read at run time; elastic TensorFlow and Keras: the states
commit, restore and sync, the callbacks keep epoch/batch and commit when told, a failed collective inside a
tf.function surfaces as HorovodInternalError, and the elastic Keras example survives a SIGKILLed worker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from conftest import REPO, SHOALRUN, clean_env, process_alive
from shoal.testing import run_ranks

pytest.importorskip("tensorflow", reason="TensorFlow is not installed (pip install 'shoal[tensorflow]')")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
TOLERANCE = 1e-5
"""Largest difference from the one-process reference: float32 sums taken in another order."""


def _sync_batch_norm(tf: Any, keras: Any, hvd: Any, rank: int) -> dict[str, float]:
    """SyncBatchNormalization on this rank's 3 rows against BatchNormalization on all 6: outputs, input gradients,
    gamma/beta gradients (summed over ranks) and moving statistics; eager and compiled."""
    generator = np.random.default_rng(0)
    data = (generator.standard_normal((6, 4)) * [1.0, 2.0, 3.0, 4.0] + [0.0, 1.0, 2.0, 3.0]).astype(np.float32)
    weights = tf.constant(generator.standard_normal((6, 4)).astype(np.float32))
    rows = slice(3 * rank, 3 * rank + 3)
    errors = {}
    for mode in ("eager", "function"):
        sync, plain = hvd.SyncBatchNormalization(momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)

        def step(layer: Any, x: Any, w: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * w)
            dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
            return y, dx, dgamma, dbeta

        run = tf.function(step) if mode == "function" else step
        y, dx, dgamma, dbeta = run(sync, tf.constant(data[rows]), weights[rows])
        dgamma, dbeta = (hvd.allreduce(g, op=hvd.Sum) for g in (dgamma, dbeta))  # each rank's loss is its share
        ref_y, ref_dx, ref_dgamma, ref_dbeta = step(plain, tf.constant(data), weights)
        pairs = [
            (y, ref_y[3 * rank : 3 * rank + 3]),
            (dx, ref_dx[3 * rank : 3 * rank + 3]),
            (dgamma, ref_dgamma),
            (dbeta, ref_dbeta),
            (sync.moving_mean, plain.moving_mean),
            (sync.moving_variance, plain.moving_variance),
        ]
        errors[mode] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)
    return errors


def _extras() -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import shoal.keras as hvd_keras
    import shoal.tensorflow as hvd
    from shoal.exceptions import HorovodInternalError

    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank = hvd.rank()
    out: dict[str, Any] = {"sync_batch_norm": _sync_batch_norm(tf, keras, hvd, rank)}

    # The TF module's DistributedOptimizer hands Keras optimizers to shoal.keras and refuses the rest clearly.
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum)
    out["optimizer"] = [type(wrapped).__name__, hvd_keras.is_distributed(wrapped)]
    refusals = []
    for bad, options in (
        (tf.compat.v1.train.GradientDescentOptimizer(0.1), {}),
        (object(), {}),
        (keras.optimizers.SGD(0.1), {"op": hvd.Adasum}),
    ):
        try:
            hvd.DistributedOptimizer(bad, **options)
            refusals.append("accepted")
        except ValueError as error:
            refusals.append(str(error))
    out["refusals"] = refusals

    @tf.function
    def sizes() -> Any:
        return hvd.size_op(), hvd.rank_op(), hvd.local_size_op()

    out["ops"] = [int(v) for v in sizes()]
    out["size_op_is_runtime"] = "EagerPyFunc" in {op.type for op in sizes.get_concrete_function().graph.get_operations()}

    # PartialDistributedGradientTape: the shared layer's gradient averaged, the local layer's kept and divided by size.
    shared_layer, local_layer = keras.layers.Dense(1), keras.layers.Dense(1)
    local_layer(shared_layer(tf.ones((1, 1))))
    with tf.GradientTape() as tape:
        loss = (rank + 1.0) * (tf.reduce_sum(shared_layer.kernel) + tf.reduce_sum(local_layer.kernel))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local_layer])
    grads = tape.gradient(loss, [shared_layer.kernel, local_layer.kernel])
    out["partial_tape"] = [float(g.numpy().ravel()[0]) for g in grads]

    # TensorFlowState: sync takes rank 0's, commit saves, restore rolls back.
    variable = tf.Variable([float(rank)] * 3)
    state = hvd.elastic.TensorFlowState([variable], epoch=rank + 5)
    state.sync()
    synced = [variable.numpy().tolist(), state.epoch]
    variable.assign([7.0] * 3)
    state.epoch = 9
    state.commit()
    variable.assign([-1.0] * 3)
    state.epoch = 11
    state.restore()
    out["tf_state"] = {"synced": synced, "restored": [variable.numpy().tolist(), state.epoch]}
    try:
        hvd.elastic.TensorFlowState()
        out["tf_state_without_variables"] = "accepted"
    except ValueError as error:
        out["tf_state_without_variables"] = str(error)

    # KerasState with the elastic callbacks around a real fit.
    keras.utils.set_random_seed(rank)  # the ranks start apart
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    keras_state = hvd.elastic.TensorFlowKerasState(model, batch=0, epoch=0)
    keras_state.sync()
    out["keras_synced"] = float(sum(np.abs(np.asarray(w)).sum() for w in model.get_weights()))
    before = [np.asarray(w).copy() for w in model.get_weights()]
    count = len(model.optimizer.variables)
    commits = []
    original_commit = keras_state.commit
    keras_state.commit = lambda: (commits.append(1), original_commit())  # type: ignore[method-assign]
    callbacks = [
        hvd_keras.elastic.CommitStateCallback(keras_state, batches_per_commit=2),
        hvd_keras.elastic.UpdateBatchStateCallback(keras_state),
        hvd_keras.elastic.UpdateEpochStateCallback(keras_state),
    ]
    x = np.random.default_rng(rank).standard_normal((10, 3)).astype(np.float32)
    model.fit(x, x[:, :2], batch_size=2, epochs=2, callbacks=callbacks, verbose=0)  # 5 batches per epoch
    out["keras_callbacks"] = {"commits": len(commits), "epoch": keras_state.epoch, "batch": keras_state.batch}
    out["optimizer_variables_kept"] = len(model.optimizer.variables) == count
    model.fit(x, x[:, :2], batch_size=2, epochs=1, verbose=0)  # trained past the last commit ...
    keras_state.restore()  # ... and rolled back to it
    after_commit = [np.asarray(w) for w in model.get_weights()]
    out["keras_restored_to_commit"] = all(
        np.array_equal(a, b) for a, b in zip(after_commit, [np.asarray(v) for v in keras_state._saved_values], strict=False)
    ) and not all(np.array_equal(a, b) for a, b in zip(after_commit, before, strict=True))

    # A collective that fails inside a tf.function surfaces from elastic.run as HorovodInternalError.
    def fail(value: Any) -> Any:
        raise HorovodInternalError("peer 3 died")

    @hvd.elastic.run
    def train(_state: Any) -> None:
        tf.function(lambda: tf.py_function(fail, [tf.constant(1.0)], tf.float32))()

    try:
        train(state)
        out["surfaced"] = "nothing raised"
    except HorovodInternalError as error:
        out["surfaced"] = f"HorovodInternalError: {error}"
    hvd.shutdown()
    return out


def test_sync_batch_norm_optimizer_size_ops_and_elastic_states_on_two_ranks() -> None:
    results = run_ranks(_extras, 2, env=ENV, timeout_s=180)
    for rank, got in enumerate(results):
        for mode, error in got["sync_batch_norm"].items():
            assert error <= TOLERANCE, (rank, mode, error)
        assert got["optimizer"] == ["SGD", True]
        assert "TF1 optimizer" in got["refusals"][0] and "GradientDescentOptimizer" in got["refusals"][0]
        assert "doesn't inherit" in got["refusals"][1]
        assert "Adasum" in got["refusals"][2]
        assert got["ops"] == [2, rank, 2] and got["size_op_is_runtime"]
        assert got["partial_tape"] == [1.5, (rank + 1) / 2]  # (1 + 2) / 2; this rank's own, over 2 ranks
        assert got["tf_state"] == {"synced": [[0.0, 0.0, 0.0], 5], "restored": [[7.0, 7.0, 7.0], 9]}
        assert "needs the variables" in got["tf_state_without_variables"]
        # 5 batches an epoch, a commit every 2: after batches 2 and 4, at epoch end; then 1, 3, 5, epoch end.
        assert got["keras_callbacks"] == {"commits": 7, "epoch": 2, "batch": 0}
        assert got["optimizer_variables_kept"]
        assert got["keras_restored_to_commit"]
        assert got["surfaced"] == "HorovodInternalError: peer 3 died"
    assert results[0]["keras_synced"] == results[1]["keras_synced"]  # rank 1 took rank 0's weights


def _output(lines: list[str], pattern: str, timeout_s: float, process: subprocess.Popen[str]) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        for line in list(lines):
            if match := regex.search(line):
                return match
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(lines[-40:]))


@pytest.mark.timeout(240)
def test_elastic_keras_example_survives_a_sigkilled_worker() -> None:
    import threading

    command = [*SHOALRUN, "-np", "2", "--min-np", "1", sys.executable, str(REPO / "examples" / "keras_elastic_digits.py")]
    process = subprocess.Popen(
        [*command, "--epochs", "5", "--batch-delay", "0.05"],
        env={**clean_env(), **ENV},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in process.stdout or []), daemon=True)
    reader.start()
    try:
        pids = [int(_output(lines, rf"^\[{r}\]<stdout>:worker pid (\d+) starts", 120, process).group(1)) for r in (0, 1)]
        _output(lines, r"^\[0\]<stdout>:epoch 2 done, world 2", 120, process)
        os.kill(pids[1], signal.SIGKILL)
        assert process.wait(timeout=150) == 0, "\n".join(lines[-30:])
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=10)
    summary = json.loads(_output(lines, r'(\{"example": "keras_elastic_digits".*\})', 1, process).group(1))
    assert summary["world"] == 1 and summary["resets"] == 1 and summary["epochs"] == 5, summary
    assert summary["test_accuracy"] >= 0.9, summary
    assert any("restoring the last commit" in line for line in lines)
    assert not any(process_alive(pid) for pid in pids), "a worker outlived the job"
