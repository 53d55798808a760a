"""A worker of an elastic job, and where it stands in the job (``WorkerState``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
