"""Check a request on the submitting thread, before anything is queued: one bad request fails alone, at once.

What the engine can carry is decided here, once, for every front end: the dtypes, the device types, and which
reductions make sense for which dtypes. A request that passes runs on every rank (its peers' requests were
checked the same way, and negotiation compares them); one that fails raises ``TypeError`` or ``ValueError`` naming
the tensor and what is supported, and the engine never sees it.
"""

from __future__ import annotations

import math

import torch

from shoal.engine.request import DATA_KINDS, Kind, ReduceOp, RequestMeta
from shoal.exceptions import UnsupportedOperationError

REDUCING_DTYPES = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
    "complex64",
    "complex128",
)
"""What allreduce and reducescatter reduce: Horovod's dtypes (uint8 to float64, bool), plus complex (sums and
averages of complex tensors are computed on their real and imaginary parts). Unsigned 16/32/64-bit integers and
float8 have no reduction kernels in gloo, so reductions refuse them."""

_EXTRA_MOVABLE = (
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex32",
)

MOVABLE_DTYPES = REDUCING_DTYPES + tuple(name for name in _EXTRA_MOVABLE if isinstance(getattr(torch, name, None), torch.dtype))
"""What allgather, broadcast and alltoall move: every reducing dtype, and every other fixed-width dtype this torch
has (moving bytes needs no arithmetic; they travel as integers of the same width)."""

_MOVING = (Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL)


def dtypes_for(kind: Kind) -> tuple[str, ...]:
    """The dtypes a data request of ``kind`` accepts (reductions also check each op against the dtype)."""
    return MOVABLE_DTYPES if kind in _MOVING else REDUCING_DTYPES


DEVICE_TYPES = ("cpu", "cuda")
"""gloo serves CPU tensors, NCCL CUDA tensors."""

_REDUCING = (Kind.ALLREDUCE, Kind.REDUCESCATTER)
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
REDUCESCATTER_OPS = (ReduceOp.Average, ReduceOp.Sum)
"""Horovod's reducescatter reduces with Sum or Average; anything else (Adasum, Min, Max, Product) is refused."""
_COMPLEX_OPS = (ReduceOp.Average, ReduceOp.Sum)
_BOOL_OPS = (ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)
"""Logical AND (Min, Product) and OR (Max). A sum or an average of booleans has no boolean answer."""


_OP_VALUES = frozenset(int(op) for op in ReduceOp)


def check_request(meta: RequestMeta) -> None:
    """Raise if the engine cannot run ``meta`` on every rank; return quietly otherwise.

    Raises:
        TypeError: an unsupported dtype, or a reduction that is not defined for the dtype.
        ValueError: an unsupported device type, op, or scale factor.
        UnsupportedOperationError: an op Horovod does not run (reducescatter with Min, Max, Product or Adasum).
    """
    if not meta.name:
        raise ValueError(f"a {meta.kind.value} request needs a non-empty name")
    if meta.kind not in DATA_KINDS:
        return
    what = f"{meta.kind.value} of tensor '{meta.name}'"
    accepted = dtypes_for(meta.kind)
    if meta.dtype not in accepted:
        if meta.dtype in MOVABLE_DTYPES:
            raise TypeError(
                f"{what}: dtype {meta.dtype} has no reduction arithmetic here; reductions take {', '.join(REDUCING_DTYPES)} "
                "(allgather, broadcast and alltoall move it)"
            )
        raise TypeError(f"{what}: dtype {meta.dtype} is not supported; supported dtypes: {', '.join(accepted)}")
    if meta.device not in DEVICE_TYPES:
        raise ValueError(f"{what}: tensors on '{meta.device}' are not supported; use a CPU or CUDA tensor")
    if any(dim < 0 for dim in meta.shape):
        raise ValueError(f"{what}: invalid shape {meta.shape}")
    if meta.kind not in _REDUCING:
        return
    if meta.op is None or meta.op not in _OP_VALUES:
        raise ValueError(f"{what}: unknown reduce op {meta.op}")
    op = ReduceOp(meta.op)
    if meta.kind == Kind.REDUCESCATTER and op not in REDUCESCATTER_OPS:
        raise UnsupportedOperationError(f"{what}: reducescatter supports Average and Sum, not {op.name}")
    if op == ReduceOp.Adasum and meta.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what}: Adasum combines floating-point tensors only ({', '.join(_FLOAT_DTYPES)}), not {meta.dtype}")
    if meta.dtype.startswith("complex") and op not in _COMPLEX_OPS:
        raise TypeError(f"{what}: {op.name} is not defined for complex tensors; supported: Sum, Average")
    if meta.dtype == "bool":
        if op not in _BOOL_OPS:
            raise TypeError(
                f"{what}: {op.name} is not defined for bool tensors; use Min or Product (logical and) or Max (logical or)"
            )
        if meta.prescale != 1.0 or meta.postscale != 1.0:
            raise TypeError(f"{what}: bool tensors cannot be scaled (prescale/postscale factors must be 1)")
    for label, factor in (("prescale", meta.prescale), ("postscale", meta.postscale)):
        if not math.isfinite(factor):
            raise ValueError(f"{what}: the {label} factor must be a finite number, got {factor}")
