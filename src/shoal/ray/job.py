"""What a Shoal job on Ray needs besides Ray: the authenticated store hosted by the driver, and each rank's
environment (the same variables shoalrun gives its workers), from the node each rank runs on."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from shoal.comm.shm import job_token, remove_job_segments
from shoal.comm.store import host_store
from shoal.config import LaunchConfig
from shoal.config.worker import JobAddress, SlotInfo
from shoal.runner.hosts import place_ranks
from shoal.runner.worker_env import worker_env


def import_ray() -> Any:
    """Ray, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError("shoal.ray needs Ray: pip install 'shoal[ray]'") from error
    return ray


def rank_order(nodes: list[str]) -> list[int]:
    """Worker indices in rank order: workers grouped by node (nodes in order of first appearance), so that each node
    holds consecutive ranks, as shoalrun places them. ``nodes[i]`` is worker i's node."""
    first_seen = {node: index for index, node in reversed(list(enumerate(nodes)))}
    return sorted(range(len(nodes)), key=lambda index: (first_seen[nodes[index]], index))


class RayJobStore:
    """The job's rendezvous store, hosted in this process (the Ray driver, or Ray Train's controller), and the
    environment of every rank. ``close()`` stops the store and removes this node's leftover shared memory."""

    def __init__(self, address: str, timeout_s: float) -> None:
        """Start the store on ``address`` (a free port), for a job whose ranks wait up to ``timeout_s`` at start."""
        self.secret = secrets.token_hex(16)
        self.timeout_s = timeout_s
        self.address = address
        self._store: Any = host_store(address, 0, self.secret, timeout_s)
        assert self._store.server is not None  # this process hosts it
        self.port = int(self._store.server.port)

    def rank_envs(self, nodes_in_rank_order: list[str], extra: Mapping[str, str] | None = None) -> list[dict[str, str]]:
        """Every rank's environment when rank r runs on ``nodes_in_rank_order[r]``."""
        slots: list[SlotInfo] = place_ranks(nodes_in_rank_order)
        address = JobAddress(self.address, self.port, self.secret)
        settings = {**LaunchConfig(start_timeout=self.timeout_s).worker_env(), "PYTHONUNBUFFERED": "1"}
        return [worker_env(address, settings, slot, extra) for slot in slots]

    def close(self) -> None:
        """Stop the store (idempotent) and unlink shared memory a worker on this node left behind."""
        if self._store is not None:
            self._store.close()
            self._store = None
            remove_job_segments(job_token(self.secret))
