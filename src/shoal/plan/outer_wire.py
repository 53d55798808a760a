"""The outer exchange on the wire: the codecs a pseudo-gradient crosses the hosts' link in, the bytes each sends, and
what an exchange costs on a calibrated link (``shoal.plan.far`` chooses the round and the codec from it).

The package imports no framework; the torch codecs are ``shoal.torch.outer_codec``.
"""

from __future__ import annotations

import enum
import math

from shoal.plan.calibration import Calibration

INT8_CHUNK = 256
"""Entries per scale of the quantised codecs: each chunk of the pseudo-gradient is sent as int8 (or int4) codes with
one float32 scale."""


class Codec(str, enum.Enum):
    """How the pseudo-gradient crosses the hosts' link."""

    FP32 = "fp32"
    """As it is: one allreduce of float32 (exact up to the sum's rounding)."""
    BF16 = "bf16"
    """Rounded to bfloat16 with error feedback, allgathered, summed in float32."""
    INT8 = "int8"
    """int8 codes with a float32 scale per ``INT8_CHUNK`` entries and error feedback, allgathered, summed in float32
    (OpenDiLoCo and INTELLECT-1 send int8 outer gradients)."""
    INT4 = "int4"
    """4-bit codes (-7 to 7, two to a byte) with a float32 scale per ``INT8_CHUNK`` entries and error feedback,
    allgathered, summed in float32: half of int8's bytes, for links where int8's round would be capped (Streaming
    DiLoCo sends 4-bit outer gradients)."""

    def __str__(self) -> str:
        return self.value

    def wire_bytes(self, entries: int) -> int:
        """Bytes one host sends for a pseudo-gradient of ``entries``."""
        if self is Codec.FP32:
            return 4 * entries
        if self is Codec.BF16:
            return 2 * entries
        codes = entries if self is Codec.INT8 else math.ceil(entries / 2)
        return codes + 4 * math.ceil(entries / INT8_CHUNK)

    @property
    def gathered(self) -> bool:
        """It is allgathered and summed locally (codes do not add); fp32 is allreduced."""
        return self is not Codec.FP32


CODEC_PASSES = {Codec.FP32: 0.0, Codec.BF16: 3.0, Codec.INT8: 6.0, Codec.INT4: 8.0}
"""Passes over the float32 pseudo-gradient that a codec's local work makes (residual added, scale, round, new
residual; then one decode-and-add per host), for the cost model's memory-bound estimate. int4's packing and
unpacking took 1.5 times int8's encode and decode (2.4M entries, one thread: 15.0 ms against 8.8 ms)."""

WIRE_FRAMING = 1.07
"""What a host's interface counts over the exchange's payload, for ``wire_share``: TCP over Ethernet adds 66 bytes of
headers to each 1,448-byte segment, and the receiver acknowledges every second segment with a 66-byte frame."""


def link_line(calibration: Calibration, hosts: int) -> tuple[float, float]:
    """(α, β) of one host's link for a ring of ``hosts``: the inter-host line when the calibration has one, else the
    job's allreduce line. A ring allreduce of B bytes among N moves 2(N-1)/N·B per link, so β per link byte is the
    line's per-byte over that share."""
    latency, per_byte = calibration.links.get("inter-host", calibration.lines["allreduce"])
    ring = max(hosts, 2)
    return latency, per_byte * ring / (2 * (ring - 1))


def link_share(codec: Codec, hosts: int) -> float:
    """The payloads each host's link carries per exchange among ``hosts``: a ring allreduce moves 2(N-1)/N of it, an
    allgather of codes N-1 copies."""
    return (hosts - 1) if codec.gathered else 2 * (hosts - 1) / hosts


def exchange_parts(calibration: Calibration, hosts: int, entries: int, codec: Codec, fragments: int = 1) -> tuple[float, float]:
    """One outer exchange of ``entries`` in ``codec`` among ``hosts``, sent as ``fragments`` equal parts: (the wire:
    per part, a ring allreduce of float32, or an allgather of every host's codes, (N-1)·bytes per link; the codec's
    local work)."""
    if hosts < 2:
        return 0.0, 0.0
    latency, link_per_byte = link_line(calibration, hosts)
    part = math.ceil(entries / fragments)
    payload = codec.wire_bytes(part)
    share = link_share(codec, hosts)
    passes = CODEC_PASSES[codec] + (hosts if codec.gathered else 0)
    wire = fragments * (latency + link_per_byte * share * payload)
    return wire, fragments * calibration.local_seconds("codec-pass", part) * passes


def exchange_seconds(calibration: Calibration, hosts: int, entries: int, codec: Codec, fragments: int = 1) -> float:
    """One outer exchange's wire and local work (``exchange_parts``, summed)."""
    return sum(exchange_parts(calibration, hosts, entries, codec, fragments))
