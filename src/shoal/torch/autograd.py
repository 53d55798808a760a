"""Autograd for the synchronous collectives: forwards through the core's requests, backwards from the core's rules.

Every backward is ``shoal.core.rules.GRADIENTS`` read for one op: which collective carries the upstream gradient,
with which op and factor, and what this rank keeps of it. The backward collectives are unnamed; every rank runs
backward in the same order, so they pair up. A backward is itself built from these Functions, so higher-order
gradients flow as well.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.core import requests, rules
from shoal.core.basics import rank
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import Kind, ReduceOp, ReduceSpec, Select


def _own_rows(reduced: torch.Tensor, rows: torch.Tensor, process_set: ProcessSet, count: int) -> torch.Tensor:
    """This rank's rows of a gathered gradient: offset by the rows of the set's lower ranks."""
    offset = int(rows[: process_set.rank()].sum())
    return reduced.narrow(0, offset, count)


def _backward(kind: Kind, ctx: Any, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The gradients of ``kind``'s inputs, by ``rules.GRADIENTS[kind]``."""
    rule = rules.GRADIENTS[kind]
    process_set: ProcessSet = ctx.process_set
    scale = rules.gradient_scale(kind, ctx.op, process_set.size(), ctx.prescale, ctx.postscale)
    scaled = [(grad * scale if scale != 1.0 else grad).contiguous() for grad in grads]
    if rule.collective == Kind.ALLREDUCE:
        op = rules.gradient_op(kind, ctx.op)
        assert op is not None
        prescale, postscale = rules.backward_factors(kind, ctx.prescale, ctx.postscale)
        carried = list(GroupedAllreduceFunction.apply(None, int(op), prescale, postscale, process_set, *scaled))
    elif rule.collective == Kind.ALLGATHER:
        carried = list(GroupedAllgatherFunction.apply(None, process_set, *scaled))
    else:
        carried = [AlltoallFunction.apply(scaled[0], ctx.received, None, process_set)[0]]
    if rule.select == Select.OWN_ROWS:
        counts = requests.run(requests.Call(Kind.ALLGATHER, process_set), [torch.tensor([ctx.rows])], None, grouped=False)
        carried = [
            _own_rows(value, counts[:, index], process_set, count)
            for index, (value, count) in enumerate(zip(carried, ctx.rows, strict=True))
        ]
        carried = [value.reshape(()) if scalar else value for value, scalar in zip(carried, ctx.scalars, strict=True)]
    elif rule.select == Select.ROOT_ONLY and not rules.is_gradient_root(rank(), ctx.root_rank):
        carried = [torch.zeros_like(value) for value in carried]
    return carried


def _remember(ctx: Any, process_set: ProcessSet, op: int | None = None, prescale: float = 1.0, postscale: float = 1.0) -> None:
    ctx.process_set, ctx.op, ctx.prescale, ctx.postscale = process_set, op, prescale, postscale


class AllreduceFunction(torch.autograd.Function):
    """allreduce with gradient."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet
    ) -> torch.Tensor:
        _remember(ctx, process_set, op, prescale, postscale)
        call = requests.Call(Kind.ALLREDUCE, process_set, ReduceSpec(ReduceOp(op), prescale, postscale))
        return requests.run(call, [tensor], name, grouped=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _backward(Kind.ALLREDUCE, ctx, (grad,))[0], None, None, None, None, None


class GroupedAllreduceFunction(torch.autograd.Function):
    """grouped allreduce with gradient: the gradients are reduced as one group, with the same op and factors."""

    @staticmethod
    def forward(
        ctx: Any, name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        _remember(ctx, process_set, op, prescale, postscale)
        call = requests.Call(Kind.ALLREDUCE, process_set, ReduceSpec(ReduceOp(op), prescale, postscale))
        return tuple(requests.run(call, list(tensors), name, grouped=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, None, None, None, *_backward(Kind.ALLREDUCE, ctx, grads))


def _remember_rows(ctx: Any, tensors: tuple[torch.Tensor, ...]) -> None:
    ctx.rows = [tensor.shape[0] if tensor.dim() else 1 for tensor in tensors]
    ctx.scalars = [tensor.dim() == 0 for tensor in tensors]


class AllgatherFunction(torch.autograd.Function):
    """allgather with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        _remember(ctx, process_set)
        _remember_rows(ctx, (tensor,))
        return requests.run(requests.Call(Kind.ALLGATHER, process_set), [tensor], name, grouped=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _backward(Kind.ALLGATHER, ctx, (grad,))[0], None, None


class GroupedAllgatherFunction(torch.autograd.Function):
    """grouped allgather with gradient."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _remember(ctx, process_set)
        _remember_rows(ctx, tensors)
        return tuple(requests.run(requests.Call(Kind.ALLGATHER, process_set), list(tensors), name, grouped=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, *_backward(Kind.ALLGATHER, ctx, grads))


class BroadcastFunction(torch.autograd.Function):
    """broadcast with gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> Any:
        _remember(ctx, process_set)
        ctx.root_rank = root_rank
        return requests.run(requests.Call(Kind.BROADCAST, process_set, root_rank=root_rank), [tensor], name, grouped=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _backward(Kind.BROADCAST, ctx, (grad,))[0], None, None, None


class AlltoallFunction(torch.autograd.Function):
    """alltoall with gradient; returns (received tensor, received splits)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: tuple[int, ...] | None, name: str | None, process_set: ProcessSet
    ) -> Any:
        _remember(ctx, process_set)
        call = requests.Call(Kind.ALLTOALL, process_set, splits=splits)
        output, received = requests.run(call, [tensor], name, grouped=False)
        ctx.received = tuple(int(count) for count in received.tolist())
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_grad_splits: Any) -> tuple[Any, ...]:
        return _backward(Kind.ALLTOALL, ctx, (grad,))[0], None, None, None


class ReducescatterFunction(torch.autograd.Function):
    """reducescatter with gradient."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet, prescale: float, postscale: float
    ) -> Any:
        _remember(ctx, process_set, op, prescale, postscale)
        call = requests.Call(Kind.REDUCESCATTER, process_set, ReduceSpec(ReduceOp(op), prescale, postscale))
        return requests.run(call, [tensor], name, grouped=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _backward(Kind.REDUCESCATTER, ctx, (grad,))[0], None, None, None, None, None


class GroupedReducescatterFunction(torch.autograd.Function):
    """grouped reducescatter with gradient."""

    @staticmethod
    def forward(
        ctx: Any, name: str | None, op: int, process_set: ProcessSet, prescale: float, postscale: float, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        _remember(ctx, process_set, op, prescale, postscale)
        call = requests.Call(Kind.REDUCESCATTER, process_set, ReduceSpec(ReduceOp(op), prescale, postscale))
        return tuple(requests.run(call, list(tensors), name, grouped=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, None, None, None, *_backward(Kind.REDUCESCATTER, ctx, grads))
