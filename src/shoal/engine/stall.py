"""The stall inspector: name the tensors some ranks submitted long ago and the ranks that never did."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.log import get_logger

PendingReport = list[tuple[int, str, float]]
"""One rank's pending requests: (process set, tensor name, seconds waiting)."""


@dataclass
class StallInspector:
    """Decides when to look for stalls, and what to report when some rank has waited too long."""

    check_time_s: float
    shutdown_time_s: float
    disabled: bool = False
    _last_check: float = field(default_factory=time.monotonic)

    def wants_check(self, oldest_wait_s: float) -> bool:
        """True when this rank has waited past the check time and has not asked for a check recently."""
        if self.disabled or oldest_wait_s < self.check_time_s:
            return False
        return time.monotonic() - self._last_check >= min(self.check_time_s, 1.0)

    def inspect(self, reports: Sequence[PendingReport], members_of: dict[int, tuple[int, ...]], rank: int) -> str | None:
        """Warn (on rank 0) about every stalled tensor; returns an error message when one passed the shutdown time."""
        self._last_check = time.monotonic()
        waiting: dict[tuple[int, str], dict[int, float]] = {}
        for reporting_rank, report in enumerate(reports):
            for process_set, name, age in report:
                waiting.setdefault((process_set, name), {})[reporting_rank] = age
        fatal = []
        for (process_set, name), ages in sorted(waiting.items()):
            members = members_of.get(process_set, ())
            missing = [r for r in members if r not in ages]
            age = max(ages.values())
            if not missing or age < self.check_time_s:
                continue
            message = (
                f"tensor '{name}' has waited {age:.1f} s: submitted by ranks {sorted(ages)} but not yet by "
                f"ranks {missing}. One or more ranks may be stuck, or skipped this collective."
            )
            if rank == 0:
                get_logger().warning("Stall inspector: %s", message)
            if self.shutdown_time_s > 0 and age >= self.shutdown_time_s:
                fatal.append(message)
        if fatal:
            return f"Stall inspector shut the engine down after {self.shutdown_time_s:.0f} s: {' '.join(fatal)}"
        return None
