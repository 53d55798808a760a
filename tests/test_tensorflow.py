"""shoal.tensorflow: every collective on tf.Tensors against a numpy reference on 2 and 3 ranks, eager and inside
tf.function; gradients of the ops; DistributedGradientTape on N ranks x batch B against one process with N*B;
mismatches raise on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from conftest import REPO, SHOALRUN, clean_env
from shoal.testing import run_ranks

pytest.importorskip("tensorflow", reason="TensorFlow is not installed (pip install 'shoal[tensorflow]')")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
TOLERANCE = 1e-6
"""Largest difference between N ranks and one process: float32 sums taken in another order."""


def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    return tf


def _inputs(rank: int) -> dict[str, np.ndarray]:
    """Each rank's inputs (the test computes the references from the same function)."""
    generator = np.random.default_rng(100 + rank)
    return {
        "x": generator.standard_normal((3, 4)).astype(np.float32),
        "ints": np.arange(6, dtype=np.int32).reshape(2, 3) * (rank + 1),
        "rows": generator.standard_normal((rank + 1, 2)).astype(np.float32),  # dim 0 differs per rank
        "block": generator.standard_normal((6, 2)).astype(np.float32),
    }


def _collectives(mode: str) -> dict[str, Any]:
    """Run every collective (eagerly, or inside one tf.function) and return the results as numpy."""
    tf = _tf()
    import shoal.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    data = {k: tf.constant(v) for k, v in _inputs(rank).items()}
    splits = tf.constant([(rank + i) % 2 + 1 for i in range(size)], tf.int32)  # rows sent to each rank
    to_send = tf.reshape(tf.range(int(tf.reduce_sum(splits)) * 2, dtype=tf.float32), [-1, 2]) + 100.0 * rank

    def body(x: Any, ints: Any, rows: Any, block: Any, send: Any, send_splits: Any) -> dict[str, Any]:
        sliced = tf.IndexedSlices(rows, tf.range(tf.shape(rows)[0]) + rank, dense_shape=tf.constant([8, 2]))
        sparse = hvd.allreduce(sliced, op=hvd.Sum)
        received, received_splits = hvd.alltoall(send, send_splits)
        return {
            "average": hvd.allreduce(x),
            "sum": hvd.allreduce(x, op=hvd.Sum),
            "min": hvd.allreduce(x, op=hvd.Min),
            "max": hvd.allreduce(x, op=hvd.Max),
            "product": hvd.allreduce(x, op=hvd.Product),
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
            "fp16": hvd.allreduce(x, compression=hvd.Compression.fp16),
            "average_flag": hvd.allreduce(x, average=False),
            "ints": hvd.allreduce(ints, op=hvd.Sum),
            "grouped": hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Sum),
            "allgather": hvd.allgather(rows),
            "grouped_allgather": hvd.grouped_allgather([rows, x]),
            "broadcast": hvd.broadcast(x, size - 1),
            "alltoall_even": hvd.alltoall(block[: size * 2]),
            "alltoall": received,
            "alltoall_splits": received_splits,
            "reducescatter": hvd.reducescatter(block, op=hvd.Sum),
            "reducescatter_avg": hvd.reducescatter(block[:5]),
            "grouped_reducescatter": hvd.grouped_reducescatter([block, block * 2], op=hvd.Sum),
            "sparse_values": sparse.values,
            "sparse_indices": sparse.indices,
        }

    args = (data["x"], data["ints"], data["rows"], data["block"], to_send, splits)
    results = tf.function(body)(*args) if mode == "function" else body(*args)
    out = tf.nest.map_structure(lambda t: t.numpy(), results)
    variable = tf.Variable(data["x"])
    hvd.broadcast_variables([variable], root_rank=1)
    out["broadcast_variables"] = variable.numpy()
    inplace = tf.Variable(data["x"])
    hvd.broadcast_([inplace], root_rank=0)
    out["broadcast_inplace"] = inplace.numpy()
    out["object"] = hvd.broadcast_object({"from": rank}, root_rank=size - 1)
    out["objects"] = hvd.allgather_object(("rank", rank))
    out["rank_op"] = int(hvd.rank_op().numpy())
    out["size_op"] = int(hvd.size_op().numpy())
    return out


def _reference(size: int) -> dict[str, Any]:
    inputs = [_inputs(r) for r in range(size)]
    xs = np.stack([i["x"] for i in inputs])
    blocks = [i["block"] for i in inputs]
    rows_per_rank = [len(c) for c in np.array_split(np.arange(6), size)]
    starts = np.cumsum([0, *rows_per_rank])
    summed_block = np.sum(blocks, axis=0)
    avg_rows = [len(c) for c in np.array_split(np.arange(5), size)]
    avg_starts = np.cumsum([0, *avg_rows])
    return {
        "average": xs.mean(0),
        "sum": xs.sum(0),
        "min": xs.min(0),
        "max": xs.max(0),
        "product": xs.prod(0),
        "scaled": xs.sum(0) * 0.5 * 3.0,
        "ints": np.sum([i["ints"] for i in inputs], axis=0),
        "allgather": np.concatenate([i["rows"] for i in inputs]),
        "broadcast": xs[size - 1],
        "reducescatter": [summed_block[starts[r] : starts[r + 1]] for r in range(size)],
        "reducescatter_avg": [np.mean([b[:5] for b in blocks], axis=0)[avg_starts[r] : avg_starts[r + 1]] for r in range(size)],
        "broadcast_variables": xs[1],
        "broadcast_inplace": xs[0],
    }


def _alltoall_reference(size: int, rank: int) -> tuple[np.ndarray, list[int]]:
    sent = []
    for source in range(size):
        splits = [(source + i) % 2 + 1 for i in range(size)]
        data = np.arange(sum(splits) * 2, dtype=np.float32).reshape(-1, 2) + 100.0 * source
        start = sum(splits[:rank])
        sent.append((data[start : start + splits[rank]], splits[rank]))
    return np.concatenate([s[0] for s in sent]), [s[1] for s in sent]


def _both_modes(fn_name: str) -> dict[str, Any]:
    """``fn`` eagerly, then inside tf.function, in one process (TensorFlow starts once per rank)."""
    fn = globals()[fn_name]
    return {mode: fn(mode) for mode in ("eager", "function")}


@pytest.mark.parametrize("size", [2, 3])
def test_every_collective_matches_numpy_eager_and_in_tf_function(size: int) -> None:
    runs = run_ranks(_both_modes, size, args=("_collectives",), env=ENV, timeout_s=150)
    for mode in ("eager", "function"):
        _check_collectives([run[mode] for run in runs], size)


def _check_collectives(results: list[dict[str, Any]], size: int) -> None:
    expected = _reference(size)
    close = {"rtol": 1e-5, "atol": 1e-6}
    for rank, got in enumerate(results):
        for key in ("average", "sum", "min", "max", "product", "scaled", "allgather", "broadcast"):
            np.testing.assert_allclose(got[key], expected[key], err_msg=key, **close)
        np.testing.assert_allclose(got["average_flag"], expected["sum"], **close)  # average=False: Sum
        np.testing.assert_allclose(got["fp16"], expected["average"], rtol=2e-3, atol=2e-3)  # float16 on the wire
        assert got["fp16"].dtype == np.float32
        np.testing.assert_array_equal(got["ints"], expected["ints"])
        np.testing.assert_allclose(got["grouped"][0], expected["sum"], **close)
        np.testing.assert_allclose(got["grouped"][1], 2 * expected["sum"], **close)
        np.testing.assert_allclose(got["grouped_allgather"][0], expected["allgather"], **close)
        even = np.concatenate([_inputs(source)["block"][rank * 2 : rank * 2 + 2] for source in range(size)])
        np.testing.assert_allclose(got["alltoall_even"], even, **close)
        received, received_splits = _alltoall_reference(size, rank)
        np.testing.assert_allclose(got["alltoall"], received, **close)
        assert got["alltoall_splits"].tolist() == received_splits
        np.testing.assert_allclose(got["reducescatter"], expected["reducescatter"][rank], **close)
        np.testing.assert_allclose(got["reducescatter_avg"], expected["reducescatter_avg"][rank], **close)
        np.testing.assert_allclose(got["grouped_reducescatter"][1], 2 * expected["reducescatter"][rank], **close)
        gathered_rows = np.concatenate([_inputs(r)["rows"] for r in range(size)])
        np.testing.assert_allclose(got["sparse_values"], gathered_rows, **close)  # Horovod: allgathered, not summed
        assert got["sparse_indices"].tolist() == [i + r for r in range(size) for i in range(r + 1)]
        np.testing.assert_allclose(got["broadcast_variables"], expected["broadcast_variables"], **close)
        np.testing.assert_allclose(got["broadcast_inplace"], expected["broadcast_inplace"], **close)
        assert got["object"] == {"from": size - 1}
        assert got["objects"] == [("rank", r) for r in range(size)]
        assert (got["rank_op"], got["size_op"]) == (rank, size)


def _gradients(mode: str) -> dict[str, Any]:
    tf = _tf()
    import shoal.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = tf.Variable(np.full((2, 2), rank + 1.0, np.float32))

    def grads() -> list[Any]:
        with tf.GradientTape(persistent=True) as tape:
            summed = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * (rank + 1.0))
            gathered = tf.reduce_sum(hvd.allgather(x) * tf.reshape(tf.range(size * 4, dtype=tf.float32), [size * 2, 2]))
            broadcast = tf.reduce_sum(hvd.broadcast(x, 0) * 3.0)
        return [tape.gradient(summed, x), tape.gradient(gathered, x), tape.gradient(broadcast, x)]

    values = tf.function(grads)() if mode == "function" else grads()
    return {"allreduce": values[0].numpy(), "allgather": values[1].numpy(), "broadcast": values[2].numpy()}


def test_gradients_of_the_collectives_eager_and_in_tf_function() -> None:
    size = 2
    runs = run_ranks(_both_modes, size, args=("_gradients",), env=ENV, timeout_s=120)
    weights = np.arange(size * 4, dtype=np.float32).reshape(size * 2, 2)
    for rank, got in [(r, run[mode]) for r, run in enumerate(runs) for mode in ("eager", "function")]:
        # d/dx of sum(Sum-allreduce(x) * w_r): the gradient is Sum-allreduced: sum over ranks of w_r
        np.testing.assert_allclose(got["allreduce"], np.full((2, 2), sum(r + 1.0 for r in range(size))))
        # allgather: the Average of every rank's upstream gradient, this rank's rows
        np.testing.assert_allclose(got["allgather"], weights[rank * 2 : rank * 2 + 2])
        # broadcast: the Average of the upstream gradients on the root, zero elsewhere
        np.testing.assert_allclose(got["broadcast"], np.full((2, 2), 3.0 if rank == 0 else 0.0))


def _train(global_batch: int, steps: int, mode: str) -> list[float]:
    """Linear regression with SGD on this rank's contiguous shard of each global batch."""
    tf = _tf()
    import shoal.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    generator = np.random.default_rng(7)
    x_all = generator.standard_normal((steps * global_batch, 5)).astype(np.float32)
    y_all = (x_all @ generator.standard_normal((5, 1)) + 0.1).astype(np.float32)
    weights = tf.Variable(np.random.default_rng(rank).standard_normal((5, 1)).astype(np.float32))  # ranks differ
    bias = tf.Variable([0.5 * rank])
    hvd.broadcast_variables([weights, bias], root_rank=0)
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    local = global_batch // size

    def step(x: Any, y: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(x @ weights + bias - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, [weights, bias])
        optimizer.apply_gradients(zip(grads, [weights, bias], strict=True))

    run = tf.function(step) if mode == "function" else step
    for index in range(steps):
        start = index * global_batch + rank * local
        run(tf.constant(x_all[start : start + local]), tf.constant(y_all[start : start + local]))
    return [*weights.numpy().flatten().tolist(), *bias.numpy().tolist()]


def _train_both(global_batch: int, steps: int) -> dict[str, list[float]]:
    return {mode: _train(global_batch, steps, mode) for mode in ("eager", "function")}


def test_gradient_tape_on_two_ranks_matches_one_process_with_the_global_batch() -> None:
    twos = run_ranks(_train_both, 2, args=(8, 6), env=ENV, timeout_s=120)
    ones = run_ranks(_train_both, 1, args=(8, 6), env=ENV, timeout_s=120)[0]
    for mode in ("eager", "function"):
        two, one = [run[mode] for run in twos], ones[mode]
        assert two[0] == two[1], mode  # the ranks agree exactly
        assert max(abs(a - b) for a, b in zip(two[0], one, strict=True)) <= TOLERANCE, (mode, two[0], one)
        assert max(abs(a - b) for a, b in zip(one, _train_start(), strict=True)) > 0.05  # it trained


def _train_start() -> list[float]:
    return [*np.random.default_rng(0).standard_normal((5, 1)).astype(np.float32).flatten().tolist(), 0.0]


def _refusals() -> list[str]:
    tf = _tf()
    import shoal.tensorflow as hvd

    hvd.init()
    messages = []
    try:  # shapes that differ between the ranks: every rank raises, none hangs
        hvd.allreduce(tf.ones([2] if hvd.rank() == 0 else [3]), name="mismatched")
        messages.append("accepted")
    except Exception as error:
        messages.append(str(error))
    for attempt in (
        lambda: hvd.allreduce(tf.ones([1]), average=True, op=hvd.Sum),
        lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0),
        lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([4, 2])), op=hvd.Adasum),
        lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([4, 2])), op=hvd.Max),
    ):
        try:
            attempt()
            messages.append("accepted")
        except (ValueError, NotImplementedError) as error:
            messages.append(str(error))
    return messages


def test_mismatches_and_wrong_arguments_raise_on_every_rank_with_a_reason() -> None:
    """In rank processes: TensorFlow stays out of the test runner."""
    for messages in run_ranks(_refusals, 2, env=ENV, timeout_s=90):
        assert "mismatched" in messages[0] and "shape" in messages[0].lower(), messages[0]
        assert "supersedes average" in messages[1]
        assert "gradient_predivide_factor" in messages[2]
        assert "Adasum does not support sparse" in messages[3]
        assert "only Sum and Average" in messages[4]


@pytest.mark.parametrize("workers", [1, 2])
def test_tf2_digits_example_reaches_95_percent(workers: int) -> None:
    script = [sys.executable, str(REPO / "examples" / "tf2_digits.py")]
    command = script if workers == 1 else [*SHOALRUN, "-np", str(workers), *script]
    env = {**clean_env(), **ENV}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    summary = json.loads(line.split(":", 1)[1] if line.startswith("[0]") else line)
    assert summary["example"] == "tf2_digits" and summary["world"] == workers
    assert summary["test_accuracy"] >= 0.95, summary


def test_tensorflow2_synthetic_benchmark_reports_rates() -> None:
    script = [
        sys.executable,
        str(REPO / "examples" / "tensorflow2_synthetic_benchmark.py"),
        "--model",
        "mlp",
        "--num-iters",
        "2",
    ]
    command = [*SHOALRUN, "-np", "2", *script]
    result = subprocess.run(command, env={**clean_env(), **ENV}, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1].split(":", 1)[1])
    assert summary["example"] == "tensorflow2_synthetic_benchmark" and summary["world"] == 2
    assert summary["img_sec_per_worker"] > 0 and summary["total_img_sec"] > 0


def test_train_tf_benchmark_compares_shoal_with_multi_worker_mirrored_strategy() -> None:
    command = [sys.executable, "-m", "shoal.bench.train_tf", "--workers", "2", "--models", "digits"]
    command += ["--steps", "3", "--warmup", "1", "--rounds", "1", "--batch-size", "16"]
    result = subprocess.run(command, env={**clean_env(), **ENV}, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "train_tf" and summary["workers"] == 2 and set(summary["models"]) == {"digits"}
    digits = summary["models"]["digits"]
    assert digits["shoal_ips"] > 0 and digits["tf_ips"] > 0
    assert digits["ratio"] == pytest.approx(digits["shoal_ips"] / digits["tf_ips"], abs=0.002)
