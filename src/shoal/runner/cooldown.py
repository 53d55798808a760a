"""Hosts whose workers failed, and when they may have workers again (``--blacklist-cooldown-range``)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable


class HostCooldown:
    """Without a range, a host whose worker failed gets no new worker for the rest of the job. With ``(MIN, MAX)``,
    it is offered again after ``MIN * 2**failures + U(0, 1) * MIN`` seconds, kept within ``[MIN, MAX]``, as Horovod
    does. A failure while the host is still cooling down changes nothing; its count of failures is never reset."""

    def __init__(
        self,
        cooldown_range: tuple[float, float] | None,
        clock: Callable[[], float] = time.monotonic,
        uniform: Callable[[], float] = random.random,
    ) -> None:
        self.range = cooldown_range
        self._clock = clock
        self._uniform = uniform
        self.failures: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def fail(self, host: str) -> float:
        """Note a failed worker on ``host``; returns the seconds before it gets new workers (inf: never)."""
        now = self._clock()
        if self.range is None:
            self.failures[host] = self.failures.get(host, 0) + 1
            self._until[host] = math.inf
            return math.inf
        if self._until.get(host, 0.0) > now:
            return self._until[host] - now
        low, high = self.range
        count = self.failures[host] = self.failures.get(host, 0) + 1
        delay = max(low, min(high, low * 2**count + self._uniform() * low))
        self._until[host] = now + delay
        return delay

    def excluded(self) -> set[str]:
        """The hosts that get no new workers now."""
        now = self._clock()
        return {host for host, until in self._until.items() if until > now}

    def describe(self) -> str:
        """The hosts cooling down, for progress lines ("" when none)."""
        now = self._clock()
        parts = [
            f"{host} ({'for the rest of the job' if until == math.inf else f'{until - now:.0f} s left'})"
            for host, until in sorted(self._until.items())
            if until > now
        ]
        return ", ".join(parts)


__all__ = ["HostCooldown"]
