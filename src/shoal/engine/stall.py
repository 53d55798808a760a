"""The stall inspector: name the tensors some ranks submitted long ago and the ranks that never did."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from shoal.config import env_name
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


class CollectiveWatch:
    """Watches the engine thread from outside while it is blocked inside one collective.

    The stall inspector runs on the engine thread, between collectives, so it cannot see a collective that never
    returns: that happens when a peer's engine stops taking part while its process lives on (a call holding the
    GIL, a stopped process, a very long transfer). This watch runs on a thread of its own: it warns every
    ``check_time_s`` while one collective lasts, and, when ``shutdown_time_s`` is set, calls ``on_shutdown`` once
    with the message, so that the pending requests fail instead of waiting for the transport's timeout.
    """

    def __init__(
        self,
        rank: int,
        check_time_s: float,
        shutdown_time_s: float,
        transport_timeout_s: float,
        on_shutdown: Callable[[str], None],
        disabled: bool = False,
    ) -> None:
        self.rank = rank
        self.check_time_s = check_time_s
        self.shutdown_time_s = shutdown_time_s
        self.transport_timeout_s = transport_timeout_s
        self._on_shutdown = on_shutdown
        self._current: tuple[str, float] | None = None
        """What the engine thread is blocked in and since when; one attribute, so a reader sees a whole pair."""
        self._stop = threading.Event()
        self.warnings = 0
        self._thread: threading.Thread | None = None
        if not disabled:
            self._thread = threading.Thread(target=self._run, name="shoal-engine-watch", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Mark the engine thread as inside the collective ``what`` for the duration of the block."""
        self._current = (what, time.monotonic())
        try:
            yield
        finally:
            self._current = None

    def stop(self) -> None:
        """End the watching thread."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        poll_s = min(1.0, self.check_time_s / 4)
        warned: tuple[str, float] | None = None
        next_warning = 0.0
        shut = False
        while not self._stop.wait(poll_s):
            current = self._current
            if current is None:
                continue
            what, since = current
            waited = time.monotonic() - since
            if current != warned:
                warned, next_warning, shut = current, self.check_time_s, False
            if waited >= next_warning:
                next_warning += self.check_time_s
                self.warnings += 1
                get_logger().warning(
                    "Stall inspector: rank %d has been blocked for %.0f s in %s: another rank's engine is not taking "
                    "part (it may be inside a call that holds the GIL, stopped, or still running a long transfer). "
                    "The transport gives up after %.0f s (%s).",
                    self.rank,
                    waited,
                    what,
                    self.transport_timeout_s,
                    env_name("COLLECTIVE_TIMEOUT_SECONDS"),
                )
            if self.shutdown_time_s > 0 and waited >= self.shutdown_time_s and not shut:
                shut = True
                self._on_shutdown(
                    f"Stall inspector failed the pending requests after {self.shutdown_time_s:.0f} s: rank {self.rank} "
                    f"was blocked in {what}"
                )
