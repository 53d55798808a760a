"""Elementwise reductions of one tensor into another, by the engine's reduction names (sum, product, min, max,
band): what the shared-memory collectives and the ring reduce-scatter apply to each block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

REDUCE_INTO: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "sum": lambda acc, other: acc.add_(other) if acc.dtype != torch.bool else acc.logical_or_(other),
    "product": lambda acc, other: acc.mul_(other) if acc.dtype != torch.bool else acc.logical_and_(other),
    "min": lambda acc, other: torch.minimum(acc, other, out=acc),
    "max": lambda acc, other: torch.maximum(acc, other, out=acc),
    "band": lambda acc, other: acc.bitwise_and_(other),
}


REDUCE_OUT: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]] = {
    "sum": lambda a, b, out: torch.add(a, b, out=out) if a.dtype != torch.bool else torch.logical_or(a, b, out=out),
    "product": lambda a, b, out: torch.mul(a, b, out=out) if a.dtype != torch.bool else torch.logical_and(a, b, out=out),
    "min": lambda a, b, out: torch.minimum(a, b, out=out),
    "max": lambda a, b, out: torch.maximum(a, b, out=out),
    "band": lambda a, b, out: torch.bitwise_and(a, b, out=out),
}
