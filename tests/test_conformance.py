"""The conformance matrix: every op x every front end x {2 ranks, 3 ranks, a process set of 2 of 3}.

Each row runs one op on one front end and checks:
- the forward value against one numpy reference;
- the gradient against Horovod's definition, written here in numpy from Horovod 0.28's code (independently of
  ``shoal.core.rules``, so a changed factor in the table fails every front end);
- a cross-rank mismatch (rank 1 submits another shape) raising the framework's Horovod class on every rank, and the
  next call working;
- the errors a rank finds alone (bad splits, an uneven split, a scalar reducescatter, a bad root rank, an op or a dtype
  Horovod refuses) raising Horovod's class, in a graph as eagerly.

The rows come from ``ROWS`` (the ops) and ``FRONT_ENDS``; a new op or front end gets its rows by adding one entry.
One launched job per world size runs every row of every front end, so the matrix costs two jobs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from shoal.testing import run_ranks

tf_missing = False
try:
    import tensorflow  # noqa: F401
except ImportError:
    tf_missing = True

TOLERANCE = 1e-5
"""float64 inputs; sums taken in another order than numpy's."""


@dataclass(frozen=True)
class Row:
    """One op of the matrix, with its arguments."""

    name: str
    op: str
    """allreduce, grouped_allreduce, allgather, broadcast, alltoall, reducescatter."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """reduce (Sum/Average/Min/Max/Product), prescale, postscale."""


ROWS = [
    Row("allreduce.sum", "allreduce", {"reduce": "Sum"}),
    Row("allreduce.average", "allreduce", {"reduce": "Average"}),
    Row("allreduce.max", "allreduce", {"reduce": "Max"}),
    Row("allreduce.scaled", "allreduce", {"reduce": "Average", "prescale": 0.5, "postscale": 3.0}),
    Row("grouped_allreduce.sum", "grouped_allreduce", {"reduce": "Sum"}),
    Row("allgather", "allgather"),
    Row("broadcast", "broadcast"),
    Row("alltoall", "alltoall"),
    Row("reducescatter.sum", "reducescatter", {"reduce": "Sum"}),
    Row("reducescatter.average", "reducescatter", {"reduce": "Average"}),
    Row("reducescatter.scaled", "reducescatter", {"reduce": "Sum", "prescale": 2.0, "postscale": 0.25}),
]
FIRST_ROW_OF_OP = {
    next(r.name for r in ROWS if r.op == op) for op in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
}
"""Each op's mismatches run once per front end, with its first row."""
FRONT_ENDS = ["torch", "tf_eager", "tf_function", "tf_v1_graph"]
"""torch; TensorFlow eager; TensorFlow inside a tf.function; a TensorFlow 1 graph run by a tf.compat.v1 Session."""
MISMATCH_CLASS = {
    "torch": "RuntimeError",
    "tf_eager": "FailedPreconditionError",
    "tf_function": "FailedPreconditionError",
    "tf_v1_graph": "FailedPreconditionError",
}

"""Horovod's class for a cross-rank mismatch: torch's RuntimeError; TensorFlow's FailedPreconditionError."""


# ----- inputs and the numpy references -----


def row_input(row: Row, set_rank: int) -> np.ndarray:
    """Set rank ``set_rank``'s input: float64, different on every rank; allgather's first dimension differs too."""
    rows = set_rank + 1 if row.op == "allgather" else 6
    values = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * 0.5 + set_rank * 1.25 - 1.0
    return values


def upstream(row: Row, set_rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """The gradient each rank feeds backward: rank-dependent, so the references tell the rules apart."""
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 0.1 + 2.0 * set_rank + 1.0


def splits_of(set_rank: int, members: int) -> list[int]:
    """alltoall: rows this rank sends to each member (6 rows in all)."""
    base = [1] * members
    base[(set_rank + 1) % members] += 6 - members
    return base


def _reduce(stack: np.ndarray, reduce: str) -> np.ndarray:
    if reduce == "Sum":
        return stack.sum(0)
    if reduce == "Average":
        return stack.sum(0) / len(stack)
    if reduce == "Max":
        return stack.max(0)
    if reduce == "Min":
        return stack.min(0)
    return stack.prod(0)


def _rows_split(rows: int, members: int) -> list[int]:
    base, extra = divmod(rows, members)
    return [base + (1 if i < extra else 0) for i in range(members)]


def reference(row: Row, members: int, set_rank: int, root_set_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward value, gradient) on set rank ``set_rank``, from Horovod 0.28's definitions."""
    inputs = [row_input(row, r) for r in range(members)]
    pre, post = row.kwargs.get("prescale", 1.0), row.kwargs.get("postscale", 1.0)
    reduce = row.kwargs.get("reduce", "Sum")
    if row.op in ("allreduce", "grouped_allreduce"):
        forward = _reduce(np.stack([x * pre for x in inputs]), reduce) * post
        grads = [upstream(row, r, forward.shape) for r in range(members)]
        if reduce == "Max":  # Horovod's gradient of Max: the upstream gradients allreduced with Max
            return forward, np.stack(grads).max(0)
        # allreduce of the upstream gradients, with the forward's op and factors
        return forward, _reduce(np.stack([g * pre for g in grads]), reduce) * post
    if row.op == "allgather":
        forward = np.concatenate(inputs)
        grads = [upstream(row, r, forward.shape) for r in range(members)]
        mean = np.stack(grads).mean(0)
        offset = sum(inputs[r].shape[0] for r in range(set_rank))
        return forward, mean[offset : offset + inputs[set_rank].shape[0]]
    if row.op == "broadcast":
        forward = inputs[root_set_rank]
        grads = [upstream(row, r, forward.shape) for r in range(members)]
        mean = np.stack(grads).mean(0)
        return forward, mean if set_rank == root_set_rank else np.zeros_like(mean)
    if row.op == "alltoall":
        sends = [splits_of(r, members) for r in range(members)]
        pieces = []
        for source in range(members):
            start = sum(sends[source][:set_rank])
            pieces.append(inputs[source][start : start + sends[source][set_rank]])
        forward = np.concatenate(pieces)
        # The gradient goes back the way the rows came: rank s's upstream rows for the rows it got from us.
        outs = []
        for target in range(members):
            received = [sends[source][target] for source in range(members)]
            g = upstream(row, target, (sum(received), 2))
            start = sum(received[:set_rank])
            outs.append(g[start : start + received[set_rank]])
        return forward, np.concatenate(outs)
    if row.op == "reducescatter":
        total = _reduce(np.stack([x * pre for x in inputs]), reduce) * post
        counts = _rows_split(total.shape[0], members)
        start = sum(counts[:set_rank])
        forward = total[start : start + counts[set_rank]]
        # Horovod: the upstream gradient times the set size for Sum, times both factors, then allgathered.
        factor = (members if reduce == "Sum" else 1) * pre * post
        grads = [upstream(row, r, (counts[r], 2)) * factor for r in range(members)]
        return forward, np.concatenate(grads)
    raise AssertionError(row.op)


# ----- the rows on each front end, inside the workers -----


def _torch_case(row: Row, x: np.ndarray, weight: np.ndarray, set_rank: int, root: int, process_set: Any) -> tuple[Any, Any]:
    import torch

    import shoal.torch as hvd

    tensor = torch.tensor(x, requires_grad=True)
    op = getattr(hvd, row.kwargs.get("reduce", "Sum"))
    factors = {"prescale_factor": row.kwargs.get("prescale", 1.0), "postscale_factor": row.kwargs.get("postscale", 1.0)}
    if row.op == "allreduce":
        out = hvd.allreduce(tensor, op=op, process_set=process_set, **factors)
    elif row.op == "grouped_allreduce":
        out = hvd.grouped_allreduce([tensor], op=op, process_set=process_set, **factors)[0]
    elif row.op == "allgather":
        out = hvd.allgather(tensor, process_set=process_set)
    elif row.op == "broadcast":
        out = hvd.broadcast(tensor, root, process_set=process_set)
    elif row.op == "alltoall":
        out, _ = hvd.alltoall(tensor, splits=splits_of(set_rank, process_set.size()), process_set=process_set)
    else:
        out = hvd.reducescatter(tensor, op=op, process_set=process_set, **factors)
    out.backward(torch.tensor(weight))
    assert tensor.grad is not None
    return out.detach().numpy(), tensor.grad.numpy()


def _tf_op(row: Row, tensor: Any, set_rank: int, root: int, process_set: Any) -> Any:
    import shoal.tensorflow as hvd

    op = getattr(hvd, row.kwargs.get("reduce", "Sum"))
    factors = {"prescale_factor": row.kwargs.get("prescale", 1.0), "postscale_factor": row.kwargs.get("postscale", 1.0)}
    if row.op == "allreduce":
        return hvd.allreduce(tensor, op=op, process_set=process_set, **factors)
    if row.op == "grouped_allreduce":
        return hvd.grouped_allreduce([tensor], op=op, process_set=process_set, **factors)[0]
    if row.op == "allgather":
        return hvd.allgather(tensor, process_set=process_set)
    if row.op == "broadcast":
        return hvd.broadcast(tensor, root, process_set=process_set)
    if row.op == "alltoall":
        return hvd.alltoall(tensor, splits=splits_of(set_rank, process_set.size()), process_set=process_set)[0]
    return hvd.reducescatter(tensor, op=op, process_set=process_set, **factors)


def _tf_case(compiled: bool) -> Callable[..., tuple[Any, Any]]:
    def case(row: Row, x: np.ndarray, weight: np.ndarray, set_rank: int, root: int, process_set: Any) -> tuple[Any, Any]:
        import tensorflow as tf

        def step(value: Any) -> tuple[Any, Any]:
            with tf.GradientTape() as tape:
                tape.watch(value)
                out = _tf_op(row, value, set_rank, root, process_set)
                loss = tf.reduce_sum(out * tf.constant(weight))
            return out, tape.gradient(loss, value)

        runner = tf.function(step) if compiled else step
        out, grad = runner(tf.constant(x))
        return out.numpy(), grad.numpy()

    return case


def _tf_v1_case(row: Row, x: np.ndarray, weight: np.ndarray, set_rank: int, root: int, process_set: Any) -> tuple[Any, Any]:
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        value = tf.constant(x)
        out = _tf_op(row, value, set_rank, root, process_set)
        gradient = tf.compat.v1.gradients(tf.reduce_sum(out * tf.constant(weight)), value)[0]
        with tf.compat.v1.Session(graph=graph) as session:
            return tuple(session.run([out, gradient]))  # type: ignore[return-value]


def _tf_v1_broadcast_inplace(set_rank: int, root: int, process_set: Any) -> list[list[float]]:
    """Horovod's in-place broadcast of variables in a TF1 graph and session, a RefVariable and a ResourceVariable."""
    import tensorflow as tf

    import shoal.tensorflow as hvd

    graph = tf.Graph()
    with graph.as_default():
        start = tf.constant([1.0, 2.0]) * (set_rank + 1)
        variables = [tf.compat.v1.Variable(start, use_resource=False), tf.compat.v1.Variable(start * 10, use_resource=True)]
        assigned = hvd.broadcast_(variables, root, process_set=process_set)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(assigned)
            return [session.run(v).tolist() for v in variables]


CASES: dict[str, Callable[..., tuple[Any, Any]]] = {
    "torch": _torch_case,
    "tf_eager": _tf_case(False),
    "tf_function": _tf_case(True),
    "tf_v1_graph": _tf_v1_case,
}


MISMATCHES = {
    "allreduce": ("shape", "dtype", "op"),
    "allgather": ("shape", "dtype"),
    "broadcast": ("shape", "dtype", "root"),
    "alltoall": ("shape", "dtype"),
    "reducescatter": ("shape", "dtype", "op"),
}
"""What one rank (set rank 1) changes: the shape (beyond the first dimension for allgather and alltoall, which
allow it to differ), the dtype, the reduce op, or the root rank."""


def _mismatch(front_end: str, row: Row, what: str, set_rank: int, ranks: list[int], process_set: Any) -> str:
    """One rank differs in ``what``; returns the classes each rank saw, and whether the message says what differs."""
    members = len(ranks)
    odd = set_rank == 1
    shape = (2 * members, 2 + (odd and what == "shape")) if row.op in ("allgather", "alltoall") else (6, 2)
    if row.op not in ("allgather", "alltoall") and what == "shape" and odd:
        shape = (7, 2)
    x = np.ones(shape, dtype=np.float32 if what == "dtype" and odd else np.float64)
    root = ranks[0] if what == "root" and odd else ranks[-1]
    reduce = "Average" if what == "op" and odd else row.kwargs.get("reduce", "Sum")
    changed = replace(row, kwargs={**row.kwargs, "reduce": reduce})
    try:
        if front_end == "torch":
            import torch

            _torch_forward_only(changed, torch.tensor(x), set_rank, root, process_set)
        else:
            import tensorflow as tf

            import shoal.tensorflow as hvd_tf

            def forward(value: Any) -> Any:
                if row.op == "alltoall":
                    return hvd_tf.alltoall(value, process_set=process_set)
                return _tf_op(changed, value, set_rank, root, process_set)

            if front_end == "tf_v1_graph":
                graph = tf.Graph()
                with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
                    session.run(forward(tf.constant(x)))
            else:
                (tf.function(forward) if front_end == "tf_function" else forward)(tf.constant(x))
    except Exception as error:
        classes = ",".join(cls.__name__ for cls in type(error).__mro__)
        return classes + ("|says Mismatched" if "Mismatched" in str(error) else "|does not say what differs")
    return "none"


ARGUMENT_ERRORS = {
    "alltoall.indivisible": "invalid",
    "alltoall.splits_past_the_rows": "invalid",
    "reducescatter.scalar": "invalid",
    "grouped_reducescatter.scalar": "invalid",
    "broadcast.bad_root": "invalid",
    "reducescatter.max": "unsupported",
    "allreduce.bool_sum": "dtype",
}
"""Errors one rank finds alone, before anything is sent (each rank here makes the same one): bad arguments, an op
Horovod does not run, a dtype the reduction cannot take. Named by their ``rules.ErrorKind``."""
ERROR_CLASS = {
    "torch": {"invalid": "ValueError", "unsupported": "RuntimeError", "dtype": "TypeError"},
    **{
        mode: {"invalid": "InvalidArgumentError", "unsupported": "AbortedError", "dtype": "TypeError"}
        for mode in FRONT_ENDS[1:]
    },
}
"""Horovod's class for each kind: its torch ops raise ValueError for an invalid argument and RuntimeError for an
aborted op; its TensorFlow ops InvalidArgumentError and AbortedError, in every mode; a dtype is refused with TypeError
where the op is built."""


def _argument_error_op(hvd: Any, case: str, x: Any, splits: Any, process_set: Any) -> Any:
    """Run ``case`` on ``hvd`` (shoal.torch or shoal.tensorflow): ``x`` the input, ``splits`` an alltoall's."""
    if case.startswith("alltoall."):
        return hvd.alltoall(x, splits=splits, process_set=process_set)
    if case == "reducescatter.scalar":
        return hvd.reducescatter(x, op=hvd.Sum, process_set=process_set)
    if case == "grouped_reducescatter.scalar":
        return hvd.grouped_reducescatter([x], op=hvd.Sum, process_set=process_set)[0]
    if case == "broadcast.bad_root":
        return hvd.broadcast(x, hvd.size(), process_set=process_set)
    if case == "reducescatter.max":
        return hvd.reducescatter(x, op=hvd.Max, process_set=process_set)
    return hvd.allreduce(x, op=hvd.Sum, process_set=process_set)


def _argument_error_input(case: str, members: int) -> tuple[np.ndarray, list[int] | None]:
    if case == "alltoall.indivisible":
        return np.ones((members + 1, 2)), None
    if case == "alltoall.splits_past_the_rows":
        return np.ones((2, 2)), [3] * members  # more rows than the tensor has
    if case.endswith(".scalar"):
        return np.array(1.0), None
    if case == "allreduce.bool_sum":
        return np.ones(2, dtype=bool), None
    return np.ones((2 * members, 2)), None


def _argument_error(front_end: str, case: str, process_set: Any) -> str:
    """The classes ``case`` raised on ``front_end`` (in its mode: eager, a tf.function or a v1 session), or "none".
    In a graph the input's shape and the splits are unknown until it runs, so the run finds what a build could not."""
    x, splits = _argument_error_input(case, process_set.size())
    try:
        if front_end == "torch":
            import torch

            import shoal.torch as hvd

            _argument_error_op(hvd, case, torch.from_numpy(x), splits, process_set)
        else:
            import tensorflow as tf

            import shoal.tensorflow as hvd_tf

            dtype = tf.as_dtype(x.dtype)
            split_values = np.array(splits or [0], dtype=np.int32)

            def step(value: Any, counts: Any) -> Any:
                return _argument_error_op(hvd_tf, case, value, None if splits is None else counts, process_set)

            if front_end == "tf_eager":
                step(tf.constant(x), tf.constant(split_values))
            elif front_end == "tf_function":
                signature = [tf.TensorSpec(None, dtype), tf.TensorSpec([None], tf.int32)]
                tf.function(step, input_signature=signature)(tf.constant(x), tf.constant(split_values))
            else:
                graph = tf.Graph()
                with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
                    value = tf.compat.v1.placeholder(dtype, shape=None)
                    counts = tf.compat.v1.placeholder(tf.int32, shape=[None])
                    session.run(step(value, counts), feed_dict={value: x, counts: split_values})
    except Exception as error:
        return ",".join(cls.__name__ for cls in type(error).__mro__)
    return "none"


def _torch_forward_only(row: Row, tensor: Any, set_rank: int, root: int, process_set: Any) -> Any:
    import shoal.torch as hvd

    if row.op == "allgather":
        return hvd.allgather(tensor, process_set=process_set)
    if row.op == "broadcast":
        return hvd.broadcast(tensor, root, process_set=process_set)
    if row.op == "alltoall":
        return hvd.alltoall(tensor, process_set=process_set)
    op = getattr(hvd, row.kwargs.get("reduce", "Sum"))
    if row.op == "allreduce":
        return hvd.allreduce(tensor, op=op, process_set=process_set)
    return hvd.reducescatter(tensor, op=op, process_set=process_set)


# ----- dtypes: data movement bit for bit, reductions where the arithmetic exists -----

TF_DTYPES = [
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "bfloat16", "float32", "float64", "bool", "complex64", "complex128",
]  # fmt: skip
"""Every fixed-width dtype TensorFlow has."""
TF_REDUCING = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "complex64"]


def _raw_bytes(count: int, set_rank: int, boolean: bool) -> np.ndarray:
    """Rank-dependent bytes (0/1 for bool): what a tensor of any dtype is made of here."""
    raw = (np.arange(count, dtype=np.int64) * 37 + 11 * set_rank + 5) % 256
    return (raw % 2 if boolean else raw).astype(np.uint8)


def _torch_tensor_of(dtype: str, rows: int, set_rank: int) -> Any:
    import torch

    torch_dtype = getattr(torch, dtype)
    width = torch.empty((), dtype=torch_dtype).element_size()
    raw = torch.from_numpy(_raw_bytes(rows * 2 * width, set_rank, dtype == "bool"))
    return raw.view(torch_dtype).reshape(rows, 2)


def _bytes_of(tensor: Any) -> list[int]:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).tolist()


def _dtype_rows(front_end: str, process_set: Any, set_rank: int, root: int) -> dict[str, Any]:
    """Each dtype through allgather, broadcast and alltoall (as bytes), and TensorFlow's reductions (as values)."""
    import torch

    from shoal.engine.validation import MOVABLE_DTYPES

    members = process_set.size()
    out: dict[str, Any] = {}
    names = list(MOVABLE_DTYPES) if front_end == "torch" else TF_DTYPES
    for dtype in names:
        tensor = _torch_tensor_of(dtype, 2 * members, set_rank)
        if front_end == "torch":
            import shoal.torch as hvd

            moved = {
                "allgather": hvd.allgather(tensor, process_set=process_set),
                "broadcast": hvd.broadcast(tensor, root, process_set=process_set),
                "alltoall": hvd.alltoall(tensor, process_set=process_set),
            }
        else:
            import tensorflow as tf

            import shoal.tensorflow as hvd_tf

            value = tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor))
            assert value.dtype.name == dtype, (value.dtype, dtype)
            results = {
                "allgather": hvd_tf.allgather(value, process_set=process_set),
                "broadcast": hvd_tf.broadcast(value, root, process_set=process_set),
                "alltoall": hvd_tf.alltoall(value, process_set=process_set),
            }
            moved = {op: torch.from_dlpack(tf.experimental.dlpack.to_dlpack(v)) for op, v in results.items()}
        for op, result in moved.items():
            out[f"{front_end}/dtype/{dtype}/{op}"] = [str(result.dtype).removeprefix("torch."), _bytes_of(result)]
    if front_end == "tf_eager":
        import tensorflow as tf

        import shoal.tensorflow as hvd_tf

        for dtype in TF_REDUCING:
            value = tf.cast(tf.constant([[1, -2], [3, 4]]) * (set_rank + 1), dtype)
            summed = hvd_tf.allreduce(value, op=hvd_tf.Sum, process_set=process_set)
            out[f"tf_eager/reduce/{dtype}"] = [summed.dtype.name, np.real(summed.numpy().astype(np.complex128)).tolist()]
    return out


def check_dtypes(results: Any, front_ends: list[str], members: list[int]) -> list[str]:
    """Every dtype bit for bit against the bytes each rank built; reductions against numpy."""
    import warnings

    warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
    failures = []
    count = len(members)
    root_set_rank = count - 1
    for front_end in front_ends:
        if front_end not in ("torch", "tf_eager"):
            continue
        keys = [k for k in results[members[0]] if k.startswith(f"{front_end}/dtype/")]
        from shoal.engine.validation import MOVABLE_DTYPES

        expected = 3 * len(MOVABLE_DTYPES if front_end == "torch" else TF_DTYPES)
        if len(keys) != expected:
            failures.append(f"{front_end}: {len(keys)} dtype cells, want {expected}")
        for key in keys:
            _, _, dtype, op = key.split("/")
            per_rank = [_bytes_of(_torch_tensor_of(dtype, 2 * count, r)) for r in range(count)]
            width = len(per_rank[0]) // (4 * count)
            for set_rank, rank in enumerate(members):
                if op == "allgather":
                    want = [byte for piece in per_rank for byte in piece]
                elif op == "broadcast":
                    want = per_rank[root_set_rank]
                else:  # an even split: 2 rows (4 elements) from every member
                    block = 4 * width
                    want = [byte for s in range(count) for byte in per_rank[s][set_rank * block : (set_rank + 1) * block]]
                got = results[rank][key]
                if got != [dtype, want]:
                    failures.append(f"{key} rank {rank}: got dtype {got[0]}, bytes differ: {got[1] != want}")
        if front_end == "tf_eager":
            for dtype in TF_REDUCING:
                want = (np.array([[1, -2], [3, 4]]) * sum(r + 1 for r in range(count))).tolist()
                for rank in members:
                    got = results[rank][f"tf_eager/reduce/{dtype}"]
                    if dtype.startswith("uint"):
                        want_here = (np.array(want) % 256).tolist()  # -2 wraps around in uint8
                    else:
                        want_here = want
                    if got[0] != dtype or not np.allclose(got[1], want_here):
                        failures.append(f"tf_eager/reduce/{dtype} rank {rank}: {got}")
    return failures


def _rows_on(front_ends: list[str], process_set: Any, ranks: list[int]) -> dict[str, Any]:
    """Every row of every front end on one process set, as seen by this rank."""
    import torch

    import shoal.torch as hvd

    set_rank = process_set.rank()
    root = ranks[-1]  # a global rank: the last member
    results: dict[str, Any] = {}
    for front_end in front_ends:
        for row in ROWS:
            key = f"{front_end}/{row.name}"
            forward_shape = reference(row, len(ranks), set_rank, len(ranks) - 1)[0].shape
            weight = upstream(row, set_rank, forward_shape)
            try:
                out, grad = CASES[front_end](row, row_input(row, set_rank), weight, set_rank, root, process_set)
                results[key] = ("ok", np.asarray(out).tolist(), np.asarray(grad).tolist())
            except Exception as error:  # reported, and the comparison fails with it
                results[key] = ("error", f"{type(error).__name__}: {error}")
            for what in MISMATCHES.get(row.op, ()) if row.name in FIRST_ROW_OF_OP else ():
                results[f"{key}/mismatch/{what}"] = _mismatch(front_end, row, what, set_rank, ranks, process_set)
                check = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=process_set)
                results[f"{key}/next/{what}"] = check.tolist()
        for case in ARGUMENT_ERRORS:
            results[f"{front_end}/argument/{case}"] = _argument_error(front_end, case, process_set)
        results[f"{front_end}/argument/next"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=process_set).tolist()
        if front_end == "tf_v1_graph":
            results["tf_v1_graph/broadcast_"] = _tf_v1_broadcast_inplace(set_rank, root, process_set)
        if front_end in ("torch", "tf_eager"):
            results.update(_dtype_rows(front_end, process_set, set_rank, root))
    return results


def _matrix(front_ends: list[str], sets: list[list[int] | None]) -> dict[str, Any]:
    """Every row of every front end on every process set of ``sets`` (None: the global set)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import torch

    import shoal.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    if front_ends != ["torch"]:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
    results: dict[str, Any] = {}
    for members in sets:
        process_set = hvd.add_process_set(members) if members else hvd.global_process_set
        label = "global" if members is None else f"set{members}"
        if process_set.included():
            results[label] = _rows_on(front_ends, process_set, members or list(range(hvd.size())))
        hvd.barrier()
    return results


def check_matrix(results: Any, front_ends: list[str], members: list[int]) -> int:
    """``results``: indexed by global rank, the rows of one process set."""
    """Compare every row on every member with the references; returns how many cells were checked."""
    checked = checked_mismatches = 0
    root_set_rank = len(members) - 1
    failures = []
    for front_end in front_ends:
        for row in ROWS:
            key = f"{front_end}/{row.name}"
            for set_rank, rank in enumerate(members):
                outcome = results[rank][key]
                if outcome[0] != "ok":
                    failures.append(f"{key} rank {rank}: {outcome[1]}")
                    continue
                forward, gradient = reference(row, len(members), set_rank, root_set_rank)
                for label, got, want in (("forward", outcome[1], forward), ("gradient", outcome[2], gradient)):
                    if np.shape(got) != want.shape or not np.allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE):
                        failures.append(f"{key} rank {rank} {label}: got {np.asarray(got).tolist()}, want {want.tolist()}")
                checked += 1
                for what in MISMATCHES.get(row.op, ()) if row.name in FIRST_ROW_OF_OP else ():
                    checked_mismatches += 1
                    seen = results[rank][f"{key}/mismatch/{what}"]
                    classes = seen.split("|")[0].split(",")
                    if MISMATCH_CLASS[front_end] not in classes or not seen.endswith("|says Mismatched"):
                        failures.append(f"{key} rank {rank} {what} mismatch: raised {seen}, want {MISMATCH_CLASS[front_end]}")
                    after = results[rank][f"{key}/next/{what}"]
                    if after != [float(len(members))] * 2:
                        failures.append(f"{key} rank {rank}: the call after the {what} mismatch gave {after}")
    for front_end in front_ends:
        for rank in members:
            for case, kind in ARGUMENT_ERRORS.items():
                raised = results[rank][f"{front_end}/argument/{case}"].split(",")
                if ERROR_CLASS[front_end][kind] not in raised:
                    failures.append(f"{front_end} {case} rank {rank}: raised {raised}, want {ERROR_CLASS[front_end][kind]}")
            if results[rank][f"{front_end}/argument/next"] != [float(len(members))] * 2:
                failures.append(f"{front_end} rank {rank}: the call after the argument errors failed")
    if "tf_v1_graph" in front_ends:
        root_values = [[1.0 * len(members), 2.0 * len(members)], [10.0 * len(members), 20.0 * len(members)]]
        for rank in members:
            if results[rank]["tf_v1_graph/broadcast_"] != root_values:
                failures.append(f"tf_v1_graph broadcast_ rank {rank}: {results[rank]['tf_v1_graph/broadcast_']}")
    want_mismatches = len(front_ends) * len(members) * sum(len(kinds) for kinds in MISMATCHES.values())
    if checked_mismatches != want_mismatches:
        failures.append(f"{checked_mismatches} mismatch cells checked, want {want_mismatches}")
    failures += check_dtypes(results, front_ends, members)
    assert not failures, f"{len(failures)} cells differ from Horovod's rules:\n" + "\n".join(failures)
    return checked


def _front_ends() -> list[str]:
    return ["torch"] if tf_missing else FRONT_ENDS


ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.check
@pytest.mark.timeout(240)
def test_matrix_on_two_ranks() -> None:
    front_ends = _front_ends()
    results = run_ranks(_matrix, 2, args=(front_ends, [None]), timeout_s=200, env=ENV)
    cells = check_matrix([r["global"] for r in results], front_ends, [0, 1])
    assert cells == len(ROWS) * len(front_ends) * 2


@pytest.mark.timeout(360)
def test_matrix_on_three_ranks_and_a_process_set_of_two_of_them() -> None:
    front_ends = _front_ends()
    results = run_ranks(_matrix, 3, args=(front_ends, [None, [0, 2]]), timeout_s=320, env=ENV)
    assert check_matrix([r["global"] for r in results], front_ends, [0, 1, 2]) == len(ROWS) * len(front_ends) * 3
    assert "set[0, 2]" not in results[1]
    subset = {0: results[0]["set[0, 2]"], 2: results[2]["set[0, 2]"]}
    assert check_matrix(subset, front_ends, [0, 2]) == len(ROWS) * len(front_ends) * 2  # type: ignore[arg-type]
