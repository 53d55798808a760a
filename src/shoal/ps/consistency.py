"""Consistency models (Poseidon, after Bösen/Petuum): when a server may answer a worker's pull.

Clocks count steps: after worker w pushed its gradient of piece j for step t, its clock on j is t + 1, and its pull
of j (implied by the push) is served once the slowest worker's clock on j is at least ``(t + 1) - s``. BSP is the
case where the update waits for every worker (one averaged update per step); SSP(s) applies each gradient on
arrival and bounds the lead to s steps; async serves every pull at once.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field


class PieceClocks:
    """Per-worker clocks of one piece, and the pulls still waiting on them (SSP)."""

    __slots__ = ("clocks", "pending")

    def __init__(self, workers: int) -> None:
        self.clocks: list[float] = [0.0] * workers
        """Steps pushed by each worker; infinity once the worker said goodbye (it no longer holds others back)."""
        self.pending: list[tuple[int, int]] = []
        """(worker, worker clock) of pulls not yet served."""

    def advance(self, worker: int, clock: int) -> int:
        """Record worker's push for step ``clock``; returns its new clock (``clock + 1``)."""
        self.clocks[worker] = max(self.clocks[worker], clock + 1)
        return clock + 1

    def retire(self, worker: int) -> None:
        """The worker left: it never holds the others back again."""
        self.clocks[worker] = math.inf

    @property
    def slowest(self) -> float:
        """The minimum clock over workers (infinity when all left)."""
        return min(self.clocks)

    def take_servable(self, staleness: int | None) -> list[tuple[int, int]]:
        """Remove and return the pending pulls allowed now: all of them when ``staleness`` is None (async)."""
        slowest = self.slowest
        ready = [(w, c) for w, c in self.pending if staleness is None or c - slowest <= staleness]
        self.pending = [(w, c) for w, c in self.pending if (w, c) not in ready]
        return ready


@dataclass
class PullRecorder:
    """What a server saw at each pull it served: (worker, worker clock, slowest clock). Tests assert bounds on it."""

    events: list[tuple[int, int, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, worker: int, clock: int, slowest: float) -> None:
        """Note one served pull."""
        with self._lock:
            self.events.append((worker, clock, slowest))

    def max_gap(self) -> float:
        """The largest lead of a served worker over the slowest one (0 when nothing was served)."""
        with self._lock:
            gaps = [clock - slowest for _, clock, slowest in self.events if not math.isinf(slowest)]
        return max(gaps, default=0.0)
