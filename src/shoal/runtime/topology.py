"""Where every rank lives: local and cross ranks, derived from the host of every rank.

Horovod's definitions are kept: ``local_rank``/``local_size`` count the ranks on this host; the "cross"
communicator joins the ranks that share a ``local_rank`` (one per host), so ``cross_rank`` is this host's index
among the hosts that have a rank at this ``local_rank`` and ``cross_size`` is how many such hosts there are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """This rank's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    """True when every host runs the same number of ranks."""
    host_of_rank: tuple[str, ...]
    """Host key of every rank, indexed by rank."""
    local_rank_of_rank: tuple[int, ...]
    """Local rank of every rank, indexed by rank."""

    def local_peers(self) -> list[int]:
        """Global ranks on this rank's host, ordered by local rank."""
        host = self.host_of_rank[self.rank]
        peers = [r for r in range(self.size) if self.host_of_rank[r] == host]
        return sorted(peers, key=lambda r: self.local_rank_of_rank[r])

    def cross_peers(self) -> list[int]:
        """Global ranks that share this rank's local rank, one per host, ordered by cross rank."""
        mine = self.local_rank_of_rank[self.rank]
        return [r for r in range(self.size) if self.local_rank_of_rank[r] == mine]


def build_topology(rank: int, hosts: Sequence[str], local_rank_hints: Sequence[int | None]) -> Topology:
    """Build the topology from every rank's host key and the local rank its launcher gave (or None).

    Args:
        rank: this process's global rank.
        hosts: the host key of every rank, indexed by rank.
        local_rank_hints: each rank's launcher-given local rank, or None where the launcher gave none.

    Returns:
        The Topology of ``rank``.

    Raises:
        ValueError: when the launcher-given local ranks on a host are not exactly 0..n-1.
    """
    size = len(hosts)
    host_order: list[str] = []
    for host in hosts:
        if host not in host_order:
            host_order.append(host)
    local_of = [0] * size
    for host in host_order:
        members = [r for r in range(size) if hosts[r] == host]
        hints = [local_rank_hints[r] for r in members]
        if all(h is not None for h in hints):
            if sorted(hints) != list(range(len(members))):  # type: ignore[type-var]
                raise ValueError(f"launcher gave local ranks {hints} on host {host!r}; expected 0..{len(members) - 1}")
            for r, h in zip(members, hints, strict=True):
                local_of[r] = int(h)  # type: ignore[arg-type]
        else:
            for index, r in enumerate(members):
                local_of[r] = index
    my_host = hosts[rank]
    local_size = sum(1 for h in hosts if h == my_host)
    cross_members = [r for r in range(size) if local_of[r] == local_of[rank]]
    host_sizes = {host: sum(1 for h in hosts if h == host) for host in host_order}
    return Topology(
        rank=rank,
        size=size,
        local_rank=local_of[rank],
        local_size=local_size,
        cross_rank=cross_members.index(rank),
        cross_size=len(cross_members),
        is_homogeneous=len(set(host_sizes.values())) == 1,
        host_of_rank=tuple(hosts),
        local_rank_of_rank=tuple(local_of),
    )
