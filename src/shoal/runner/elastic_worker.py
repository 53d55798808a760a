"""A worker of an elastic job, where it stands in the job (``WorkerState``), and starting workers on free slots
(``WorkerStarter``)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.runner.hosts import SlotInfo
from shoal.runtime.elastic_rendezvous import ELASTIC_ID_ENV

if TYPE_CHECKING:
    from shoal.runner.cooldown import HostCooldown
    from shoal.runner.discovery import HostDiscovery
    from shoal.runner.launcher import Job
    from shoal.runner.spawners import Worker


class WorkerState(str, enum.Enum):
    """Where a worker stands in the elastic job."""

    STARTING = "starting"
    """A newcomer, not admitted to a round yet."""
    MEMBER = "member"
    REMOVED = "removed"
    """Told to leave (its host left discovery, or it got notice); it exits at its next commit."""
    FINISHED = "finished"
    FAILED = "failed"
    LEFT = "left"
    """Exited 0 without finishing training (removed, or given notice)."""


@dataclass
class ElasticWorker:
    """A worker process and where it stands in the elastic job."""

    worker_id: str
    hostname: str
    process: Worker
    rank: int | None = None
    """Its rank in the newest round it belongs to; None for a newcomer not admitted yet."""
    state: WorkerState = WorkerState.STARTING
    joined: bool = False
    """True once it arrived in a round that formed: it holds the training state (a newcomer only after a sync)."""
    leaving: str | None = None
    """The signal that gave it a preemption notice: it leaves at its next commit and is in no later round."""


def alive(workers: list[ElasticWorker], *states: WorkerState) -> list[ElasticWorker]:
    """The ``workers`` in one of ``states`` whose process still runs."""
    return [w for w in workers if w.state in states and w.process.returncode is None]


class WorkerStarter:
    """Every worker an elastic job started (``workers``, in order), and starting more on the free slots of the hosts
    ``discovery`` offers, except those cooling down after a failure (``cooldown``)."""

    def __init__(self, discovery: HostDiscovery, cooldown: HostCooldown, verbose: Callable[[str], None]) -> None:
        self.workers: list[ElasticWorker] = []
        self._discovery = discovery
        self._cooldown = cooldown
        self._verbose = verbose
        self._spawned = 0

    def start(self, job: Job, hostname: str) -> None:
        """Start one worker on ``hostname`` through ``job``'s spawner: a newcomer, ``STARTING``."""
        self._spawned += 1
        worker_id = f"{hostname}#{self._spawned}"
        # The slot's rank only labels the output (the n-th worker started is [n-1], so labels never collide);
        # the real rank comes from each round's assignment.
        label = self._spawned - 1
        slot = SlotInfo(hostname, label, label + 1, 0, 1, 0, 1)
        process = job.spawn(slot, {ELASTIC_ID_ENV: worker_id})  # the elastic timeout comes with the settings
        job.workers.append(process)
        self.workers.append(ElasticWorker(worker_id, hostname, process))
        self._verbose(f"started worker {worker_id}")

    def fill(self, job: Job, limit: int) -> None:
        """Start workers on free slots of the known, non-excluded hosts, up to ``limit`` live workers."""
        live = alive(self.workers, WorkerState.STARTING, WorkerState.MEMBER)
        # A host whose worker got a notice gets none while that worker is still leaving; a host that is going away
        # leaves the discovery output.
        leaving = {w.hostname for w in self.workers if w.leaving is not None and w.process.returncode is None}
        excluded = self._cooldown.excluded() | leaving
        for host in self._discovery.hosts():
            if host.hostname in excluded:
                continue
            on_host = sum(1 for w in live if w.hostname == host.hostname)
            for _ in range(host.slots - on_host):
                if len(live) >= limit:
                    return
                self.start(job, host.hostname)
                live = alive(self.workers, WorkerState.STARTING, WorkerState.MEMBER)
