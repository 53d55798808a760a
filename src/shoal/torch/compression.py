"""Gradient compression for allreduce: ``compress(t) -> (t, ctx)`` and ``decompress(t, ctx)``."""

from __future__ import annotations

from typing import Any

import torch


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


class Compression:
    """The available compressors, under Horovod's names (plus ``bf16``, which Horovod lacks)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
