"""Check a request on the submitting thread, before anything is queued: one bad request fails alone, at once.

What the engine can carry is decided here, once, for every front end: the dtypes, the device types, and which
reductions make sense for which dtypes. A request that passes runs on every rank (its peers' requests were
checked the same way, and negotiation compares them); one that fails raises ``TypeError`` or ``ValueError`` naming
the tensor and what is supported, and the engine never sees it.
"""

from __future__ import annotations

import math

from shoal.engine.request import DATA_KINDS, Kind, ReduceOp, RequestMeta

SUPPORTED_DTYPES = (
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
"""Horovod's dtypes (uint8 to float64, bool), plus complex: sums and averages of complex tensors are computed on
their real and imaginary parts. Unsigned 16/32/64-bit integers and float8 have no reduction kernels in gloo."""

DEVICE_TYPES = ("cpu", "cuda")
"""gloo serves CPU tensors, NCCL CUDA tensors."""

_REDUCING = (Kind.ALLREDUCE, Kind.REDUCESCATTER)
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_REDUCESCATTER_OPS = (ReduceOp.Average, ReduceOp.Sum)
_COMPLEX_OPS = (ReduceOp.Average, ReduceOp.Sum)
_BOOL_OPS = (ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)
"""Logical AND (Min, Product) and OR (Max). A sum or an average of booleans has no boolean answer."""


_OP_VALUES = frozenset(int(op) for op in ReduceOp)


def check_request(meta: RequestMeta) -> None:
    """Raise if the engine cannot run ``meta`` on every rank; return quietly otherwise.

    Raises:
        TypeError: an unsupported dtype, or a reduction that is not defined for the dtype.
        ValueError: an unsupported device type, op, or scale factor.
    """
    if not meta.name:
        raise ValueError(f"a {meta.kind.value} request needs a non-empty name")
    if meta.kind not in DATA_KINDS:
        return
    what = f"{meta.kind.value} of tensor '{meta.name}'"
    if meta.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: dtype {meta.dtype} is not supported; supported dtypes: {', '.join(SUPPORTED_DTYPES)}")
    if meta.device not in DEVICE_TYPES:
        raise ValueError(f"{what}: tensors on '{meta.device}' are not supported; use a CPU or CUDA tensor")
    if any(dim < 0 for dim in meta.shape):
        raise ValueError(f"{what}: invalid shape {meta.shape}")
    if meta.kind not in _REDUCING:
        return
    if meta.op is None or meta.op not in _OP_VALUES:
        raise ValueError(f"{what}: unknown reduce op {meta.op}")
    op = ReduceOp(meta.op)
    if meta.kind == Kind.REDUCESCATTER and op not in _REDUCESCATTER_OPS:
        raise ValueError(f"{what}: reducescatter supports Average and Sum, not {op.name}")
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
