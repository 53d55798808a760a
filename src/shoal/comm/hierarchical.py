"""Hierarchical allreduce: shared memory inside each host, torch.distributed between hosts.

Each host reduce-scatters through shared memory; every local rank then allreduces its reduced slice with the
ranks of the same local rank on the other hosts (over gloo or NCCL); the host then allgathers through shared
memory. Bytes between hosts drop by the number of ranks per host, and no byte crosses loopback TCP. With one host
it is pure shared memory; with one rank per host there is nothing to share and plain torch.distributed is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.comm import collectives
from shoal.comm.shared_arena import SharedArena
from shoal.comm.shm import SharedMemoryGroup


class HierarchicalAllreduce:
    """Allreduce over the whole world through one host-local shared-memory group and one cross-host group."""

    def __init__(self, local: SharedMemoryGroup, cross_group: Any, cross_size: int) -> None:
        self.local = local
        self.cross_group = cross_group
        self.cross_size = cross_size

    def allreduce_(self, tensor: torch.Tensor, reduction: str, finish: Callable[[torch.Tensor], None] | None = None) -> None:
        """Reduce a contiguous CPU tensor in place across every rank (sum, product, min, max or band); ``finish``
        runs on each rank's reduced slice before it is shared back (see ``SharedMemoryGroup.allreduce_``)."""
        self.local.allreduce_(tensor, reduction, self._between_hosts(reduction), finish)

    def allreduce_arena_(
        self,
        arena: SharedArena,
        offset: int,
        dtype: torch.dtype,
        count: int,
        reduction: str,
        finish: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Reduce a range of every local rank's arena in place across every rank (``SharedArena.allreduce_range_``)."""
        arena.allreduce_range_(self.local, offset, dtype, count, reduction, self._between_hosts(reduction), finish)

    def _between_hosts(self, reduction: str) -> Callable[[torch.Tensor], None] | None:
        """The step that reduces a rank's slice with the same local rank on the other hosts (None with one host)."""
        if self.cross_size == 1:
            return None

        def between_hosts(mine: torch.Tensor) -> None:
            if reduction == "band":
                collectives.bitwise_and_(mine, self.cross_group)
            else:
                collectives.allreduce_(mine, reduction, self.cross_group)

        return between_hosts

    def close(self) -> None:
        """Release the shared-memory segment."""
        self.local.close()


def build_cross_groups(
    local_rank_of_rank: tuple[int, ...],
    local_size: int,
    timeout_s: float | None = None,
    connect_timeout_s: float | None = None,
) -> list[Any]:
    """One group per local rank index, joining that local rank of every host; every world rank must call this."""
    return [
        collectives.new_group([r for r, local in enumerate(local_rank_of_rank) if local == index], timeout_s, connect_timeout_s)
        for index in range(local_size)
    ]
