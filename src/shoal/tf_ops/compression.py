"""Gradient compression for TensorFlow tensors, as ``horovod.tensorflow.compression``: ``Compression.none`` and
``Compression.fp16`` (floating tensors travel as float16 and come back in their own dtype)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """Compress a tensor before a collective and restore it after."""

    @staticmethod
    def compress(tensor: Any, ctx: Any = None) -> tuple[Any, Any]:
        """The tensor to send and what ``decompress`` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """The received tensor in its original form."""
        return tensor


class NoneCompressor(Compressor):
    """Send tensors as they are."""


class FP16Compressor(Compressor):
    """Send floating tensors as float16; other tensors as they are."""

    @staticmethod
    def compress(tensor: Any, ctx: Any = None) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if dtype.is_floating:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class Compression:
    """The compressors, as classes (Horovod's ``Compression.none`` and ``Compression.fp16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
