"""End a worker whose shoalrun died without being able to end it (SIGKILL, OOM killer).

shoalrun ends its workers itself on every exit it can handle; a SIGKILL'ed launcher cannot. A worker started by
it directly learns its pid (``shoal.config.LAUNCHER_PID_ENV``) and, once initialized, checks its parent twice a
second: when the launcher is gone, the worker ends its own process group (itself and anything it started), leaving
no orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from shoal.config.worker import LAUNCHER_PID_ENV
from shoal.log import get_logger

_started = False
_POLL_S = 0.5


def start_launcher_watchdog() -> bool:
    """Start the watchdog once per process, if shoalrun is this process's direct parent; returns whether it runs."""
    global _started
    raw = os.environ.get(LAUNCHER_PID_ENV)
    if _started or not raw or not raw.isdigit() or os.getppid() != int(raw):
        return _started
    launcher = int(raw)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(_POLL_S)
        get_logger().error("shoalrun (pid %d) is gone; ending this worker and its children", launcher)
        if os.getpgrp() == os.getpid():  # shoalrun starts each worker as a session and group leader
            os.killpg(os.getpgrp(), signal.SIGTERM)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="shoal-launcher-watchdog", daemon=True).start()
    _started = True
    return True


def die_with_parent() -> None:  # pragma: no cover (runs in the child between fork and exec)
    """A ``preexec_fn``: on Linux, SIGKILL this child when the thread that started it dies (PR_SET_PDEATHSIG), so a
    worker never outlives a launcher killed before the worker's own watchdog runs."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
