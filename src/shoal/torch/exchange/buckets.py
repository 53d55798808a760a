"""The gradients on their way: the open bucket, the user's groups, and the reductions in flight.

A final gradient joins the open bucket; a full bucket leaves at once as one asynchronous in-place allreduce
(wait-free backprop, Poseidon), unless overlap does not pay here (``overlaps_backward``), where the bucket holds every
gradient until the step's end. A gradient of one of the user's ``groups`` waits for the rest of its group, which then
leaves whole. ``wait()`` lands every reduction in flight, each decompressed into its parameter's gradient.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import ReduceOp, ReduceSpec
from shoal.plan.schemes import fill_bucket
from shoal.torch import functions
from shoal.torch.compression import Compression, Compressor
from shoal.torch.exchange.marks import ComputeMarks
from shoal.torch.layer_comm.schemes import gradient_request_name


def overlaps_backward(device: torch.device) -> bool:
    """Whether gradients on ``device`` start their allreduce as soon as they are final (wait-free backprop), or
    all together when backward is over (the ``overlap_backward`` setting; see its help).

    Unset, overlap is off only where it cannot pay: CPU gradients reduced through shared memory on one host (no
    wire to wait on: the reduction keeps a core busy all the while) whose cores the ranks' compute threads already
    fill. There the reduction takes its core from backprop instead of running beside it, and starting it early only
    adds cycles and cache traffic to backward.
    """
    engine = handles.engine()
    wanted = engine.config.overlap_backward
    if wanted is not None:
        return bool(wanted)
    hierarchical = engine.hierarchical
    if device.type != "cpu" or hierarchical is None or hierarchical.cross_size > 1:
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return hierarchical.local.local_size * torch.get_num_threads() < cores


class InFlight(NamedTuple):
    """One reduction on its way: the engine's handle, its parameters, their compressors, what was sent for each
    (compressed) and the compressors' contexts to decompress it."""

    handle: int
    params: list[torch.Tensor]
    compressors: list[type[Compressor]]
    sent: list[torch.Tensor]
    contexts: list[Any]


class Buckets:
    """The open bucket, the user's groups and the reductions in flight of one optimizer's dense gradients.

    ``names``: each parameter's name, by id; ``compressor(param)`` is each gradient's compressor (its layer
    scheme's, else the optimizer's); ``marks`` gets the CAST spans around compression.
    """

    __slots__ = (
        "_group_of",
        "_group_ready",
        "_in_flight",
        "_open",
        "_open_bytes",
        "_overlap",
        "bucket_bytes",
        "compressor",
        "groups",
        "marks",
        "names",
        "spec",
    )

    def __init__(
        self,
        names: dict[int, str],
        spec: ReduceSpec,
        groups: list[list[torch.Tensor]],
        bucket_bytes: int,
        compressor: Callable[[torch.Tensor], type[Compressor]],
        marks: ComputeMarks,
    ) -> None:
        self.names = names
        self.spec = spec
        self.groups = groups
        """The user's groups (``groups=``): each leaves as one reduction once all its gradients are final."""
        self.bucket_bytes = bucket_bytes
        """The optimizer's bucket size (autotune's choice wins while it runs, or once frozen)."""
        self.compressor = compressor
        self.marks = marks
        self._group_of = {id(p): index for index, group in enumerate(groups) for p in group}
        self._group_ready: dict[int, set[int]] = {}
        self._open: list[torch.Tensor] = []
        self._open_bytes = 0
        self._in_flight: list[InFlight] = []
        self._overlap: tuple[Any, str, bool] | None = None
        """The session and device type last decided for, and whether full buckets leave during backward."""

    def grouped(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is in one of the user's groups."""
        return id(param) in self._group_of

    @property
    def holding(self) -> bool:
        """Gradients wait in the open bucket."""
        return bool(self._open)

    def add(self, param: torch.Tensor) -> list[torch.Tensor]:
        """``param``'s gradient is final: what leaves now because of it (its whole group, or the bucket it filled
        where full buckets leave during backward; else nothing)."""
        group = self._group_of.get(id(param))
        if group is not None:
            ready = self._group_ready.setdefault(group, set())
            ready.add(id(param))
            if len(ready) < len(self.groups[group]):
                return []
            del self._group_ready[group]
            return self.groups[group]
        self._open.append(param)
        tuned = handles.engine().tuned.bucket_bytes
        limit = self.bucket_bytes if tuned is None else tuned
        self._open_bytes, full = fill_bucket(self._open_bytes, param.numel() * param.element_size(), limit)
        return self.take_open() if full and self._overlapping(param) else []

    @property
    def overlap(self) -> bool | None:
        """Whether full buckets leave during backward, as last decided (None before the first full bucket)."""
        return None if self._overlap is None else self._overlap[2]

    def take_open(self) -> list[torch.Tensor]:
        """Empty the open bucket: its parameters, to send."""
        taken, self._open, self._open_bytes = self._open, [], 0
        return taken

    def _overlapping(self, param: torch.Tensor) -> bool:
        """Whether full buckets leave now (``overlaps_backward``); else the bucket holds every gradient until the
        step's end. Decided once per session and device type."""
        current, device = handles.current_session(), param.device.type
        decided = self._overlap
        if decided is None or decided[0] is not current or decided[1] != device:
            decided = self._overlap = (current, device, overlaps_backward(param.device))
        return decided[2]

    def send(self, params: list[torch.Tensor], op: ReduceOp, process_set: ProcessSet, driven: bool = False) -> None:
        """Start reducing these parameters' dense gradients together, each under its parameter's name (``driven``:
        the caller synchronizes next)."""
        compressors = [self.compressor(p) for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        assert len(grads) == len(params), "every gradient sent is stood in for first (SparseGradients.grad)"
        with self._cast_span(compressors):
            packed = [c.compress(g) for c, g in zip(compressors, grads, strict=True)]
        names = [gradient_request_name(self.names[id(p)]) for p in params]
        sent = [c for c, _ in packed]
        handle = functions.allreduce_named_async_(sent, names, op, self.spec.prescale, self.spec.postscale, process_set, driven)
        self._in_flight.append(InFlight(handle, params, compressors, sent, [ctx for _, ctx in packed]))

    def wait(self) -> None:
        """Land every reduction in flight: each parameter's gradient holds its reduced (decompressed) value."""
        for entry in self._in_flight:
            handles.synchronize(entry.handle)
            with self._cast_span(entry.compressors):
                for param, compressor, sent, ctx in zip(
                    entry.params, entry.compressors, entry.sent, entry.contexts, strict=True
                ):
                    if sent is not param.grad:
                        assert param.grad is not None
                        param.grad.copy_(compressor.decompress(sent, ctx))

    def reset(self, discard: bool = False) -> None:
        """Forget this step (``discard``: it never finished, so drop the reductions in flight)."""
        if discard:
            for entry in self._in_flight:
                handles.discard(entry.handle)
        self._in_flight.clear()
        self._group_ready.clear()
        self.take_open()

    def _cast_span(self, compressors: list[type[Compressor]]) -> contextlib.AbstractContextManager[None]:
        """A CAST span on the timeline's compute row around casts (nothing to mark without one)."""
        if all(c is Compression.none for c in compressors):
            return contextlib.nullcontext()
        return self.marks.span("CAST")
