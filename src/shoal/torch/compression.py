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


def cast_compressor(wire_dtype: torch.dtype, label: str) -> type[Compressor]:
    """A compressor that sends floating-point tensors as ``wire_dtype`` and restores their dtype after."""

    class CastCompressor(Compressor):
        __doc__ = f"Send floating-point tensors as {label}; other dtypes pass through."

        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
            if tensor.is_floating_point() and tensor.dtype != wire_dtype:
                return tensor.to(wire_dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
            return tensor.to(ctx) if ctx is not None else tensor

    CastCompressor.__name__ = CastCompressor.__qualname__ = f"{label.upper()}Compressor"
    return CastCompressor


class Compression:
    """The available compressors, under Horovod's names (plus ``bf16``, which Horovod lacks)."""

    none = NoneCompressor
    fp16 = cast_compressor(torch.float16, "fp16")
    bf16 = cast_compressor(torch.bfloat16, "bf16")
