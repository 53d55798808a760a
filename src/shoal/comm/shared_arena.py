"""Buffers that every rank of a host maps: gradients that live in shared memory (CPU tensors).

Each local rank owns one segment, its *arena*, and maps every peer's arena too. The optimizer makes its parameters'
``.grad`` tensors views of its own arena, so autograd accumulates straight into shared memory. An allreduce of a
range of the arena then needs no copy in and no copy out: local rank r reads slice r of the range from every
rank's arena, reduces it into its own arena, and writes the result into every peer's arena. Per gradient byte and
per rank that is one byte read and one byte written whatever the number of local ranks, against about four and a
half through the engine's segment (copy in, reduce, copy out).

Two barriers of the host's ``SharedMemoryGroup`` frame each reduction: the first says every rank's gradients in the
range are final (every rank's engine reached the same agreed collective), the second that every peer has finished
writing into this rank's arena, which is then the user's again.

Segments are named like the engine's (``/dev/shm/shoal-<job token>-<host>-<8 hex digits>``), checked the same way
when a peer's path is mapped, and unlinked once every local rank has mapped them; shoalrun removes any left by a
crash during set-up.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Callable

import torch

from shoal.comm.names import SEGMENT_PREFIX, SHM_DIR
from shoal.comm.reductions import REDUCE_INTO
from shoal.comm.shm import SharedMemoryError, SharedMemoryGroup, check_segment_file, check_segment_path

ALIGNMENT = 64
"""Every range starts on its own cache line, so two ranks never write the same line of one arena."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of cache lines."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def create_segment(token: str, host: str, nbytes: int) -> str:
    """Create this rank's arena file of ``nbytes`` (allocated now: ENOSPC here, not SIGBUS later); its path.

    Raises:
        OSError: /dev/shm cannot hold it.
    """
    path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{token}-{host}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    return path


def unlink(path: str) -> None:
    """Remove a segment's name (mappings stay valid); a missing name is not an error."""
    try:
        os.unlink(path)
    except OSError:
        pass


class SharedArena:
    """This rank's arena and its host's peers' arenas, mapped: ``views[r]`` is local rank r's, as bytes."""

    def __init__(self, paths: list[str], local_rank: int, nbytes: int, token: str, host: str) -> None:
        """Map every local rank's arena (``paths`` by local rank, this rank's own included).

        Raises:
            SharedMemoryError: a path is not one of this job's segments, or not a file of this user of ``nbytes``.
            OSError: a segment cannot be opened or mapped.
        """
        self.local_rank = local_rank
        self.local_size = len(paths)
        self.nbytes = nbytes
        self._maps: list[mmap.mmap] = []
        try:
            for rank, path in enumerate(paths):
                if rank != local_rank:
                    check_segment_path(path, token, host)
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                try:
                    check_segment_file(path, os.fstat(fd), nbytes)
                    self._maps.append(mmap.mmap(fd, nbytes))
                finally:
                    os.close(fd)
        except (SharedMemoryError, OSError):
            self.close()
            raise
        self.views = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]

    def own(self) -> torch.Tensor:
        """This rank's arena, as bytes."""
        return self.views[self.local_rank]

    def allreduce_range_(
        self,
        group: SharedMemoryGroup,
        offset: int,
        dtype: torch.dtype,
        count: int,
        reduction: str,
        between_hosts: Callable[[torch.Tensor], None] | None = None,
        finish: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Reduce ``count`` elements of ``dtype`` at byte ``offset`` of every local rank's arena, in place in all.

        Every local rank calls it with the same range (an agreed collective). ``between_hosts`` and ``finish`` act on
        this rank's reduced slice before it is written back, as in ``SharedMemoryGroup.allreduce_``.
        """
        if group.local_size != self.local_size or group.local_rank != self.local_rank:
            raise SharedMemoryError("the arena and the shared-memory group disagree on the local ranks")
        size = count * dtype.itemsize
        if offset < 0 or offset % dtype.itemsize or offset + size > self.nbytes:
            raise SharedMemoryError(f"range [{offset}, {offset + size}) is not within the {self.nbytes}-byte arena")
        typed = [view[offset : offset + size].view(dtype) for view in self.views]
        group.barrier()  # every rank's gradients in the range are final
        start, stop = group.slices(count)[self.local_rank]
        if stop > start:
            mine = typed[self.local_rank][start:stop]
            reduce_into = REDUCE_INTO[reduction]
            for rank in range(self.local_size):
                if rank != self.local_rank:
                    reduce_into(mine, typed[rank][start:stop])
            if between_hosts is not None:
                between_hosts(mine)
            if finish is not None:
                finish(mine)
            for rank in range(self.local_size):
                if rank != self.local_rank:
                    typed[rank][start:stop].copy_(mine)
        group.barrier()  # every peer finished writing into this rank's arena

    def close(self) -> None:
        """Drop this arena's mappings; each is unmapped once no tensor views it any more.

        Never ``mmap.close()``: a tensor from ``torch.frombuffer`` keeps its mmap object alive but holds no buffer
        export, so an explicit close would succeed and leave every gradient still viewing the arena pointing at
        unmapped memory (a segfault on the next touch, by the user or by an engine thread still in a cycle).
        """
        self.views = []
        self._maps = []
