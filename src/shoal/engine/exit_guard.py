"""The end of a process whose engine thread was left inside a collective of an abandoned job.

An abandoned engine thread (an elastic job that re-formed without a peer that never answered) waits on inside the
transport until the peer's connections close or the transport's timeout passes. If the process reaches its end
first, that thread can wake while the interpreter is being finalized: it then tries to take the GIL back, and the
process dies with SIGABRT ("terminate called without an active exception") after its work is done, so shoalrun
counts a finished worker as failed. Once armed, the guard ends such a process at exit with ``os._exit`` (after the
logging handlers and the standard streams are flushed), with the status it was exiting with: that of
``sys.exit(code)``, 1 after an uncaught exception, else 0. A script that ends with ``raise SystemExit(code)``
instead of ``sys.exit`` exits with 0.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from types import TracebackType
from typing import Any, NoReturn

_threads: list[threading.Thread] = []
_status: int | None = None


def arm(thread: threading.Thread) -> None:
    """End the process at exit without finalization while ``thread`` is still alive."""
    if not _threads:
        _install()
    _threads.append(thread)


def _install() -> None:
    exit_now, excepthook = sys.exit, sys.excepthook

    def recording_exit(status: Any = None) -> NoReturn:
        global _status
        _status = _code_of(status)
        exit_now(status)

    def recording_hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        global _status
        _status = 1
        excepthook(kind, value, traceback)

    sys.exit = recording_exit
    sys.excepthook = recording_hook
    atexit.register(_end)


def _code_of(status: Any) -> int:
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def _end() -> None:
    if not any(thread.is_alive() for thread in _threads):
        return  # every abandoned wait ended: finalize as usual
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_status or 0)
