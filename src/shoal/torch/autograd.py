"""Autograd for the synchronous collectives, with Horovod's gradients (horovod/torch/mpi_ops.py, 0.28), op by op.

========================  ==========================================================================================
op                        backward of the upstream gradient ``g``
========================  ==========================================================================================
allreduce (grouped too)   allreduce of ``g`` with the forward's op and prescale/postscale factors
allgather (grouped too)   allreduce of ``g`` with **Average**, then this rank's rows (offset by its process-set rank)
broadcast                 allreduce of ``g`` with **Average** on the root; zeros on every other rank
alltoall                  alltoall of ``g`` back along the received splits
reducescatter (grouped)   ``g`` times the set size for Sum (not for Average), times prescale and postscale, allgathered
========================  ==========================================================================================

So allgather and broadcast give the gradient of the ranks' *mean* loss, allreduce that of their summed loss, and
reducescatter ``size`` times the summed loss's gradient: Horovod's conventions, kept so that a ported script
trains the same. The backward collectives are unnamed; every rank runs backward in the same order, so they pair up.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.engine.request import ReduceOp
from shoal.torch import functions, handles
from shoal.torch.process_sets import ProcessSet


class AllreduceFunction(torch.autograd.Function):
    """allreduce with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, prescale: float, postscale: float,
                process_set: ProcessSet) -> torch.Tensor:  # fmt: skip
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        handle = functions.allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale, process_set=process_set)  # fmt: skip
        return handles.synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = functions.allreduce(grad, op=ctx.op, prescale_factor=ctx.prescale, postscale_factor=ctx.postscale,
                                      process_set=ctx.process_set)  # fmt: skip
        return reduced, None, None, None, None, None


class GroupedAllreduceFunction(torch.autograd.Function):
    """grouped allreduce with gradient: the gradients are reduced as one group, with the same op and factors."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        handle = functions.grouped_allreduce_async(list(tensors), name=name, op=op, prescale_factor=prescale,
                                                   postscale_factor=postscale, process_set=process_set)  # fmt: skip
        return tuple(handles.synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        handle = functions.grouped_allreduce_async([g.contiguous() for g in grads], op=ctx.op,
                                                   prescale_factor=ctx.prescale, postscale_factor=ctx.postscale,
                                                   process_set=ctx.process_set)  # fmt: skip
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
        return handles.synchronize(functions.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = functions.allreduce(grad.contiguous(), op=ReduceOp.Average, process_set=ctx.process_set)
        rows = functions.allgather(torch.tensor([ctx.rows]), process_set=ctx.process_set)
        mine = _own_rows(reduced, rows, ctx.process_set, ctx.rows)
        return (mine.reshape(()) if ctx.scalar else mine), None, None


class GroupedAllgatherFunction(torch.autograd.Function):
    """grouped allgather with gradient."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(handles.synchronize(functions.grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = handles.synchronize(functions.grouped_allreduce_async([g.contiguous() for g in grads],
                                                                        op=ReduceOp.Average,
                                                                        process_set=ctx.process_set))  # fmt: skip
        rows = functions.allgather(torch.tensor([ctx.rows]), process_set=ctx.process_set)
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
        return handles.synchronize(functions.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from shoal.torch.basics import rank

        reduced = functions.allreduce(grad.contiguous(), op=ReduceOp.Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:  # root_rank is a global rank, as in the forward
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


class AlltoallFunction(torch.autograd.Function):
    """alltoall with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Any:
        ctx.process_set = process_set
        output, received = handles.synchronize(functions.alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        if splits is None:  # Horovod returns the received splits only when splits were given
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_grad_splits: Any) -> tuple[Any, ...]:
        back, _ = functions.alltoall(grad.contiguous(), ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def _reducescatter_grad_scale(op: int, process_set: ProcessSet, prescale: float, postscale: float) -> float:
    """Horovod's factor on a reducescatter's upstream gradient before it is allgathered."""
    return (process_set.size() if op == ReduceOp.Sum else 1.0) * prescale * postscale


class ReducescatterFunction(torch.autograd.Function):
    """reducescatter with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet,
                prescale: float, postscale: float) -> Any:  # fmt: skip
        ctx.process_set = process_set
        ctx.scale = _reducescatter_grad_scale(op, process_set, prescale, postscale)
        handle = functions.reducescatter_async(tensor, name, op, process_set, prescale, postscale)
        return handles.synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gathered = functions.allgather((grad * ctx.scale).contiguous(), process_set=ctx.process_set)
        return gathered, None, None, None, None, None


class GroupedReducescatterFunction(torch.autograd.Function):
    """grouped reducescatter with gradient."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, process_set: ProcessSet, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        ctx.process_set = process_set
        ctx.scale = _reducescatter_grad_scale(op, process_set, prescale, postscale)
        handle = functions.grouped_reducescatter_async(list(tensors), name, op, process_set, prescale, postscale)
        return tuple(handles.synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        scaled = [(g * ctx.scale).contiguous() for g in grads]
        gathered = handles.synchronize(functions.grouped_allgather_async(scaled, process_set=ctx.process_set))
        return (None, None, None, None, None, *gathered)
