"""Tensor fusion: pack agreed allreduce responses that can share one collective into buffers up to a threshold."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.engine.negotiation import Response
from shoal.engine.request import Kind


@dataclass
class FusedBatch:
    """Responses executed together: several allreduces in one buffer, or any single response."""

    responses: list[Response] = field(default_factory=list)
    nbytes: int = 0


def _fusion_key(response: Response) -> tuple[object, ...] | None:
    if response.kind != Kind.ALLREDUCE or response.error is not None or response.meta.shared is not None:
        return None  # an arena's range is reduced where it lies, alone
    meta = response.meta
    return (meta.dtype, meta.device, meta.op, meta.process_set, meta.prescale, meta.postscale)


def plan_batches(responses: Sequence[Response], threshold_bytes: int, solo_bytes: int) -> list[FusedBatch]:
    """Group responses into batches, in an order every rank derives identically.

    Allreduces with the same dtype, device, op, process set and scale factors share a batch until adding the next
    would pass ``threshold_bytes``. A tensor of ``solo_bytes`` or more is reduced alone, in place: on CPU, copying
    it into and out of a fusion buffer costs more memory bandwidth than the one collective it would save.
    Every other response is a batch of one, in agreed order.
    """
    batches: list[FusedBatch] = []
    open_batches: dict[tuple[object, ...], FusedBatch] = {}
    for response in responses:
        key = _fusion_key(response)
        size = response.meta.nbytes if key is not None else 0
        if key is None or threshold_bytes == 0 or size >= solo_bytes:
            batches.append(FusedBatch([response], size))
            continue
        batch = open_batches.get(key)
        if batch is None or batch.nbytes + size > threshold_bytes:
            batch = FusedBatch()
            batches.append(batch)
            open_batches[key] = batch
        batch.responses.append(response)
        batch.nbytes += size
    return batches
