"""Gradient compression for allreduce: ``compress(t) -> (t, ctx)`` and ``decompress(t, ctx)``."""

from __future__ import annotations

from typing import Any

import torch

from shoal.plan.costs import Factors, LossyOptions
from shoal.plan.schemes import Compressed, Scheme

__all__ = [
    "BF16Compressor",
    "CastCompressor",
    "Compressed",
    "Compression",
    "Compressor",
    "FP16Compressor",
    "NoneCompressor",
    "powersgd",
    "topk",
]


class Compressor:
    """Interface: compress before the wire, decompress after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and what ``decompress`` needs to undo it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class CastCompressor(Compressor):
    """Send floating-point tensors as ``wire_dtype`` and restore their dtype after; other dtypes pass through."""

    wire_dtype: torch.dtype = torch.float32

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class FP16Compressor(CastCompressor):
    """Half the bytes on the wire; fp16 keeps 11 bits of mantissa and overflows past 65504."""

    wire_dtype = torch.float16


class BF16Compressor(CastCompressor):
    """Half the bytes on the wire; bf16 keeps fp32's range with 8 bits of mantissa (Horovod has no bf16)."""

    wire_dtype = torch.bfloat16


def powersgd(
    rank: int | None = 4,
    warmup_steps: int | None = None,
    total_steps: int | None = None,
    min_compression_rate: float = 2.0,
    max_rank: int = 4,
    min_rank: int = 2,
    factors: Factors = "float32",
) -> Compressed:
    """PowerSGD with error feedback and warm start for every gradient with a matrix view (docs/communication.md).

    Args:
        rank: r of the low-rank approximation; None: chosen per layer from the measured costs (``comm="auto-lossy"``),
            up to ``max_rank``.
        warmup_steps: optimizer steps sent uncompressed first; None: 10% of ``total_steps`` when given, else 100.
        total_steps: the run's length in optimizer steps, when known.
        min_compression_rate: a gradient is compressed only where n·m ≥ this × r·(n+m); the rest are allreduced.
        max_rank: the highest rank a per-layer choice may take.
        min_rank: the lowest (rank 1 converges noticeably slower).
        factors: P and Q on the wire: ``"float32"``, as torch's hook, or ``"bfloat16"`` (half the bytes; each
            rank's error feedback keeps the rounding of its own share; the planner weighs the smaller messages).
    """
    options = LossyOptions(
        rank=rank, max_rank=max(max_rank, rank or 1), min_rank=min_rank, min_rate=min_compression_rate, factors=factors
    )
    return Compressed(Scheme.POWERSGD, options, warmup_steps, total_steps)


def topk(
    ratio: float = 0.01, warmup_steps: int | None = None, total_steps: int | None = None, min_compression_rate: float = 2.0
) -> Compressed:
    """Top-k sparsification with error feedback: each rank sends its ``ratio`` largest entries (by magnitude) of every
    gradient it shrinks at least ``min_compression_rate`` times, with their indices (docs/communication.md).
    ``warmup_steps`` and ``total_steps`` as for ``powersgd``."""
    return Compressed(Scheme.TOPK, LossyOptions(ratio=ratio, min_rate=min_compression_rate), warmup_steps, total_steps)


class Compression:
    """The available compressors, under Horovod's names (plus ``bf16``, which Horovod lacks), and the compressed
    schemes with error feedback, ``powersgd(rank=4)`` and ``topk(ratio=0.01)``, which Horovod lacks."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = staticmethod(powersgd)
    topk = staticmethod(topk)
