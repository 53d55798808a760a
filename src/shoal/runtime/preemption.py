"""Preemption notices: an elastic worker that gets SIGTERM (a spot VM's notice, a pod eviction, ``srun --signal``)
leaves the job at its next commit instead of dying like a crashed one.

On a notice signal (``--preemption-signals``, default SIGTERM) a thread of this module

1. writes the worker's ``leaving`` key into the job store, through a store connection of its own (the main thread
   may be inside a collective or a store call);
2. the elastic driver then publishes a round without this worker, and every member, this one too, learns of it at
   its next ``state.commit()``: the commit stands, nobody restores, and this worker, left out of the new round,
   exits 0 (``WorkerRemovedError`` in ``elastic.run``);
3. waits: if the worker is still here after ``--preemption-grace-seconds``, it exits with 128 + the signal, which
   the driver treats as any failed worker (the others restore their last commit).

A worker that never joined a round has nothing to hand over: it exits 0 at once. A handler the user installs for
one of these signals after ``init()`` takes it over: the worker then gets no notice from it. When shoalrun itself ends the job
it writes the ``ending`` key before signalling, and a worker that sees it exits at once. A second notice signal
changes nothing; SIGKILL still ends a worker at once.

The signal is seen through ``signal.set_wakeup_fd``, so a main thread blocked in C++ (a gloo wait) does not delay
the notice; where another library already owns the wakeup fd, the Python-level handler does the same, later.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

from shoal.config.worker import ELASTIC_ID_ENV, parse_signal_names, worker_setting
from shoal.log import get_logger

_POLL_S = 0.1
_lock = threading.Lock()
_installed = False
_noticed: int | None = None
"""The signal that gave notice, once one did."""
_launch: Any = None
_joined_round: Any = None
"""Returns the last elastic round this process joined (0: none yet)."""
_wakeup: tuple[socket.socket, socket.socket] | None = None
"""The wakeup fd's pair, kept open for the life of the process."""


def install(launch: Any, joined_round: Any) -> bool:
    """Take the notice signals in this elastic worker (once per process, from the main thread).

    Args:
        launch: the worker's ``LaunchInfo`` (where the job store is, and its secret).
        joined_round: a callable returning the last round this worker joined (0: it never joined one).

    Returns:
        Whether notices are taken (False outside the main thread, or with ``--preemption-signals none``).
    """
    global _installed, _launch, _joined_round, _wakeup
    _launch, _joined_round = launch, joined_round
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        get_logger().debug("preemption notices need init() on the main thread; these signals keep their action")
        return False
    signals = parse_signal_names(worker_setting("preemption_signals"))
    if not signals:
        return False
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:
        previous = -2
    if previous != -1:  # someone else's (asyncio's): keep it, and rely on the Python-level handler alone
        if previous >= 0:
            signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
    else:
        _wakeup = (reader, writer)
        threading.Thread(target=_watch_wakeup_fd, args=(reader, set(signals)), name="shoal-notice", daemon=True).start()
    for number in signals:
        signal.signal(number, _on_signal)
    _installed = True
    return True


def _on_signal(signum: int, _frame: object) -> None:
    _notice(signum)


def _watch_wakeup_fd(reader: socket.socket, signals: set[int]) -> None:
    while True:
        data = reader.recv(64)
        if not data:
            return
        for number in data:
            if number in signals and signal.getsignal(number) is _on_signal:  # not if the user took the signal over
                _notice(number)


def _notice(signum: int) -> None:
    """The first notice starts the leaving thread; later ones change nothing."""
    global _noticed
    with _lock:
        if _noticed is not None:
            return
        _noticed = signum
    threading.Thread(target=_leave, args=(signum,), name="shoal-leave", daemon=True).start()


def noticed() -> int | None:
    """The signal that gave this worker notice, or None."""
    return _noticed


def _leave(signum: int) -> None:
    from shoal.comm.names import secret_namespace
    from shoal.comm.store import connect_job_store
    from shoal.runtime.elastic_rendezvous import ElasticKeys

    name = signal.Signals(signum).name
    grace_s = float(worker_setting("preemption_grace_seconds"))
    deadline = time.monotonic() + grace_s
    log = get_logger()
    keys = ElasticKeys(secret_namespace(_launch.secret))
    try:
        job_store = connect_job_store(_launch.store_addr, _launch.store_port, _launch.secret, min(grace_s, 30.0))
        if job_store.check([keys.ending]):
            os._exit(128 + signum)  # shoalrun is ending the whole job: this signal is not a notice
        job_store.set(keys.leaving(os.environ[ELASTIC_ID_ENV]), name)
    except Exception as error:  # the driver is gone or unreachable: nothing to hand over, leave as a failure
        log.error("received %s but cannot tell shoalrun this worker is leaving (%s); exiting", name, error)
        os._exit(128 + signum)
    if not _joined_round():
        log.warning("received %s before joining the job; leaving now", name)
        os._exit(0)
    log.warning("received %s: leaving the job at the next commit (grace %.0f s)", name, grace_s)
    while time.monotonic() < deadline:
        try:
            if job_store.check([keys.ending]):
                os._exit(128 + signum)  # shoalrun is ending the whole job
        except Exception:  # the store closed: shoalrun has gone
            os._exit(128 + signum)
        time.sleep(_POLL_S)
    log.error("received %s %.0f s ago and reached no commit since (--preemption-grace-seconds); exiting", name, grace_s)
    os._exit(128 + signum)
