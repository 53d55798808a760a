"""The control lines of a shared-memory segment: each local rank's barrier epoch and pid, and the barrier that spins
on them.

Each local rank owns one 64-byte cache line of the segment's header (so ranks never write the same line): its epoch
(how many barriers it has reached) and its pid (``LEFT`` once it closed its side). The barrier spins, then yields,
then sleeps, and checks every ``LIVENESS_EVERY_S`` that the peers it waits for are alive and still in the group.
"""

from __future__ import annotations

import os
import time

CONTROL_LINE_INT64 = 8
"""One 64-byte cache line per rank, in int64s."""
SPIN_BEFORE_YIELD = 64
YIELD_BEFORE_SLEEP_S = 0.002
LIVENESS_EVERY_S = 0.02
LEFT = -1
"""The pid recorded for a rank that closed its side of the segment."""


class SharedMemoryError(RuntimeError):
    """A local peer died or stopped answering during a shared-memory collective."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class ControlLines:
    """This rank's view of the segment's control lines (``header``: the segment's header as int64s)."""

    def __init__(self, header: memoryview, local_rank: int, local_size: int, timeout_s: float) -> None:
        # A memoryview of int64s: reading one costs tens of nanoseconds, which is what a spin loop needs.
        self._control = header
        self.local_rank = local_rank
        self.local_size = local_size
        self.timeout_s = timeout_s
        self._sequence_index = [rank * CONTROL_LINE_INT64 for rank in range(local_size)]
        self._epoch = 0
        self._control[local_rank * CONTROL_LINE_INT64] = 0
        self._control[local_rank * CONTROL_LINE_INT64 + 1] = os.getpid()

    def barrier(self) -> None:
        """Wait until every local rank has reached this point; raises if a peer died or the timeout passed."""
        self._epoch += 1
        epoch = self._epoch
        control = self._control
        control[self.local_rank * CONTROL_LINE_INT64] = epoch
        spins = 0
        start = time.monotonic()
        last_check = start
        pause = 20e-6
        while not all(control[index] >= epoch for index in self._sequence_index):
            spins += 1
            if spins < SPIN_BEFORE_YIELD:
                continue
            now = time.monotonic()
            if now - start < YIELD_BEFORE_SLEEP_S:
                os.sched_yield()
                continue
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            if now - last_check >= LIVENESS_EVERY_S:
                last_check = now
                self._check_peers(epoch, now - start)

    def _check_peers(self, epoch: int, waited_s: float) -> None:
        for peer in range(self.local_size):
            if self._control[peer * CONTROL_LINE_INT64] >= epoch or peer == self.local_rank:
                continue
            pid = self._control[peer * CONTROL_LINE_INT64 + 1]
            if pid == LEFT:
                raise SharedMemoryError(f"local rank {peer} left the group during a shared-memory collective")
            if pid and not pid_alive(pid):
                raise SharedMemoryError(f"local rank {peer} (pid {pid}) died during a shared-memory collective")
        if waited_s > self.timeout_s:
            raise SharedMemoryError(f"local ranks did not reach a shared-memory collective within {self.timeout_s:.0f} s")

    def leave(self) -> None:
        """Mark this rank as gone (a peer waiting for it fails at its next liveness check) and release the view (a
        thread still spinning on it gets a ValueError, not a read of freed memory)."""
        self._control[self.local_rank * CONTROL_LINE_INT64 + 1] = LEFT
        self._control.release()
