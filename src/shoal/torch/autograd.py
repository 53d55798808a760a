"""Autograd for the synchronous collectives, with Horovod's gradients.

allreduce: the gradient is allreduced with the same op. allgather: the gradient is summed over ranks and each
rank keeps its own rows. broadcast: the summed gradient goes to the root, zeros elsewhere. alltoall: the gradient
travels back the way the data came. reducescatter: the gradient is allgathered (and averaged like the forward).
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


class AllgatherFunction(torch.autograd.Function):
    """allgather with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return handles.synchronize(functions.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        summed = functions.allreduce(grad, op=ReduceOp.Sum, process_set=ctx.process_set)
        rows = functions.allgather(torch.tensor([ctx.rows]), process_set=ctx.process_set)
        offset = int(rows[: ctx.process_set.rank()].sum())
        return summed.narrow(0, offset, ctx.rows), None, None


class BroadcastFunction(torch.autograd.Function):
    """broadcast with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> Any:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return handles.synchronize(functions.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from shoal.torch.basics import rank

        summed = functions.allreduce(grad, op=ReduceOp.Sum, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            summed = torch.zeros_like(summed)
        return summed, None, None, None


class AlltoallFunction(torch.autograd.Function):
    """alltoall with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Any:
        ctx.process_set = process_set
        output, received = handles.synchronize(functions.alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_splits: Any) -> tuple[Any, ...]:
        back, _ = functions.alltoall(grad.contiguous(), ctx.received, process_set=ctx.process_set)
        return back, None, None, None


class ReducescatterFunction(torch.autograd.Function):
    """reducescatter with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet,
                prescale: float, postscale: float) -> Any:  # fmt: skip
        ctx.op, ctx.process_set, ctx.scale = op, process_set, prescale * postscale
        handle = functions.reducescatter_async(tensor, name, op, process_set, prescale, postscale)
        return handles.synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gathered = functions.allgather(grad.contiguous(), process_set=ctx.process_set)
        if ctx.op == ReduceOp.Average:
            gathered = gathered / ctx.process_set.size()
        return gathered * ctx.scale, None, None, None, None, None
