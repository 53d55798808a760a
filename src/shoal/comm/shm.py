"""Shared-memory collectives for the ranks of one host (CPU tensors).

One POSIX shared-memory segment per host, mapped by every local rank as a torch tensor, holds a control line per
rank (a sequence number and a pid) and a data slot per rank. An allreduce copies each rank's chunk into its slot,
then every rank reduces its own slice of the chunk across all slots (a reduce-scatter, so the arithmetic is
spread over all ranks), then every rank copies the whole reduced chunk out (an allgather). Ranks synchronise
through sequence numbers in the segment: no syscalls on the fast path. Torch ops do the arithmetic.

The segment's name is unlinked as soon as every local rank has mapped it, so a crash (even SIGKILL) never leaves
it behind; shoalrun also removes ``/dev/shm/shoal-<job>-*`` when the job ends, which covers a crash during set-up.

Synchronisation relies on x86-64's total store order (stores are seen in program order); on other architectures
the segment is not used and collectives fall back to gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import secrets
import stat
import time
from collections.abc import Callable
from typing import Any

import torch

from shoal.comm.names import SEGMENT_PREFIX, SHM_DIR, host_tag
from shoal.comm.names import job_token as job_token  # re-exported: shm is where the segments are made
from shoal.comm.names import remove_job_segments as remove_job_segments
from shoal.comm.reductions import REDUCE_INTO, REDUCE_OUT
from shoal.comm.shm_control import ControlLines, SharedMemoryError
from shoal.log import get_logger

_SHM_DIR = SHM_DIR
_HEADER_BYTES = 4096
DEFAULT_SLOT_BYTES = 4 * 1024 * 1024

_LARGE_CHUNK_ELEMENTS = 64 * 1024
"""From this many elements per chunk on, copies dominate and the copy-saving allreduce variant is used."""


def check_segment_file(path: str, info: os.stat_result, size: int) -> None:
    """Refuse a segment that is not a regular file of this user's, of exactly the size the job's settings give."""
    if not stat.S_ISREG(info.st_mode):
        raise SharedMemoryError(f"segment {path} is not a regular file")
    if info.st_uid != os.geteuid():
        raise SharedMemoryError(f"segment {path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})")
    if info.st_size != size:
        raise SharedMemoryError(f"segment {path} holds {info.st_size} bytes where this job's settings give {size}")


def check_segment_path(path: str, token: str, host: str) -> str:
    """The segment path read from the store, if it is one this job's local rank 0 could have created; else raise.

    Only ``/dev/shm/shoal-<job token>-<host>-<8 hex digits>`` is accepted: no other directory, no ``..``.
    """
    name = os.path.basename(path)
    if os.path.dirname(path) != _SHM_DIR or not re.fullmatch(rf"{SEGMENT_PREFIX}{re.escape(token)}-{host}-[0-9a-f]{{8}}", name):
        raise SharedMemoryError(f"refusing shared-memory segment path {path!r} from the store: not this job's segment")
    return path


def supported() -> bool:
    """Shared memory is used on Linux x86-64 (total store order) with a /dev/shm."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(_SHM_DIR)


class SharedMemoryGroup:
    """The local ranks of one host, joined by a shared-memory segment. Every member calls every collective."""

    def __init__(self, path: str, local_rank: int, local_size: int, slot_bytes: int, create: bool, timeout_s: float) -> None:
        self.local_rank = local_rank
        self.local_size = local_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        # Two halves: consecutive collective steps alternate between them, so a rank that finished a step may fill
        # the other half for the next one while a slower rank still reads this one; no trailing barrier is needed.
        size = _HEADER_BYTES + 2 * local_size * slot_bytes
        # O_NOFOLLOW: a symlink planted under the segment's name is refused, never followed to another file.
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now, instead of SIGBUS on first touch of a page
            else:
                check_segment_file(path, os.fstat(fd), size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._lines = ControlLines(memoryview(self._map)[:_HEADER_BYTES].cast("q"), local_rank, local_size, timeout_s)
        self._slices_cache: dict[int, list[tuple[int, int]]] = {}
        self._small_cache: dict[
            tuple[torch.dtype, int, int], tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], torch.Tensor]
        ] = {}
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER_BYTES, count=2 * local_size * slot_bytes)
        self._views: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._steps = 0
        self._closed = False

    # ----- synchronisation -----

    def barrier(self) -> None:
        """Wait until every local rank has reached this point; raises if a peer died or the timeout passed."""
        self._lines.barrier()

    # ----- helpers -----

    def next_slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every local rank's whole slot, typed, in the half this collective step uses (halves alternate)."""
        views = self._views.get(dtype)
        if views is None:
            count = self.chunk_elements(dtype)
            itemsize = dtype.itemsize
            views = [
                [
                    self._data[(half * self.local_size + rank) * self.slot_bytes :][: count * itemsize].view(dtype)
                    for rank in range(self.local_size)
                ]
                for half in (0, 1)
            ]
            self._views[dtype] = views
        self._steps += 1
        return views[self._steps % 2]

    def _small_views(
        self, dtype: torch.dtype, count: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], torch.Tensor]:
        """The views one small chunk of ``count`` elements uses, in the half this step uses: this rank's slot
        prefix, its slice of local rank 0's slot (None when its slice is empty) and of every other slot, and local
        rank 0's prefix (the reduced chunk). Kept per size: a repeating collective slices nothing."""
        slots = self.next_slots(dtype)
        key = (dtype, count, self._steps % 2)
        views = self._small_cache.get(key)
        if views is None:
            start, stop = self.slices(count)[self.local_rank]
            result = slots[0][start:stop] if stop > start else None
            others = [slots[rank][start:stop] for rank in range(1, self.local_size)] if stop > start else []
            views = (slots[self.local_rank][:count], result, others, slots[0][:count])
            if len(self._small_cache) < 512:
                self._small_cache[key] = views
        return views

    def chunk_elements(self, dtype: torch.dtype) -> int:
        """How many elements of ``dtype`` one slot holds."""
        return self.slot_bytes // dtype.itemsize

    def slices(self, count: int) -> list[tuple[int, int]]:
        """(start, stop) of every local rank's slice of a chunk of ``count`` elements."""
        bounds = self._slices_cache.get(count)
        if bounds is None:
            base, extra = divmod(count, self.local_size)
            bounds, start = [], 0
            for rank in range(self.local_size):
                stop = start + base + (1 if rank < extra else 0)
                bounds.append((start, stop))
                start = stop
            if len(self._slices_cache) < 256:
                self._slices_cache[count] = bounds
        return bounds

    # ----- collectives -----

    def allreduce_(
        self,
        tensor: torch.Tensor,
        reduction: str,
        between_hosts: Callable[[torch.Tensor], None] | None = None,
        finish: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Reduce a contiguous CPU tensor in place across the local ranks.

        Args:
            tensor: the contiguous CPU tensor, the same shape on every local rank.
            reduction: sum, product, min, max or band.
            between_hosts: when given, called on this rank's reduced slice (a view into shared memory) to reduce
                it with the other hosts before it is shared back: that makes the collective hierarchical.
            finish: when given, called on this rank's fully reduced slice before it is shared back (an
                elementwise step such as Average's scaling: each rank does its slice, 1/local_size of the work).
        """
        flat = tensor.view(-1)
        reduce_into = REDUCE_INTO[reduction]
        step = self.chunk_elements(flat.dtype)
        total = flat.numel()
        for offset in range(0, total, step):
            chunk = flat if total <= step else flat[offset : offset + step]
            count = chunk.numel()
            if count >= _LARGE_CHUNK_ELEMENTS:
                self._allreduce_large_chunk(chunk, self.next_slots(flat.dtype), reduction, between_hosts, finish)
                continue
            mine, result, others, reduced = self._small_views(flat.dtype, count)
            mine.copy_(chunk)
            self.barrier()
            if result is not None:
                # Only this rank touches its slice of any slot, so it accumulates straight into local rank 0's
                # slot: the whole reduced chunk then sits contiguously there and comes out in one copy.
                for other in others:
                    reduce_into(result, other)
                if between_hosts is not None:
                    between_hosts(result)
                if finish is not None:
                    finish(result)
            self.barrier()
            chunk.copy_(reduced)

    def _allreduce_large_chunk(
        self,
        chunk: torch.Tensor,
        slots: list[torch.Tensor],
        reduction: str,
        between_hosts: Callable[[torch.Tensor], None] | None,
        finish: Callable[[torch.Tensor], None] | None,
    ) -> None:
        """The bandwidth-bound variant: about 4 bytes of memory traffic per byte instead of 5.5 (two ranks).

        A rank's own slice never needs to reach shared memory: only the peers' slices are copied in, the reduction
        reads this rank's slice straight from its tensor, and only the peers' results are copied out.
        """
        bounds = self.slices(chunk.numel())
        me = self.local_rank
        for rank, (start, stop) in enumerate(bounds):
            if rank != me and stop > start:
                slots[me][start:stop].copy_(chunk[start:stop])
        self.barrier()
        start, stop = bounds[me]
        if stop > start:
            result = slots[0][start:stop]  # local rank 0's slot collects every reduced slice, as on the small path
            peers = [rank for rank in range(self.local_size) if rank != me]
            reduce_out = REDUCE_OUT[reduction]
            reduce_out(chunk[start:stop], slots[peers[0]][start:stop], result)
            reduce_into = REDUCE_INTO[reduction]
            for rank in peers[1:]:
                reduce_into(result, slots[rank][start:stop])
            if between_hosts is not None:
                between_hosts(result)
            if finish is not None:
                finish(result)
            chunk[start:stop].copy_(result)
        self.barrier()
        for rank, (start, stop) in enumerate(bounds):
            if rank != me and stop > start:
                chunk[start:stop].copy_(slots[0][start:stop])

    def broadcast_(self, tensor: torch.Tensor, root: int) -> None:
        """Copy local rank ``root``'s contiguous CPU tensor into every local rank's tensor."""
        flat = tensor.view(-1)
        step = self.chunk_elements(flat.dtype)
        for offset in range(0, flat.numel(), step):
            chunk = flat[offset : offset + step]
            slot = self.next_slots(flat.dtype)[root][: chunk.numel()]
            if self.local_rank == root:
                slot.copy_(chunk)
            self.barrier()
            if self.local_rank != root:
                chunk.copy_(slot)

    def reduce_(self, tensor: torch.Tensor, reduction: str, root: int) -> None:
        """Reduce into local rank ``root``'s tensor (the others' tensors are left as they were)."""
        flat = tensor.view(-1)
        reduce_into = REDUCE_INTO[reduction]
        step = self.chunk_elements(flat.dtype)
        for offset in range(0, flat.numel(), step):
            chunk = flat[offset : offset + step]
            count = chunk.numel()
            slots = self.next_slots(flat.dtype)
            slots[self.local_rank][:count].copy_(chunk)
            self.barrier()
            bounds = self.slices(count)
            start, stop = bounds[self.local_rank]
            for rank in range(self.local_size):
                if rank != self.local_rank and stop > start:
                    reduce_into(slots[self.local_rank][start:stop], slots[rank][start:stop])
            self.barrier()
            if self.local_rank == root:
                for rank, (start, stop) in enumerate(bounds):
                    if stop > start:
                        chunk[start:stop].copy_(slots[rank][start:stop])

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every local rank's equally shaped contiguous CPU tensor along a new leading dimension."""
        flat = tensor.reshape(-1)
        output = torch.empty((self.local_size, flat.numel()), dtype=flat.dtype)
        step = self.chunk_elements(flat.dtype)
        for offset in range(0, flat.numel(), step):
            count = min(step, flat.numel() - offset)
            slots = self.next_slots(flat.dtype)
            slots[self.local_rank][:count].copy_(flat[offset : offset + count])
            self.barrier()
            for rank in range(self.local_size):
                output[rank, offset : offset + count].copy_(slots[rank][:count])
        return output.view(self.local_size, *tensor.shape)

    def close(self) -> None:
        """Leave the group and unmap the segment (its name was already unlinked).

        Leaving marks this rank's control line, so a peer waiting for it in a collective fails at its next
        liveness check instead of waiting out the timeout while this process lives on.
        """
        if self._closed:
            return
        self._closed = True
        self._data = torch.empty(0, dtype=torch.uint8)
        self._views.clear()
        self._small_cache.clear()
        self._lines.leave()
        # Not self._map.close(): tensors from torch.frombuffer keep the mmap object alive but hold no buffer export,
        # so a close would succeed under a view another thread still uses. The segment is unmapped when the last
        # view and this group are gone.


def create_local_group(
    store: Any,
    local_rank: int,
    local_size: int,
    host_key: str,
    token: str,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
    timeout_s: float = 300.0,
    purpose: str = "engine",
) -> SharedMemoryGroup | None:
    """Set up the host's segment (local rank 0 creates it, the others map it); None when it is unavailable.

    Every local rank must call this. Unavailability (no /dev/shm, too little space, not x86-64) is agreed through
    the store, logged as a warning, and leaves collectives on gloo. ``purpose`` keeps separate segments apart
    (the engine's, a benchmark's).
    """
    host = host_tag(host_key)
    key = f"shm/{purpose}/{host}"
    if local_rank == 0:
        verdict = "unavailable: this platform is not Linux x86-64 with /dev/shm"
        if supported():
            name = f"{SEGMENT_PREFIX}{token}-{host}-{secrets.token_hex(4)}"
            path = os.path.join(_SHM_DIR, name)
            try:
                group = SharedMemoryGroup(path, 0, local_size, slot_bytes, create=True, timeout_s=timeout_s)
                verdict = path
            except OSError as error:
                verdict = f"unavailable: cannot create a {2 * local_size * slot_bytes >> 20} MiB segment in /dev/shm ({error})"
                try:
                    os.unlink(path)
                except OSError:
                    pass
        store.set(key, verdict)
    else:
        verdict = store.get(key).decode()
    if verdict.startswith("unavailable"):
        if local_rank == 0:
            get_logger().warning("shared-memory collectives are off, falling back to gloo: %s", verdict)
        return None
    if local_rank != 0:
        try:
            group = SharedMemoryGroup(
                check_segment_path(verdict, token, host), local_rank, local_size, slot_bytes, create=False, timeout_s=timeout_s
            )
        except (SharedMemoryError, OSError) as error:  # tell the others, so that nobody waits for this rank
            store.set(f"{key}/refused/{local_rank}", str(error))
            raise SharedMemoryError(f"local rank {local_rank} refused the shared-memory segment: {error}") from error
    attached = store.add(f"{key}/attached", 1)
    if attached == local_size:
        os.unlink(verdict)  # everyone has it mapped: the name is no longer needed, and nothing can leak
    _wait_for_attachments(store, key, local_size, timeout_s, group)
    group.barrier()
    return group


def _wait_for_attachments(store: Any, key: str, local_size: int, timeout_s: float, group: SharedMemoryGroup) -> None:
    """Wait until every local rank mapped the segment; raise at once if one refused it."""
    deadline = time.monotonic() + timeout_s
    refused_keys = [f"{key}/refused/{rank}" for rank in range(1, local_size)]
    while store.add(f"{key}/attached", 0) < local_size:
        refused = [k for k in refused_keys if store.check([k])]
        if refused or time.monotonic() > deadline:
            group.close()
            reason = store.get(refused[0]).decode() if refused else f"not every local rank attached in {timeout_s:.0f} s"
            raise SharedMemoryError(f"shared-memory set-up failed: {reason}")
        time.sleep(0.005)
