"""The ``horovod.torch`` collective API: allreduce, allgather, broadcast, alltoall, reducescatter, barrier, join.

Each operation comes in the forms Horovod has: ``op`` (returns the result, differentiable), ``op_async``
(returns a handle), and for allreduce and broadcast the in-place ``op_`` and ``op_async_``; ``grouped_op``
submits several tensors as one handle. Requests are keyed by ``name``; unnamed ones get
``<op>.noname.<n>``, which matches across ranks as long as they issue unnamed requests in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shoal.engine.request import Kind, ReduceOp, Request, RequestMeta
from shoal.torch import basics, handles
from shoal.torch.compression import Compression, Compressor
from shoal.torch.process_sets import ProcessSet, global_process_set, set_id_of

Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)


def _auto_name(kind: Kind, name: str | None, process_set: ProcessSet = global_process_set) -> str:
    """``name``, or the next ``<op>.noname.<n>``, counted per process set so that ranks outside a set stay in step.

    The counters belong to the session: every ``init()`` (an elastic re-form included) starts them from zero.
    """
    if name is not None:
        return name
    set_id = set_id_of(process_set)
    suffix = f".set{set_id}" if set_id else ""
    return f"{kind.value}.noname{suffix}.{handles.session().next_number(kind.value, set_id)}"


def _resolve_op(op: int | None, average: bool | None) -> ReduceOp:
    """Horovod's rules: ``average`` is deprecated; ``op`` defaults to Average."""
    if average is not None:
        if op is not None:
            raise ValueError("the 'average' argument is deprecated and cannot be combined with 'op'")
        return ReduceOp.Average if average else ReduceOp.Sum
    return ReduceOp.Average if op is None else ReduceOp(op)


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    """What only the torch front end can check; dtypes, devices and ops are the engine's (``check_request``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} supports dense (strided) tensors, not {tensor.layout}; densify it first (tensor.to_dense())")
    if tensor.is_quantized:
        raise TypeError(f"{what} does not support quantized tensors ({tensor.dtype}); dequantize it first")
    return tensor


def _check_writable(tensor: torch.Tensor, what: str) -> None:
    """An in-place result must be writable element by element: an expanded tensor shares memory between elements."""
    if any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape, strict=True)):
        raise ValueError(
            f"{what}: the in-place form cannot write into a tensor whose elements share memory (an expand()ed view); "
            "use the out-of-place form or pass tensor.clone()"
        )


def _meta(tensor: torch.Tensor, kind: Kind, name: str, process_set: ProcessSet, **fields: Any) -> RequestMeta:
    return RequestMeta(
        name=name,
        kind=kind,
        process_set=set_id_of(process_set),
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=tuple(tensor.shape),
        # The device type, not its index: with torch.cuda.set_device(hvd.local_rank()) every rank has its own.
        device=tensor.device.type,
        **fields,
    )


def _allreduce_request(
    tensor: torch.Tensor,
    name: str | None,
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    in_place: bool,
) -> Request:
    _check_tensor(tensor, "allreduce")
    meta = _meta(
        tensor,
        Kind.ALLREDUCE,
        _auto_name(Kind.ALLREDUCE, name, process_set),
        process_set,
        op=int(op),
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
    )
    detached = tensor.detach()
    contiguous = detached.contiguous()
    if in_place:
        _check_writable(tensor, "allreduce")
        request = Request(meta, contiguous, contiguous)
        if contiguous is not detached:  # a non-contiguous tensor: reduce a copy, write the result back
            request.user_tensor = tensor
        return request
    return Request(meta, contiguous, torch.empty_like(contiguous, memory_format=torch.contiguous_format))


def _single(results: list[Any]) -> Any:
    return results[0]


def _as_list(results: list[Any]) -> list[Any]:
    return list(results)


# ----- allreduce -----


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start averaging (or summing, ...) ``tensor`` over all ranks; returns a handle. The input is not modified."""
    request = _allreduce_request(
        tensor, name, _resolve_op(op, average), prescale_factor, postscale_factor, process_set, in_place=False
    )
    return handles.submit([request], _single)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place form of ``allreduce_async``: the result is written into ``tensor``."""
    request = _allreduce_request(
        tensor, name, _resolve_op(op, average), prescale_factor, postscale_factor, process_set, in_place=True
    )
    return handles.submit([request], _single)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` in place over all ranks and return it."""
    handle = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return handles.synchronize(handle)


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return ``tensor`` averaged (or summed, ...) over all ranks. Differentiable: the gradient is allreduced too."""

    compressed, ctx = compression.compress(tensor)
    reduced = AllreduceFunction.apply(
        compressed, name, int(_resolve_op(op, average)), prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing several tensors as one handle (they are fused together when they fit)."""
    resolved = _resolve_op(op, average)
    base = _auto_name(Kind.ALLREDUCE, name, process_set)
    requests = [
        _allreduce_request(t, f"{base}.{i}", resolved, prescale_factor, postscale_factor, process_set, False)
        for i, t in enumerate(tensors)
    ]
    return handles.submit(requests, _as_list)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place form of ``grouped_allreduce_async``."""
    base = _auto_name(Kind.ALLREDUCE, name, process_set)
    return allreduce_named_async_(
        tensors,
        [f"{base}.{i}" for i in range(len(tensors))],
        _resolve_op(op, average),
        prescale_factor,
        postscale_factor,
        process_set,
    )


def allreduce_named_async_(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> int:
    """Reduce several tensors in place under their own names, submitted together (one cycle, one fused buffer)."""
    requests = [
        _allreduce_request(t, n, op, prescale_factor, postscale_factor, process_set, True)
        for t, n in zip(tensors, names, strict=True)
    ]
    return handles.submit(requests, _as_list)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce several tensors at once; returns the reduced tensors in order. Differentiable."""

    compressed = [compression.compress(t) for t in tensors]
    results = GroupedAllreduceFunction.apply(
        name, int(_resolve_op(op, average)), prescale_factor, postscale_factor, process_set, *[c[0] for c in compressed]
    )
    return [compression.decompress(r, c[1]) for r, c in zip(results, compressed, strict=True)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce several tensors in place at once."""
    handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return handles.synchronize(handle)


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int = Average, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor as Horovod does: allgather its indices and values (summing duplicates is left to
    the sparse tensor); returns a callable that waits and gives the result (``synchronize`` accepts it too)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async expects a sparse COO tensor (tensor.is_sparse)")
    if ReduceOp(op) not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"sparse_allreduce_async supports Average and Sum, not {ReduceOp(op).name}")
    source = tensor.coalesce()
    indices = allgather_async(source.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set)
    values = allgather_async(source.values().contiguous(), name=f"{name}.values", process_set=process_set)

    def result() -> torch.Tensor:
        gathered_values = handles.synchronize(values)
        gathered_indices = handles.synchronize(indices)
        if ReduceOp(op) == ReduceOp.Average:
            gathered_values = gathered_values / process_set.size()
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, source.shape, check_invariants=False)

    return result


# ----- allgather -----


def _allgather_request(tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> Request:
    _check_tensor(tensor, "allgather")
    meta = _meta(tensor, Kind.ALLGATHER, _auto_name(Kind.ALLGATHER, name, process_set), process_set)
    return Request(meta, tensor.detach().contiguous(), None)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (the first dimension may differ per rank)."""
    return handles.submit([_allgather_request(tensor, name, process_set)], _single)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0. Differentiable."""

    return AllgatherFunction.apply(tensor, name, process_set)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start allgathering several tensors as one handle."""
    base = _auto_name(Kind.ALLGATHER, name, process_set)
    return handles.submit([_allgather_request(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)], _as_list)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    """Allgather several tensors at once. Differentiable."""

    return list(GroupedAllgatherFunction.apply(name, process_set, *tensors))


# ----- broadcast -----


def _broadcast_request(
    tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet, in_place: bool
) -> Request:
    _check_tensor(tensor, "broadcast")
    meta = _meta(tensor, Kind.BROADCAST, _auto_name(Kind.BROADCAST, name, process_set), process_set, root=int(root_rank))
    detached = tensor.detach()
    contiguous = detached.contiguous()
    if in_place:
        _check_writable(tensor, "broadcast")
        request = Request(meta, contiguous, contiguous)
        if contiguous is not detached:
            request.user_tensor = tensor
        return request
    return Request(meta, contiguous, torch.empty_like(contiguous, memory_format=torch.contiguous_format))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start broadcasting ``tensor`` from ``root_rank`` (a global rank); the input is not modified."""
    return handles.submit([_broadcast_request(tensor, root_rank, name, process_set, False)], _single)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """In-place form of ``broadcast_async``."""
    return handles.submit([_broadcast_request(tensor, root_rank, name, process_set, True)], _single)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Broadcast in place from ``root_rank`` and return ``tensor``."""
    return handles.synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank. Differentiable."""

    return BroadcastFunction.apply(tensor, root_rank, name, process_set)


# ----- alltoall -----


def alltoall_async(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start an alltoall: rows ``splits[i]`` of ``tensor`` go to member i (default: an even split)."""
    _check_tensor(tensor, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    split_list: tuple[int, ...] | None = None
    members = process_set.size()
    if splits is not None:
        split_list = tuple(int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits))
        if len(split_list) != members or any(s < 0 for s in split_list) or sum(split_list) != tensor.shape[0]:
            raise ValueError(
                f"alltoall splits {list(split_list)} must be {members} non-negative counts summing to "
                f"the first dimension {tensor.shape[0]}"
            )
    elif tensor.shape[0] % members != 0:
        raise ValueError(
            f"alltoall without splits needs the first dimension ({tensor.shape[0]}) divisible by "
            f"the number of ranks ({members})"
        )
    meta = _meta(tensor, Kind.ALLTOALL, _auto_name(Kind.ALLTOALL, name, process_set), process_set, splits=split_list)
    return handles.submit([Request(meta, tensor.detach().contiguous(), None)], _single)


def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatter rows of ``tensor`` to every rank and gather theirs. Differentiable.

    Returns, as Horovod does: the received tensor when ``splits`` is None (an even split); (received tensor,
    received splits) when ``splits`` is given.
    """

    return AlltoallFunction.apply(tensor, splits, name, process_set)


# ----- reducescatter -----


def _reducescatter_request(
    tensor: torch.Tensor,
    name: str | None,
    op: ReduceOp,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
) -> Request:
    _check_tensor(tensor, "reducescatter")
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"reducescatter supports Average and Sum, not {op.name}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    meta = _meta(
        tensor,
        Kind.REDUCESCATTER,
        _auto_name(Kind.REDUCESCATTER, name, process_set),
        process_set,
        op=int(op),
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
    )
    return Request(meta, tensor.detach().contiguous(), None)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` and scattering dimension 0: rank i keeps its block of rows (lower ranks get extras)."""
    request = _reducescatter_request(tensor, name, ReduceOp(op), process_set, prescale_factor, postscale_factor)
    return handles.submit([request], _single)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's block of rows. Differentiable."""

    compressed, ctx = compression.compress(tensor)
    result = ReducescatterFunction.apply(compressed, name, int(op), process_set, prescale_factor, postscale_factor)
    return compression.decompress(result, ctx)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reduce-scattering several tensors as one handle."""
    base = _auto_name(Kind.REDUCESCATTER, name, process_set)
    requests = [
        _reducescatter_request(t, f"{base}.{i}", ReduceOp(op), process_set, prescale_factor, postscale_factor)
        for i, t in enumerate(tensors)
    ]
    return handles.submit(requests, _as_list)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reduce-scatter several tensors at once. Differentiable."""

    compressed = [compression.compress(t) for t in tensors]
    results = GroupedReducescatterFunction.apply(
        name, int(op), process_set, prescale_factor, postscale_factor, *[c[0] for c in compressed]
    )
    return [compression.decompress(r, c[1]) for r, c in zip(results, compressed, strict=True)]


# ----- barrier and join -----


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set reaches the barrier."""
    meta = RequestMeta(name=_auto_name(Kind.BARRIER, None, process_set), kind=Kind.BARRIER, process_set=set_id_of(process_set))
    handles.synchronize(handles.submit([Request(meta, None, None)], _single))


def join(device: int = -1) -> int:
    """Declare that this rank has no more work; returns the last rank to join once every rank has.

    Until then this rank stands in for every collective the others run, contributing zeros (an empty slice to
    allgather), so ranks with more batches never hang waiting for it. ``device`` is accepted for Horovod
    compatibility.
    """
    meta = RequestMeta(name="shoal.join", kind=Kind.JOIN, process_set=0)
    return handles.synchronize(handles.submit([Request(meta, None, None)], _single))


# ----- autograd, beside the ops it differentiates -----
# Autograd for the synchronous collectives, with Horovod's gradients (horovod/torch/mpi_ops.py, 0.28), op by op.
#
# ========================  ==========================================================================================
# op                        backward of the upstream gradient ``g``
# ========================  ==========================================================================================
# allreduce (grouped too)   allreduce of ``g`` with the forward's op and prescale/postscale factors
# allgather (grouped too)   allreduce of ``g`` with **Average**, then this rank's rows (offset by its process-set rank)
# broadcast                 allreduce of ``g`` with **Average** on the root; zeros on every other rank
# alltoall                  alltoall of ``g`` back along the received splits
# reducescatter (grouped)   ``g`` times the set size for Sum (not for Average), times prescale and postscale, allgathered
# ========================  ==========================================================================================
#
# So allgather and broadcast give the gradient of the ranks' *mean* loss, allreduce that of their summed loss, and
# reducescatter ``size`` times the summed loss's gradient: Horovod's conventions, kept so that a ported script
# trains the same. The backward collectives are unnamed; every rank runs backward in the same order, so they pair up.


class AllreduceFunction(torch.autograd.Function):
    """allreduce with gradient."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        handle = allreduce_async(
            tensor, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale, process_set=process_set
        )
        return handles.synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(
            grad, op=ctx.op, prescale_factor=ctx.prescale, postscale_factor=ctx.postscale, process_set=ctx.process_set
        )
        return reduced, None, None, None, None, None


class GroupedAllreduceFunction(torch.autograd.Function):
    """grouped allreduce with gradient: the gradients are reduced as one group, with the same op and factors."""

    @staticmethod
    def forward(
        ctx: Any, name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        handle = grouped_allreduce_async(
            list(tensors), name=name, op=op, prescale_factor=prescale, postscale_factor=postscale, process_set=process_set
        )
        return tuple(handles.synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        handle = grouped_allreduce_async(
            [g.contiguous() for g in grads],
            op=ctx.op,
            prescale_factor=ctx.prescale,
            postscale_factor=ctx.postscale,
            process_set=ctx.process_set,
        )
        return (None, None, None, None, None, *handles.synchronize(handle))


def _own_rows(reduced: torch.Tensor, rows: torch.Tensor, process_set: ProcessSet, count: int) -> torch.Tensor:
    """This rank's rows of an allgathered gradient: offset by the rows of the set's lower ranks."""
    offset = int(rows[: process_set.rank()].sum())
    return reduced.narrow(0, offset, count)


class AllgatherFunction(torch.autograd.Function):
    """allgather with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.scalar = (tensor.shape[0], False) if tensor.dim() else (1, True)
        ctx.process_set = process_set
        return handles.synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad.contiguous(), op=ReduceOp.Average, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows]), process_set=ctx.process_set)
        mine = _own_rows(reduced, rows, ctx.process_set, ctx.rows)
        return (mine.reshape(()) if ctx.scalar else mine), None, None


class GroupedAllgatherFunction(torch.autograd.Function):
    """grouped allgather with gradient."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(handles.synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = handles.synchronize(
            grouped_allreduce_async([g.contiguous() for g in grads], op=ReduceOp.Average, process_set=ctx.process_set)
        )
        rows = allgather(torch.tensor([ctx.rows]), process_set=ctx.process_set)
        mine = []
        for index, (tensor, count, scalar) in enumerate(zip(reduced, ctx.rows, ctx.scalars, strict=True)):
            piece = _own_rows(tensor, rows[:, index], ctx.process_set, count)
            mine.append(piece.reshape(()) if scalar else piece)
        return (None, None, *mine)


class BroadcastFunction(torch.autograd.Function):
    """broadcast with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> Any:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return handles.synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad.contiguous(), op=ReduceOp.Average, process_set=ctx.process_set)
        if basics.rank() != ctx.root_rank:  # root_rank is a global rank, as in the forward
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


class AlltoallFunction(torch.autograd.Function):
    """alltoall with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Any:
        ctx.process_set = process_set
        output, received = handles.synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        if splits is None:  # Horovod returns the received splits only when splits were given
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_grad_splits: Any) -> tuple[Any, ...]:
        back, _ = alltoall(grad.contiguous(), ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def _reducescatter_grad_scale(op: int, process_set: ProcessSet, prescale: float, postscale: float) -> float:
    """Horovod's factor on a reducescatter's upstream gradient before it is allgathered."""
    return (process_set.size() if op == ReduceOp.Sum else 1.0) * prescale * postscale


class ReducescatterFunction(torch.autograd.Function):
    """reducescatter with gradient."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet, prescale: float, postscale: float
    ) -> Any:
        ctx.process_set = process_set
        ctx.scale = _reducescatter_grad_scale(op, process_set, prescale, postscale)
        handle = reducescatter_async(tensor, name, op, process_set, prescale, postscale)
        return handles.synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gathered = allgather((grad * ctx.scale).contiguous(), process_set=ctx.process_set)
        return gathered, None, None, None, None, None


class GroupedReducescatterFunction(torch.autograd.Function):
    """grouped reducescatter with gradient."""

    @staticmethod
    def forward(
        ctx: Any, name: str | None, op: int, process_set: ProcessSet, prescale: float, postscale: float, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.process_set = process_set
        ctx.scale = _reducescatter_grad_scale(op, process_set, prescale, postscale)
        handle = grouped_reducescatter_async(list(tensors), name, op, process_set, prescale, postscale)
        return tuple(handles.synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        scaled = [(g * ctx.scale).contiguous() for g in grads]
        gathered = handles.synchronize(grouped_allgather_async(scaled, process_set=ctx.process_set))
        return (None, None, None, None, None, *gathered)
