"""A worker's heartbeat: a counter in the job store, bumped every ``PERIOD_S`` by a thread of its own.

shoalrun reads it to find a worker stopped, or cut off from the network while its process (a local one, or the ssh
client of a remote one) lives on: one whose counter has stayed still for longer than its own history makes likely
(``shoal.runtime.liveness``) while the others' have moved. The elastic driver ends it and leaves it out of the next
round; a static job names it, and fails at the silence ceiling (``shoal.runner.static_watch``). The thread has its
own store connection, so a main thread blocked in a collective or a store call never delays it; a failed write
reconnects.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from shoal.config.worker import ELASTIC_ID_ENV
from shoal.log import get_logger

PERIOD_S = 0.5
_started = False


def static_worker_id(rank: int) -> str:
    """The heartbeat's name for rank ``rank`` of a static shoalrun job (an elastic worker has its own id)."""
    return f"static-rank-{rank}"


def start(
    launch: Any, joined_round: Callable[[], int], on_broken: Callable[[int, str], bool], worker_id: str | None = None
) -> bool:
    """Start the heartbeat once per process; returns whether it runs.

    Args:
        launch: the worker's ``LaunchInfo`` (where the job store is, and its secret).
        joined_round: the last round this worker joined (0: none yet, and always in a static job).
        on_broken: called with a round this worker joined and the failed member's id when the driver has marked that
            round broken, at every beat until it returns True.
        worker_id: the counter's name; an elastic worker's id by default.
    """
    global _started
    if _started or not launch.secret or launch.store_addr is None:
        return _started
    worker_id = worker_id or os.environ[ELASTIC_ID_ENV]
    args = (launch, worker_id, joined_round, on_broken)
    threading.Thread(target=_beat, args=args, name="shoal-heartbeat", daemon=True).start()
    _started = True
    return True


def _beat(launch: Any, worker_id: str, joined_round: Callable[[], int], on_broken: Callable[[int, str], bool]) -> None:
    from shoal.comm.names import secret_namespace
    from shoal.comm.store import connect_job_store
    from shoal.runtime.elastic_rendezvous import ElasticKeys, failed_member

    keys = ElasticKeys(secret_namespace(launch.secret))
    key = keys.heartbeat(worker_id)
    job_store = None
    count = 0
    told = 0
    """The last round whose broken mark was acted on."""
    while True:
        try:
            if job_store is None:
                job_store = connect_job_store(launch.store_addr, launch.store_port, launch.secret, 10.0)
            count += 1
            job_store.set(key, str(count))
            joined = joined_round()
            failed = failed_member(job_store, keys, joined) if joined > told else None
            if failed is not None and on_broken(joined, failed):
                told = joined
        except Exception as error:  # cut off or the driver gone: reconnect next time (the watchdog ends an orphan)
            get_logger().debug("heartbeat to shoalrun's store failed: %s", error)
            job_store = None
        time.sleep(PERIOD_S)
