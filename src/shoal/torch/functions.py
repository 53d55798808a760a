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

from shoal.core import requests
from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.requests import Call
from shoal.core.rules import Adasum as Adasum  # Horovod's names, re-exported: hvd.Sum ...
from shoal.core.rules import Average, Kind, ReduceOp, ReduceSpec, resolve_op
from shoal.core.rules import Max as Max
from shoal.core.rules import Min as Min
from shoal.core.rules import Product as Product
from shoal.core.rules import Sum as Sum
from shoal.torch.autograd import (
    AllgatherFunction,
    AllreduceFunction,
    AlltoallFunction,
    BroadcastFunction,
    GroupedAllgatherFunction,
    GroupedAllreduceFunction,
    GroupedReducescatterFunction,
    ReducescatterFunction,
)
from shoal.torch.compression import Compression, Compressor


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    """What only the torch front end can check; dtypes, devices and ops are the engine's (``check_request``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} supports dense (strided) tensors, not {tensor.layout}; densify it first (tensor.to_dense())")
    if tensor.is_quantized:
        raise TypeError(f"{what} does not support quantized tensors ({tensor.dtype}); dequantize it first")
    return tensor


def _checked(tensors: Sequence[Any], what: str) -> list[torch.Tensor]:
    return [_check_tensor(tensor, what) for tensor in tensors]


_CALLS: dict[tuple[Any, ...], Call] = {}
"""The ``Call`` of each argument combination seen (a frozen object shared by every call with those arguments: a small
collective would otherwise spend a tenth of its submission building it)."""
_CALLS_KEPT = 256


def _reduce_call(
    kind: Kind, op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet, in_place: bool = False
) -> Call:
    if type(prescale) is not float or type(postscale) is not float:  # a tensor or numpy factor: not kept
        return Call(kind, process_set, ReduceSpec(op, prescale, postscale), in_place=in_place)
    key = (kind, op, prescale, postscale, process_set, in_place)
    call = _CALLS.get(key)
    if call is None:
        if len(_CALLS) >= _CALLS_KEPT:
            _CALLS.clear()
        call = _CALLS[key] = Call(kind, process_set, ReduceSpec(op, prescale, postscale), in_place=in_place)
    return call


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
    call = _reduce_call(Kind.ALLREDUCE, resolve_op(op, average), prescale_factor, postscale_factor, process_set)
    return requests.submit(call, _checked([tensor], "allreduce"), name)


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
    call = _reduce_call(Kind.ALLREDUCE, resolve_op(op, average), prescale_factor, postscale_factor, process_set, True)
    return requests.submit(call, _checked([tensor], "allreduce"), name)


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
    call = _reduce_call(Kind.ALLREDUCE, resolve_op(op, average), prescale_factor, postscale_factor, process_set, True)
    return requests.run(call, _checked([tensor], "allreduce"), name)


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
    reduce_op = resolve_op(op, average)
    compressed, ctx = compression.compress(_check_tensor(tensor, "allreduce"))
    reduced = AllreduceFunction.apply(compressed, name, int(reduce_op), prescale_factor, postscale_factor, process_set)
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
    call = _reduce_call(Kind.ALLREDUCE, resolve_op(op, average), prescale_factor, postscale_factor, process_set)
    return requests.submit(call, _checked(tensors, "allreduce"), name, grouped=True)


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
    call = _reduce_call(Kind.ALLREDUCE, resolve_op(op, average), prescale_factor, postscale_factor, process_set, True)
    return requests.submit(call, _checked(tensors, "allreduce"), name, grouped=True)


def allreduce_named_async_(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    driven: bool = False,
) -> int:
    """Reduce several tensors in place under their own names, submitted together (one cycle, one fused buffer).
    ``driven``: the caller synchronizes next, so the engine thread is not woken for them (``session.submit``)."""
    call = _reduce_call(Kind.ALLREDUCE, op, prescale_factor, postscale_factor, process_set, True)
    return requests.submit(call, _checked(tensors, "allreduce"), grouped=True, names=names, blocking=driven)


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
    reduce_op = resolve_op(op, average)
    compressed = [compression.compress(t) for t in _checked(tensors, "allreduce")]
    results = GroupedAllreduceFunction.apply(
        name, int(reduce_op), prescale_factor, postscale_factor, process_set, *[c[0] for c in compressed]
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
    call = _reduce_call(Kind.ALLREDUCE, resolve_op(op, average), prescale_factor, postscale_factor, process_set, True)
    return requests.run(call, _checked(tensors, "allreduce"), name, grouped=True)


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


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (the first dimension may differ per rank)."""
    return requests.submit(Call(Kind.ALLGATHER, process_set), _checked([tensor], "allgather"), name)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0. Differentiable."""
    return AllgatherFunction.apply(_check_tensor(tensor, "allgather"), name, process_set)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start allgathering several tensors as one handle."""
    return requests.submit(Call(Kind.ALLGATHER, process_set), _checked(tensors, "allgather"), name, grouped=True)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    """Allgather several tensors at once. Differentiable."""
    return list(GroupedAllgatherFunction.apply(name, process_set, *_checked(tensors, "allgather")))


# ----- broadcast -----


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start broadcasting ``tensor`` from ``root_rank`` (a global rank); the input is not modified."""
    call = Call(Kind.BROADCAST, process_set, root_rank=int(root_rank))
    return requests.submit(call, _checked([tensor], "broadcast"), name)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """In-place form of ``broadcast_async``."""
    call = Call(Kind.BROADCAST, process_set, root_rank=int(root_rank), in_place=True)
    return requests.submit(call, _checked([tensor], "broadcast"), name)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Broadcast in place from ``root_rank`` and return ``tensor``."""
    call = Call(Kind.BROADCAST, process_set, root_rank=int(root_rank), in_place=True)
    return requests.run(call, _checked([tensor], "broadcast"), name)


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank. Differentiable."""
    return BroadcastFunction.apply(_check_tensor(tensor, "broadcast"), int(root_rank), name, process_set)


# ----- alltoall -----


def _splits(splits: torch.Tensor | Sequence[int] | None) -> tuple[int, ...] | None:
    if splits is None:
        return None
    return tuple(int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits))


def alltoall_async(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start an alltoall: rows ``splits[i]`` of ``tensor`` go to member i (default: an even split).

    ``synchronize`` returns (received tensor, received splits).
    """
    call = Call(Kind.ALLTOALL, process_set, splits=_splits(splits))
    return requests.submit(call, _checked([tensor], "alltoall"), name)


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
    output, received = AlltoallFunction.apply(_check_tensor(tensor, "alltoall"), _splits(splits), name, process_set)
    return output if splits is None else (output, received)


# ----- reducescatter -----


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` and scattering dimension 0: rank i keeps its block of rows (lower ranks get extras)."""
    call = _reduce_call(Kind.REDUCESCATTER, ReduceOp(op), prescale_factor, postscale_factor, process_set)
    return requests.submit(call, _checked([tensor], "reducescatter"), name)


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
    compressed, ctx = compression.compress(_check_tensor(tensor, "reducescatter"))
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
    call = _reduce_call(Kind.REDUCESCATTER, ReduceOp(op), prescale_factor, postscale_factor, process_set)
    return requests.submit(call, _checked(tensors, "reducescatter"), name, grouped=True)


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
    compressed = [compression.compress(t) for t in _checked(tensors, "reducescatter")]
    results = GroupedReducescatterFunction.apply(
        name, int(op), process_set, prescale_factor, postscale_factor, *[c[0] for c in compressed]
    )
    return [compression.decompress(r, c[1]) for r, c in zip(results, compressed, strict=True)]


# ----- barrier and join -----

barrier = requests.barrier
join = requests.join
