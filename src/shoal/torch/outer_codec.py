"""The codecs of the outer exchange (``shoal.plan.outer_wire.Codec``): bf16 and int8 with a float32 scale per chunk, both
with error feedback, for ``shoal.torch.local_steps``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.plan.outer_wire import INT8_CHUNK, Codec


class Feedback:
    """A lossy codec with error feedback: each round sends the pseudo-gradient plus what rounding left out of the
    earlier rounds, and keeps what it leaves out now, so that the error does not accumulate. Its buffers are kept
    from round to round (a fresh megabyte-sized tensor costs its page faults every time)."""

    def __init__(self, codec: Codec) -> None:
        if not codec.gathered:
            raise ValueError(f"{codec} is not a lossy codec")
        self.codec = codec
        self.residual: torch.Tensor | None = None
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
        codes, scales = int8_encode(corrected, work)
        corrected.sub_(int8_decode(codes, scales, delta.numel(), work))
        return [codes, scales]


def padded_buffer(buffer: torch.Tensor | None, count: int) -> torch.Tensor:
    """A float32 buffer of ``count`` entries rounded up to whole ``INT8_CHUNK``s (``buffer`` where it fits)."""
    size = -(-count // INT8_CHUNK) * INT8_CHUNK
    return buffer if buffer is not None and buffer.numel() == size else torch.empty(size)


def decode(codec: Codec, payload: Sequence[torch.Tensor], count: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values a payload of ``codec`` stands for (in ``work``, a ``padded_buffer``, where given)."""
    if codec is Codec.BF16:
        return payload[0].float()
    return int8_decode(payload[0], payload[1], count, work)


def int8_encode(values: torch.Tensor, work: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (one per entry) and a float32 scale per ``INT8_CHUNK`` entries (the chunk's largest magnitude maps
    to 127, rounded to nearest). ``work``: a ``padded_buffer`` to compute in (overwritten)."""
    count = values.numel()
    work = padded_buffer(work, count)
    work[:count].copy_(values)
    work[count:].zero_()
    rows = work.view(-1, INT8_CHUNK)
    scales = rows.abs().amax(dim=1).div_(127.0)
    inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    rows.mul_(inverse.unsqueeze(1)).round_()  # |x|·127/max ≤ 127: no clamp needed
    return work[:count].to(torch.int8), scales


def int8_decode(codes: torch.Tensor, scales: torch.Tensor, count: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values ``int8_encode`` stands for (a view of ``work``, a ``padded_buffer``, where given)."""
    work = padded_buffer(work, count)
    work[:count].copy_(codes)
    work[count:].zero_()
    work.view(-1, INT8_CHUNK).mul_(scales.unsqueeze(1))
    return work[:count]
