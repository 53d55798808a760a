"""Horovod's TensorFlow collectives on Shoal's engine.

Each op hands its tensors to ``shoal.torch`` (the same engine, negotiation, fusion and timeline as the PyTorch
front end) and back: through DLPack, so a CPU tensor crosses without a copy. In eager mode the op runs at once.
Inside a ``tf.function`` it is a ``tf.py_function`` (TensorFlow's documented way to run Python in a graph); a
collective named by default takes its name from the input tensor's graph name, as Horovod's ops do, and each
collective in a graph runs after the one written before it (a control dependency), so every rank issues them in
the same order however TensorFlow schedules the graph. Gradients follow Horovod's definitions.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import torch

from shoal.core import basics, objects, requests, rules
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.requests import Call
from shoal.core.rules import Adasum, Average, Kind, ReduceOp, ReduceSpec, Sum
from shoal.core.rules import Max as Max
from shoal.core.rules import Min as Min
from shoal.core.rules import Product as Product
from shoal.tf_ops.compression import Compression, Compressor
from shoal.tf_ops.errors import as_tf_error

_last_op: dict[int, Any] = {}
"""Per graph: the last collective op created in it (the next one runs after it)."""
_lock = threading.Lock()


def _to_torch(value: Any) -> torch.Tensor:
    """An eager tf.Tensor as a torch tensor: shared memory through DLPack where TensorFlow allows it."""
    try:
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(value))
    except Exception:  # a dtype or device DLPack does not carry (bool, string): a numpy copy
        return torch.from_numpy(np.array(value.numpy()))


def _to_tf(value: torch.Tensor) -> tf.Tensor:
    """A torch tensor as a tf.Tensor, without a copy where DLPack allows it."""
    value = value.detach().contiguous()
    try:
        return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(value))
    except Exception:
        return tf.convert_to_tensor(value.cpu().numpy())


def _graph_name(kind: str, tensor: Any, name: str | None) -> str | None:
    """In a graph, a collective without a name is named after its input, as Horovod names its ops."""
    if name is not None or tf.executing_eagerly():
        return name
    return f"Horovod{kind}_" + re.sub(r"[^a-zA-Z0-9_]", "_", tensor.name)


def _bridge(
    compute: Callable[[list[torch.Tensor]], list[torch.Tensor]], inputs: Sequence[Any], dtypes: Sequence[Any]
) -> list[Any]:
    """Run ``compute`` on the inputs as torch tensors; return its outputs as tf.Tensors (eagerly, or as a
    py_function ordered after the graph's previous collective)."""

    def run(*values: Any) -> list[tf.Tensor]:
        try:
            outputs = compute([_to_torch(v) for v in values])
        except Exception as error:
            mapped = as_tf_error(error)
            if mapped is error:
                raise
            raise mapped from error
        return [_to_tf(out) for out in outputs]

    if tf.executing_eagerly():
        return run(*inputs)

    def run_in_graph(*values: Any) -> list[tf.Tensor]:
        try:
            return [*run(*values), tf.constant("")]
        except _RAISED_OUTSIDE as error:  # raised by the check below, outside the py_function, with its class
            status = _RAISED_OUTSIDE.index(type(error)) + 1
            return [tf.zeros([0], dtype) for dtype in dtypes] + [tf.constant(f"{status}{error.message}")]

    graph = tf.compat.v1.get_default_graph()
    with _lock:
        previous = _last_op.get(id(graph))
    dependencies = [previous] if previous is not None and previous.graph is graph else []
    with tf.control_dependencies(dependencies):
        *outputs, status = tf.py_function(run_in_graph, list(inputs), [*dtypes, tf.string])
    with _lock:
        _last_op[id(graph)] = status.op
    with tf.control_dependencies([_raise_unless_empty(status)]):
        return [tf.identity(output) for output in outputs]


_RAISED_OUTSIDE = (tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError)
"""The classes a collective's run in a graph reports through its status (``_raise_unless_empty``): a cross-rank
mismatch, and an argument only the run could see (splits held in a tensor, a dimension unknown when the graph was
built). Build-time errors (a dtype, an op Horovod does not run: ``_check_built``) are raised where the op is built."""


def _raise_unless_empty(status: Any) -> Any:
    """An op that raises the error a collective's status names (``<class index><message>``), or does nothing when the
    status is empty.

    Horovod's compiled op sets its error's class itself. A Python op cannot: TensorFlow reports any exception
    from a ``tf.py_function`` as ``UnknownError``, whatever its class. So the py_function returns the class and the
    message, and ops of this one's fail instead, with that class and the message in their text: a failed
    ``tf.debugging.Assert`` (``InvalidArgumentError``) unless the status names a mismatch, then, for a mismatch, a
    read of a file below ``/dev/null`` (ENOTDIR: ``FailedPreconditionError``, the path in its text). One ``tf.cond``
    and no other: the status is empty on every call that succeeds, and that path costs as little as it can.
    """

    def fail() -> Any:
        message = tf.strings.substr(status, 1, 3000)
        mismatch = tf.equal(tf.strings.substr(status, 0, 1), "1")
        invalid = tf.debugging.Assert(mismatch, [tf.strings.join(["Shoal: ", message])])
        with tf.control_dependencies([invalid]):
            return tf.io.read_file(tf.strings.join(["/dev/null/Shoal: ", message]))

    return tf.cond(tf.equal(status, ""), lambda: tf.constant(""), fail)


def _check_built(call: Call, tensors: Sequence[Any], name: str | None, splits_known: bool = True) -> None:
    """In a graph, Horovod's checks where the op is built, with Horovod's TensorFlow classes (an eager call is
    checked when it runs, with the same classes)."""
    if tf.executing_eagerly():
        return
    for tensor in tensors:
        static = tf.TensorShape(tensor.shape)  # a Keras variable's shape is a tuple, its dtype a string
        shape = static.as_list() if static.rank is not None else None
        try:
            requests.check_where_built(call, tf.as_dtype(tensor.dtype).base_dtype.name, shape, name, splits_known)
        except Exception as error:
            mapped = as_tf_error(error)
            if mapped is error:
                raise
            raise mapped from error


def _reduce_call(kind: Kind, op: int, prescale: float, postscale: float, process_set: ProcessSet) -> Call:
    return Call(kind, process_set, ReduceSpec(ReduceOp(op), prescale, postscale))


def _check_root(root_rank: int) -> None:
    """Found where the op is built, as Horovod's op does, in every mode."""
    try:
        rules.check_root_rank(int(root_rank), basics.size())
    except ValueError as error:
        raise as_tf_error(error) from error


def _gradient(kind: Kind, grads: list[Any], forward: dict[str, Any], name: str | None) -> list[Any]:
    """The gradients of ``kind``'s inputs, by ``rules.GRADIENTS[kind]`` (the same table the torch front end reads)."""
    rule = rules.GRADIENTS[kind]
    process_set: ProcessSet = forward["process_set"]
    op = forward.get("op")
    prescale, postscale = forward.get("prescale", 1.0), forward.get("postscale", 1.0)
    scale = rules.gradient_scale(kind, op, process_set.size(), prescale, postscale)
    scaled = [grad if scale == 1.0 else grad * tf.cast(scale, grad.dtype) for grad in grads]
    grad_name = None if name is None else f"{name}.grad"
    if rule.collective == Kind.ALLREDUCE:
        back_op = rules.gradient_op(kind, op)
        assert back_op is not None
        back_pre, back_post = rules.backward_factors(kind, prescale, postscale)
        carried = _grouped_allreduce_dense(scaled, int(back_op), back_pre, back_post, grad_name, process_set)
    elif rule.collective == Kind.ALLGATHER:
        carried = [
            allgather(g, name=None if grad_name is None else f"{grad_name}.{i}", process_set=process_set)
            for i, g in enumerate(scaled)
        ]
    else:
        carried = [alltoall(scaled[0], forward["received"], name=grad_name, process_set=process_set)[0]]
    if rule.select == rules.Select.OWN_ROWS:
        rows_name = None if grad_name is None else f"{grad_name}.rows"
        rows = allgather(tf.shape(forward["input"])[:1], name=rows_name, process_set=process_set)
        carried = [tf.split(carried[0], rows, num=process_set.size(), axis=0)[process_set.rank()]]
    elif rule.select == rules.Select.ROOT_ONLY and not rules.is_gradient_root(basics.rank(), forward["root_rank"]):
        carried = [value * 0 for value in carried]
    return carried


# ----- allreduce -----


def _allreduce_dense(tensor: Any, op: int, prescale: float, postscale: float, name: str | None, process_set: ProcessSet) -> Any:
    name = _graph_name("Allreduce", tensor, name)
    call = _reduce_call(Kind.ALLREDUCE, op, prescale, postscale, process_set)
    _check_built(call, [tensor], name)
    forward_args = {"process_set": process_set, "op": op, "prescale": prescale, "postscale": postscale}

    @tf.custom_gradient
    def forward(x: Any) -> Any:
        (y,) = _bridge(lambda ts: [requests.run(call, ts, name)], [x], [x.dtype])
        y.set_shape(x.shape)

        def grad(dy: Any) -> Any:
            return _gradient(Kind.ALLREDUCE, [dy], forward_args, name)[0]

        return y, grad

    return forward(tensor)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Average (or Sum, Min, Max, Product, Adasum) ``tensor`` over the ranks, as ``horovod.tensorflow.allreduce``.

    A ``tf.IndexedSlices`` is reduced by allgathering its values and indices (Sum or Average only; duplicate
    indices are not summed), as Horovod does; pass ``tf.convert_to_tensor`` of it to reduce it densely.
    """
    reduce_op = rules.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, reduce_op, prescale_factor, postscale_factor, name, process_set, device_sparse)
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tensor)
        reduced = _allreduce_dense(compressed, reduce_op, prescale_factor, postscale_factor, name, process_set)
        return compression.decompress(reduced, ctx)


def _allreduce_sparse(
    slices: Any, op: int, prescale: float, postscale: float, name: str | None, process_set: ProcessSet, device: str
) -> Any:
    if op == Adasum:
        raise NotImplementedError("Adasum does not support sparse tensors: reduce them densely (sparse_as_dense=True)")
    if op not in (Average, Sum):
        raise NotImplementedError("only Sum and Average reduce sparse tensors")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("prescale_factor and postscale_factor are not supported for sparse tensors")
    with tf.device(device):
        values = allgather(slices.values, name=None if name is None else f"{name}.values", process_set=process_set)
        indices = allgather(slices.indices, name=None if name is None else f"{name}.indices", process_set=process_set)
        if op == Average:
            values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Any]:
    """Reduce several tensors as one fused exchange; returns them in order (IndexedSlices as in ``allreduce``)."""
    if not tensors:
        return list(tensors)
    reduce_op = rules.resolve_op(op, average)
    dense_at = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    results: list[Any] = [None] * len(tensors)
    for index, tensor in enumerate(tensors):
        if index not in dense_at:
            suffix = None if name is None else f"{name}.{index}"
            results[index] = _allreduce_sparse(
                tensor, reduce_op, prescale_factor, postscale_factor, suffix, process_set, device_sparse
            )
    if dense_at:
        with tf.device(device_dense):
            packed = [compression.compress(tensors[i]) for i in dense_at]
            reduced = _grouped_allreduce_dense(
                [p[0] for p in packed], reduce_op, prescale_factor, postscale_factor, name, process_set
            )
            for index, value, (_, ctx) in zip(dense_at, reduced, packed, strict=True):
                results[index] = compression.decompress(value, ctx)
    return results


def _grouped_allreduce_dense(
    tensors: list[Any], op: int, prescale: float, postscale: float, name: str | None, process_set: ProcessSet
) -> list[Any]:
    if name is None and not tf.executing_eagerly():
        name = "HorovodGroupedAllreduce_" + re.sub(r"[^a-zA-Z0-9_]", "_", f"{tensors[0].name}_{tensors[-1].name}")

    call = _reduce_call(Kind.ALLREDUCE, op, prescale, postscale, process_set)
    _check_built(call, tensors, name)
    forward_args = {"process_set": process_set, "op": op, "prescale": prescale, "postscale": postscale}

    @tf.custom_gradient
    def forward(*xs: Any) -> Any:
        ys = _bridge(lambda ts: list(requests.run(call, ts, name, grouped=True)), xs, [x.dtype for x in xs])
        for y, x in zip(ys, xs, strict=True):
            y.set_shape(x.shape)

        def grad(*dys: Any) -> Any:
            return _gradient(Kind.ALLREDUCE, list(dys), forward_args, name)

        return ys, grad

    return list(forward(*tensors))


# ----- allgather, broadcast, alltoall, reducescatter -----


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set
) -> Any:
    """Concatenate every rank's ``tensor`` along dimension 0 (which may differ between ranks)."""
    name = _graph_name("Allgather", tensor, name)

    call = Call(Kind.ALLGATHER, process_set)
    _check_built(call, [tensor], name)

    @tf.custom_gradient
    def forward(x: Any) -> Any:
        (y,) = _bridge(lambda ts: [requests.run(call, ts, name)], [x], [x.dtype])
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))

        def grad(dy: Any) -> Any:
            return _gradient(Kind.ALLGATHER, [dy], {"process_set": process_set, "input": x}, name)[0]

        return y, grad

    return forward(tensor)


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """``allgather`` of each tensor."""
    return [allgather(t, None if name is None else f"{name}.{i}", process_set=process_set) for i, t in enumerate(tensors)]


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``root_rank``'s ``tensor`` on every rank."""
    name = _graph_name("Broadcast", tensor, name)
    call = Call(Kind.BROADCAST, process_set, root_rank=int(root_rank))
    _check_built(call, [tensor], name)  # the root rank too (eagerly, the request builder checks it)

    @tf.custom_gradient
    def forward(x: Any) -> Any:
        (y,) = _bridge(lambda ts: [requests.run(call, ts, name)], [x], [x.dtype])
        y.set_shape(x.shape)

        def grad(dy: Any) -> Any:
            return _gradient(Kind.BROADCAST, [dy], {"process_set": process_set, "root_rank": int(root_rank)}, name)[0]

        return y, grad

    return forward(tensor)


def broadcast_(
    variables: Sequence[Any], root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Broadcast ``variables`` in place from ``root_rank``; returns their new values.

    Eagerly the variables change at once. In a graph (a ``tf.compat.v1`` graph and session, with ``RefVariable`` or
    ``ResourceVariable``) the returned tensors are the assignments' results: running them broadcasts and assigns.
    """
    values = []
    for index, variable in enumerate(variables):
        value = broadcast(variable, root_rank, name=None if name is None else f"{name}.{index}", process_set=process_set)
        assigned = variable.assign(value)
        values.append(value if tf.executing_eagerly() else assigned)
    return values


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send rows ``splits[i]`` of ``tensor`` to rank i and receive theirs. Returns the received tensor when
    ``splits`` is None (an even split), else (received tensor, received splits), as Horovod does."""
    name = _graph_name("Alltoall", tensor, name)
    split_input = tf.zeros([0], tf.int32) if splits is None else tf.cast(splits, tf.int32)
    static_splits = None if splits is None else tf.get_static_value(split_input)
    known = None if static_splits is None else tuple(int(count) for count in static_splits)
    pending = splits is not None and known is None  # splits only the run will show
    _check_built(Call(Kind.ALLTOALL, process_set, splits=known), [tensor], name, splits_known=not pending)

    @tf.custom_gradient
    def forward(x: Any, s: Any) -> Any:
        def compute(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            chosen = None if splits is None else tuple(int(count) for count in ts[1].tolist())
            out, received = requests.run(Call(Kind.ALLTOALL, process_set, splits=chosen), [ts[0]], name)
            return [out, received.to(torch.int32)]

        received, received_splits = _bridge(compute, [x, s], [x.dtype, tf.int32])
        received.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        received_splits.set_shape([process_set.size()])

        def grad(dy: Any, _: Any = None) -> Any:
            return _gradient(Kind.ALLTOALL, [dy], {"process_set": process_set, "received": received_splits}, name)[0], None

        return (received, received_splits), grad

    received, received_splits = forward(tensor, split_input)
    return received if splits is None else (received, received_splits)


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """Reduce ``tensor`` over the ranks and return this rank's block of rows (the first ranks get one more row
    when the rows do not divide evenly)."""
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tensor)
        result = _reducescatter(
            compressed, int(op), _graph_name("Reducescatter", tensor, name), process_set, prescale_factor, postscale_factor
        )
        return compression.decompress(result, ctx)


def _reducescatter(tensor: Any, op: int, name: str | None, process_set: ProcessSet, prescale: float, postscale: float) -> Any:
    call = _reduce_call(Kind.REDUCESCATTER, op, prescale, postscale, process_set)
    _check_built(call, [tensor], name)
    forward_args = {"process_set": process_set, "op": op, "prescale": prescale, "postscale": postscale}

    @tf.custom_gradient
    def forward(x: Any) -> Any:
        (y,) = _bridge(lambda ts: [requests.run(call, ts, name)], [x], [x.dtype])
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))

        def grad(dy: Any) -> Any:
            return _gradient(Kind.REDUCESCATTER, [dy], forward_args, name)[0]

        return y, grad

    return forward(tensor)


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Any]:
    """``reducescatter`` of each tensor."""
    return [
        reducescatter(t, device_dense, compression, op, None, process_set, False, prescale_factor, postscale_factor)
        for t in tensors
    ]


# ----- objects and variables -----


def broadcast_variables(
    variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set, inplace: bool = False
) -> Any:
    """Assign ``root_rank``'s value to every variable (eager: at once; in a graph: the assignments as one op)."""
    variables = list(variables)
    if not variables:
        return None
    if tf.executing_eagerly():
        _check_root(root_rank)
        call = Call(Kind.BROADCAST, process_set, root_rank=int(root_rank))
        values = [requests.run(call, [_to_torch(tf.convert_to_tensor(v))], None) for v in variables]
        for variable, value in zip(variables, values, strict=True):
            variable.assign(_to_tf(value))
        return None
    return tf.group(*[v.assign(broadcast(v, root_rank, process_set=process_set)) for v in variables])


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 helper: an op that assigns ``root_rank``'s value to every global variable of the default graph
    (``tf.compat.v1.global_variables()``).

    Raises:
        RuntimeError: in eager mode, where there are no global variables (as Horovod's does).
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution; use "
            "hvd.broadcast_variables(<model/optimizer variables>, root_rank) instead"
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """``root_rank``'s ``obj`` (pickled) on every rank."""
    return objects.broadcast_object(obj, root_rank=root_rank, name=name or type(obj).__name__, process_set=process_set)


def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Every rank's ``obj`` (pickled), in rank order."""
    return list(objects.allgather_object(obj, name=name or type(obj).__name__, process_set=process_set))


def _global_only(process_set_id: int, what: str) -> None:
    if process_set_id != 0:
        raise NotImplementedError(f"{what}: only the global process set (id 0); use process_set.size()/.included()")


def _runtime_int(value: Callable[[], int], name: str | None) -> Any:
    """An int32 scalar read when it runs (inside a ``tf.function`` too: an elastic job changes size between runs)."""
    if tf.executing_eagerly():
        return tf.constant(value(), dtype=tf.int32, name=name)
    result = tf.py_function(lambda: tf.constant(value(), dtype=tf.int32), [], tf.int32, name=name)
    result.set_shape([])
    return result


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The number of ranks as a tensor (evaluated when it runs)."""
    _global_only(process_set_id, "size_op")
    return _runtime_int(basics.size, name)


def rank_op(name: str | None = None) -> Any:
    """This process's rank as a tensor (evaluated when it runs)."""
    return _runtime_int(basics.rank, name)


def local_rank_op(name: str | None = None) -> Any:
    """This process's local rank as a tensor (Horovod's returns the global rank by mistake; this one does not)."""
    return _runtime_int(basics.local_rank, name)


def local_size_op(name: str | None = None) -> Any:
    """The number of ranks on this host as a tensor (evaluated when it runs)."""
    return _runtime_int(basics.local_size, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1: every rank belongs to the global process set."""
    _global_only(process_set_id, "process_set_included_op")
    return tf.constant(1, name=name)
