"""The gradients of a stage-2 sharded optimizer (ZeRO): reduce-scattered bucket by bucket, kept only in shards.

The buckets are the sharded optimizer's fixed ones (``sharding.layout``), not the open bucket: each rank must
receive, from every bucket, exactly the block of elements it owns. A final gradient waits for the rest of its
bucket; a complete bucket leaves at once as one asynchronous reducescatter (wait-free backprop, as the ordinary
buckets), and its parameters' gradients are freed, so no rank holds the whole gradient after backward. ``finish()``
sends what never completed (zeros for a parameter without a gradient, so no rank hangs), lands every reduction and
hands each block to the shards.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import ReduceSpec
from shoal.torch import functions
from shoal.torch.compression import Compressor
from shoal.torch.sharding.layout import Bucket, ShardLayout
from shoal.torch.sharding.shards import ShardedOptimizer


class _Sent(NamedTuple):
    bucket: Bucket
    handle: int
    context: object
    """The compressor's context, to decompress the block."""


class ScatteredGradients:
    """Stage 2's part of the gradient exchange: the fixed buckets, the gradients waiting in them, and the
    reduce-scatters in flight."""

    __slots__ = ("_by_param", "_in_flight", "_layout", "_sent", "_waiting", "compressor", "params", "shards")

    def __init__(self, shards: ShardedOptimizer, compressor: type[Compressor]) -> None:
        self.shards = shards
        self.params = shards.params
        self.compressor = compressor
        self._waiting: dict[int, set[int]] = {}
        self._sent: set[int] = set()
        self._in_flight: list[_Sent] = []
        self._layout: ShardLayout | None = None
        self._by_param: dict[int, Bucket] = {}

    @property
    def _bucket_of(self) -> dict[int, Bucket]:
        """Each parameter's bucket, by ``id``, in the shards' current layout (an elastic re-form changes it)."""
        layout = self.shards.layout
        if self._layout is not layout:
            self._layout = layout
            self._by_param = {id(self.params[p]): bucket for bucket in layout.buckets for p in bucket.params}
        return self._by_param

    @property
    def pending(self) -> bool:
        """Gradients of this step wait in a bucket or are on their way."""
        return bool(self._waiting or self._in_flight)

    def ready(self, param: torch.Tensor, spec: ReduceSpec, process_set: ProcessSet) -> None:
        """``param``'s gradient is final: send its bucket if it was the last one missing."""
        bucket = self._bucket_of[id(param)]
        waiting = self._waiting.setdefault(bucket.index, set())
        waiting.add(id(param))
        if len(waiting) == len(bucket.params):
            self._send(bucket, spec, process_set)

    def finish(self, spec: ReduceSpec, process_set: ProcessSet) -> None:
        """Send every bucket not sent yet (in the same order on every rank), land every reduce-scatter, and give
        each block to the shards."""
        for bucket in self.shards.layout.buckets:
            if bucket.index not in self._sent:
                self._send(bucket, spec, process_set)
        self._land(finished_only=False)
        self.reset()

    def _send(self, bucket: Bucket, spec: ReduceSpec, process_set: ProcessSet) -> None:
        params = [self.params[i] for i in bucket.params]
        # A bucket of one parameter (a large layer) sends its gradient as it is: no copy.
        flat = _grad(params[0]).reshape(-1) if len(params) == 1 else torch.cat([_grad(p).reshape(-1) for p in params])
        for param in params:  # what stage 2 saves: no rank keeps the whole gradient
            param.grad = None
        wire, context = self.compressor.compress(flat)
        name = f"{self.shards.name}.grads.{bucket.index}"
        handle = functions.reducescatter_async(wire, name, spec.op, process_set, spec.prescale, spec.postscale)
        self._waiting.pop(bucket.index, None)
        self._sent.add(bucket.index)
        self._in_flight.append(_Sent(bucket, handle, context))
        self._land(finished_only=True)

    def _land(self, finished_only: bool) -> None:
        """Hand the reduce-scatters that came back (``finished_only``), or all of them, to the shards, in order:
        each one's gradient bytes are freed as soon as it lands, not all at the end of backward."""
        while self._in_flight and (not finished_only or handles.poll(self._in_flight[0].handle)):
            sent = self._in_flight.pop(0)
            block = handles.synchronize(sent.handle)
            self.shards.take_block(sent.bucket, self.compressor.decompress(block, sent.context))

    def reset(self, discard: bool = False) -> None:
        """Forget this step (``discard``: it never finished, so drop the reduce-scatters in flight)."""
        if discard:
            for sent in self._in_flight:
                handles.discard(sent.handle)
        self._in_flight.clear()
        self._waiting.clear()
        self._sent.clear()


def _grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient to send: the parameter's own, or zeros where it has none this step."""
    return param.grad if param.grad is not None else torch.zeros_like(param)


__all__ = ["ScatteredGradients"]
