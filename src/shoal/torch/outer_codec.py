"""The codecs of the outer exchange (``shoal.plan.outer_wire.Codec``): bf16, and int8 and int4 with a float32 scale per
chunk, all with error feedback, for ``shoal.torch.local_steps``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.plan.outer_wire import INT8_CHUNK, Codec


class Feedback:
    """A lossy codec with error feedback: each round sends the pseudo-gradient plus what rounding left out of the
    earlier rounds, and keeps what it leaves out now, so that the error does not accumulate. Its buffers are kept
    from round to round (a fresh megabyte-sized tensor costs its page faults every time)."""

    def __init__(self, codec: Codec, residual: torch.Tensor | None = None) -> None:
        if not codec.gathered:
            raise ValueError(f"{codec} is not a lossy codec")
        self.codec = codec
        self.residual = residual
        """What rounding left out so far (``residual``: another codec's, carried over when a re-plan changes it)."""
        self._work: torch.Tensor | None = None

    def encode(self, delta: torch.Tensor) -> list[torch.Tensor]:
        """The payload for ``delta`` (float32, flat); the residual becomes what it leaves out."""
        if self.residual is None or self.residual.numel() != delta.numel():
            self.residual = torch.zeros_like(delta)
        corrected = self.residual.add_(delta)
        if self.codec is Codec.BF16:
            payload = [corrected.to(torch.bfloat16)]
            corrected.sub_(payload[0].float())
            return payload
        self._work = work = padded_buffer(self._work, delta.numel())
        encode, decode = QUANTISED[self.codec]
        codes, scales = encode(corrected, work)
        corrected.sub_(decode(codes, scales, delta.numel(), work))
        return [codes, scales]


def padded_buffer(buffer: torch.Tensor | None, count: int) -> torch.Tensor:
    """A float32 buffer of ``count`` entries rounded up to whole ``INT8_CHUNK``s (``buffer`` where it fits)."""
    size = -(-count // INT8_CHUNK) * INT8_CHUNK
    return buffer if buffer is not None and buffer.numel() == size else torch.empty(size)


def decode(codec: Codec, payload: Sequence[torch.Tensor], count: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values a payload of ``codec`` stands for (in ``work``, a ``padded_buffer``, where given)."""
    if codec is Codec.BF16:
        return payload[0].float()
    return QUANTISED[codec][1](payload[0], payload[1], count, work)


def quantise(values: torch.Tensor, levels: int, work: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` as whole numbers from -``levels`` to ``levels`` (float32, in ``work``, a ``padded_buffer``, padded
    with zeros) and a float32 scale per ``INT8_CHUNK`` entries: the chunk's largest magnitude maps to ``levels``,
    rounded to nearest."""
    count = values.numel()
    work = padded_buffer(work, count)
    work[:count].copy_(values)
    work[count:].zero_()
    rows = work.view(-1, INT8_CHUNK)
    scales = rows.abs().amax(dim=1).div_(float(levels))
    inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    rows.mul_(inverse.unsqueeze(1)).round_()  # |x|·levels/max ≤ levels: no clamp needed
    return work, scales


def scaled(work: torch.Tensor, scales: torch.Tensor, count: int) -> torch.Tensor:
    """The codes in ``work`` (a ``padded_buffer``, its first ``count`` entries filled) times their chunk's scale."""
    work[count:].zero_()
    work.view(-1, INT8_CHUNK).mul_(scales.unsqueeze(1))
    return work[:count]


def int8_encode(values: torch.Tensor, work: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (one per entry, -127 to 127) and a float32 scale per ``INT8_CHUNK`` entries. ``work``: a
    ``padded_buffer`` to compute in (overwritten)."""
    work, scales = quantise(values, 127, work)
    return work[: values.numel()].to(torch.int8), scales


def int8_decode(codes: torch.Tensor, scales: torch.Tensor, count: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values ``int8_encode`` stands for (a view of ``work``, a ``padded_buffer``, where given)."""
    work = padded_buffer(work, count)
    work[:count].copy_(codes)
    return scaled(work, scales, count)


def int4_encode(values: torch.Tensor, work: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes (-7 to 7, stored plus 8, two to a uint8: entry 2i in the low nibble, 2i+1 in the high; one byte per
    two entries, the last half-filled for an odd count) and a float32 scale per ``INT8_CHUNK`` entries. ``work``: a
    ``padded_buffer`` to compute in (overwritten)."""
    count = values.numel()
    work, scales = quantise(values, 7, work)
    nibbles = work.add_(8.0).to(torch.uint8).view(-1, 2)  # a chunk is even, so the padded codes pair up
    packed = nibbles[:, 0].bitwise_or_(nibbles[:, 1].bitwise_left_shift_(4))
    return packed[: -(-count // 2)].clone(), scales


def int4_decode(codes: torch.Tensor, scales: torch.Tensor, count: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values ``int4_encode`` stands for (a view of ``work``, a ``padded_buffer``, where given)."""
    work = padded_buffer(work, count)
    pairs = work[: 2 * codes.numel()].view(-1, 2)
    pairs[:, 0].copy_(codes.bitwise_and(15))
    pairs[:, 1].copy_(codes.bitwise_right_shift(4))
    work[:count].sub_(8.0)
    return scaled(work, scales, count)


QUANTISED = {Codec.INT8: (int8_encode, int8_decode), Codec.INT4: (int4_encode, int4_decode)}
"""The quantised codecs' (encode, decode): codes and a scale per chunk."""
