"""What a buffer needs on its way to the wire and back: the dtype the transport moves, and Horovod's scaling."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.engine.request import ReduceOp, RequestMeta
from shoal.engine.validation import REDUCING_DTYPES

WIRE_DTYPES = {torch.int16: torch.int32}
"""gloo has no int16 kernels; such tensors travel as int32 (exact, and wraps the same way once cast back)."""

REDUCTIONS = {ReduceOp.Average: "sum", ReduceOp.Sum: "sum", ReduceOp.Min: "min", ReduceOp.Max: "max"}
REDUCTIONS[ReduceOp.Product] = "product"

_BIT_TWINS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""A signed integer of each width: the bits of any fixed-width dtype travel as it, unchanged."""


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a dtype the transport moves: itself for a reducing dtype, else its bits as a signed integer of
    the same width (the same memory; ``.view(dtype)`` turns the result back, bit for bit)."""
    if str(tensor.dtype).removeprefix("torch.") in REDUCING_DTYPES:
        return tensor
    return tensor.view(_BIT_TWINS[tensor.element_size()])


def dtype_of(meta: RequestMeta) -> torch.dtype:
    return getattr(torch, meta.dtype)


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply in place; integer tensors are scaled in float64 and truncated, as Horovod does."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))


def postscale_(tensor: torch.Tensor, op: ReduceOp, postscale: float, members: int) -> None:
    """Scale a reduced buffer as Horovod does: Average is a sum scaled by ``postscale / members`` in one step, so an
    integer average truncates toward zero once (-3 over 2 ranks gives -1)."""
    scale_(tensor, postscale_factor(op, postscale, members))


def postscale_factor(op: ReduceOp, postscale: float, members: int) -> float:
    return postscale / members if op == ReduceOp.Average else postscale


def scale_into(source: torch.Tensor, factor: float, out: torch.Tensor) -> None:
    """``out = source * factor``, exactly as ``scale_`` then a copy would give (one pass for floating point)."""
    if factor == 1.0:
        out.copy_(source)
    elif source.is_floating_point() or source.is_complex():
        torch.mul(source, factor, out=out)
    else:
        scale_(source, factor)
        out.copy_(source)


def postscaler(op: ReduceOp, postscale: float, members: int) -> Callable[[torch.Tensor], None] | None:
    """``postscale_`` as a step on part of a reduced buffer (None when it changes nothing)."""
    factor = postscale_factor(op, postscale, members)
    return None if factor == 1.0 else lambda part: scale_(part, factor)


def real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as pairs of reals (same memory); sums and averages are then computed part by part."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def split_rows(rows: int, parts: int) -> list[int]:
    """Rows per part when ``rows`` are split as evenly as possible, the first parts taking the remainder."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
