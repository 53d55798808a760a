"""Gradients that live in shared memory: ``DistributedOptimizer``'s CPU gradients as views of this rank's arena.

When the host's ranks reduce through shared memory, the optimizer adopts an arena (``shoal.comm.shared_arena``) at
the end of a session's second step, if that step accumulated every gradient where the first step left it (the
user zeroes gradients with ``zero_grad(set_to_none=False)``). It lays the gradients out in the arena in the order
they became final, cuts the layout into fixed buckets (contiguous ranges of one dtype, up to the bucket size), and
makes each ``.grad`` a view of its place. Autograd then accumulates straight into shared memory, and as soon as a
bucket's gradients are all final one allreduce of its range runs where it lies: each local rank reduces its slice
of every rank's range and writes the result into all of them. No fusion buffer, no copy in, no copy out.

With ``zero_grad(set_to_none=True)`` (torch's default) autograd makes a new gradient every step; putting it into
the arena would cost a copy per step, more than reducing in place saves (measured: docs/benchmarks.md), so such an
optimizer keeps the ordinary path. A gradient that is nevertheless not its view when it becomes final (the user
switched to ``set_to_none=True`` later, or assigned ``.grad``) is copied into its place and ``.grad`` becomes the
view again, as DDP's ``gradient_as_bucket_view`` does. Every rank must agree on the layout, the setting and the
segments (three small allgathers, once per session); if any disagrees or cannot map them, every rank keeps the
ordinary path, which is right for any tensor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from shoal.comm.shared_arena import SharedArena, aligned, create_segment, unlink
from shoal.comm.shm import SharedMemoryError
from shoal.core import requests
from shoal.core import session as handles
from shoal.core.objects import allgather_json
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import Kind, ReduceSpec
from shoal.engine.engine import ArenaSite
from shoal.log import get_logger

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def eligible(param: torch.Tensor) -> bool:
    """A parameter whose gradient can live in the arena: a dense, contiguous CPU tensor of a float dtype."""
    grad = param.grad
    return (
        param.device.type == "cpu"
        and param.dtype in _DTYPES
        and param.is_contiguous()
        and not param.is_sparse
        and (grad is None or not grad.is_sparse)
    )


@dataclass
class _Bucket:
    """A contiguous range of the arena, reduced as one allreduce once all of its gradients are final."""

    name: str
    params: list[torch.Tensor]
    offset: int
    """Bytes from the arena's start."""
    dtype: torch.dtype
    count: int
    """Elements."""


def layout(params: list[torch.Tensor], bucket_bytes: int, key: str) -> tuple[list[_Bucket], int]:
    """Cut ``params`` (in order) into buckets of one dtype and up to ``bucket_bytes`` (a larger tensor alone); each
    bucket starts on a cache line. Returns the buckets and the arena's size in bytes."""
    buckets: list[_Bucket] = []
    end = 0
    for param in params:
        size = param.numel() * param.element_size()
        last = buckets[-1] if buckets else None
        if last is None or last.dtype != param.dtype or (last.count * last.dtype.itemsize + size > bucket_bytes):
            last = _Bucket(f"shoal.shared_gradients.{key}.{len(buckets)}", [], aligned(end), param.dtype, 0)
            buckets.append(last)
        last.params.append(param)
        last.count += param.numel()
        end = last.offset + last.count * last.dtype.itemsize
    return buckets, aligned(max(end, 1))


class SharedGradients:
    """One optimizer's gradients in this rank's arena: which bucket each is in, its view, and the step's reductions."""

    __slots__ = ("_bucket_of", "_handles", "_ready", "_submitted", "_views", "arena", "buckets", "call", "key", "session")

    def __init__(self, key: str, arena: SharedArena, buckets: list[_Bucket], call: requests.Call, session: Any) -> None:
        self.key = key
        self.arena = arena
        self.buckets = buckets
        self.call = call
        self.session = session
        """The session whose engine knows the arena; in any other, these views are ordinary tensors."""
        own = arena.own()
        self._views: dict[int, torch.Tensor] = {}
        self._bucket_of: dict[int, int] = {}
        for index, bucket in enumerate(buckets):
            offset = bucket.offset
            for param in bucket.params:
                size = param.numel() * param.element_size()
                self._views[id(param)] = own[offset : offset + size].view(param.dtype).view(param.shape)
                self._bucket_of[id(param)] = index
                offset += size
        self._ready: list[int] = [0] * len(buckets)
        self._submitted: set[int] = set()
        self._handles: list[int] = []

    def current(self) -> bool:
        """The arena is registered with the running engine (no re-init since it was adopted)."""
        return handles.current_session() is self.session

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._bucket_of

    @property
    def pending(self) -> bool:
        return bool(self._handles) or any(self._ready)

    def place(self, param: torch.Tensor) -> None:
        """Make ``param.grad`` its view: copy a gradient that lives elsewhere in; zeros where there is none (as
        Horovod reduces zeros for a parameter without a gradient)."""
        view = self._views[id(param)]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr() and grad.stride() == view.stride() and grad.dtype == view.dtype:
            return
        else:
            view.copy_(grad)
        param.grad = view

    def ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is final: place it; once its bucket is complete, start reducing the bucket."""
        self.place(param)
        index = self._bucket_of[id(param)]
        self._ready[index] += 1
        if self._ready[index] == len(self.buckets[index].params):
            self._submit(index)

    def submit_rest(self) -> None:
        """At the end of a step: place every gradient of the buckets not yet started, and start them."""
        for index, bucket in enumerate(self.buckets):
            if index not in self._submitted:
                for param in bucket.params:
                    self.place(param)
                self._submit(index)

    def _submit(self, index: int) -> None:
        bucket = self.buckets[index]
        size = bucket.count * bucket.dtype.itemsize
        tensor = self.arena.own()[bucket.offset : bucket.offset + size].view(bucket.dtype)
        shared = [(self.key, bucket.offset)]
        self._handles.append(requests.submit(self.call, [tensor], names=[bucket.name], shared=shared))
        self._submitted.add(index)

    def wait(self) -> None:
        """Wait for this step's reductions: every gradient is then reduced, in place."""
        try:
            for handle in self._handles:
                handles.synchronize(handle)
        finally:
            self.reset()

    def reset(self, discard: bool = False) -> None:
        """Forget the step (``discard``: drop the reductions in flight too)."""
        if discard:
            for handle in self._handles:
                handles.discard(handle)
        self._handles = []
        self._submitted = set()
        self._ready = [0] * len(self.buckets)


def adopt(
    params: list[torch.Tensor],
    names: dict[int, str],
    spec: ReduceSpec,
    process_set: ProcessSet,
    bucket_bytes: int,
    refusal: str | None,
) -> SharedGradients | None:
    """Every rank of the optimizer's (global) process set calls this together after a step; the gradients of
    ``params`` (in the order they became final) move into a new arena, or None on every rank.

    ``refusal`` is this rank's reason not to (the setting is off, an option the path does not serve), or None.
    """
    engine = handles.engine()
    site = engine.transport.arena_site()
    if site is None:
        return None
    key = f"g{handles.session().next_number('shared_gradients', 0)}"
    base = f"shoal.shared_gradients.{key}"
    buckets, nbytes = layout(params, bucket_bytes, key)
    description = [[names[id(p)], str(p.dtype), p.numel()] for p in params] + [bucket_bytes]
    offer = {
        "refusal": refusal or ("" if params else "no gradient qualifies"),
        "digest": hashlib.sha256(json.dumps(description).encode()).hexdigest(),
    }
    offers = allgather_json(offer, f"{base}.offer")
    if any(other["refusal"] for other in offers):
        return None
    if len({other["digest"] for other in offers}) > 1:
        _warn(engine.rank, "the ranks' gradients differ (parameters, dtypes, or the order backward finished them)")
        return None
    arena, failure = map_arenas(site, nbytes, base)
    if arena is None:
        _warn(engine.rank, failure)
        return None
    engine.transport.register_arena(key, arena)
    call = requests.Call(Kind.ALLREDUCE, process_set, spec, in_place=True)
    shared = SharedGradients(key, arena, buckets, call, handles.session())
    for param in params:
        shared.place(param)
    return shared


def map_arenas(site: ArenaSite, nbytes: int, base: str) -> tuple[SharedArena | None, str]:
    """Create this rank's segment, learn the host's peers' (an allgather), map them all, and agree that every rank
    did (a second allgather). Returns the arena, or None and the first failure, on every rank alike. Every rank
    calls it together; ``base`` names its collectives."""
    path, made = "", {"host": site.host, "local_rank": site.local_rank, "error": ""}
    try:
        path = create_segment(site.token, site.host, nbytes)
    except OSError as error:
        made["error"] = f"cannot create a {nbytes / 2**20:.1f} MiB segment in /dev/shm ({error})"
    made["path"] = path
    everyone = allgather_json(made, f"{base}.paths")
    arena, outcome = None, ""
    failures = [entry["error"] for entry in everyone if entry["error"]]
    if not failures:
        peers = sorted((entry for entry in everyone if entry["host"] == site.host), key=lambda entry: entry["local_rank"])
        try:
            if len(peers) != site.local_size:
                raise SharedMemoryError(f"{len(peers)} ranks offered arenas on this host, not {site.local_size}")
            arena = SharedArena([entry["path"] for entry in peers], site.local_rank, nbytes, site.token, site.host)
        except (SharedMemoryError, OSError) as error:
            outcome = str(error)
    failures += [other for other in allgather_json(outcome, f"{base}.mapped") if other]
    if path:
        unlink(path)  # every local rank has mapped it, or gave up: the name is no longer needed
    if failures and arena is not None:
        arena.close()
        arena = None
    return arena, failures[0] if failures else ""


def _warn(rank: int, reason: str) -> None:
    if rank == 0:
        get_logger().warning("shared-memory gradients are off, gradients are copied to be reduced: %s", reason)
