"""An elastic worker's heartbeat: a counter in the job store, bumped every second by a thread of its own.

shoalrun's elastic driver reads it to find a worker cut off from the network while its process (a local one, or the
ssh client of a remote one) lives on: one whose counter has not moved for the ``elastic_unreachable_seconds`` setting
while the others' have is ended as failed and left out of the next round. The thread has its own store connection,
so a main thread blocked in a collective or a store call never delays it; a failed write reconnects.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from shoal.config.worker import ELASTIC_ID_ENV
from shoal.log import get_logger

PERIOD_S = 1.0
_started = False


def start(launch: Any) -> bool:
    """Start the heartbeat once per process; returns whether it runs."""
    global _started
    if _started or not launch.secret or launch.store_addr is None:
        return _started
    threading.Thread(target=_beat, args=(launch, os.environ[ELASTIC_ID_ENV]), name="shoal-heartbeat", daemon=True).start()
    _started = True
    return True


def _beat(launch: Any, worker_id: str) -> None:
    from shoal.comm.names import secret_namespace
    from shoal.comm.store import connect_job_store
    from shoal.runtime.elastic_rendezvous import ElasticKeys

    key = ElasticKeys(secret_namespace(launch.secret)).heartbeat(worker_id)
    job_store = None
    count = 0
    while True:
        try:
            if job_store is None:
                job_store = connect_job_store(launch.store_addr, launch.store_port, launch.secret, 10.0)
            count += 1
            job_store.set(key, str(count))
        except Exception as error:  # cut off or the driver gone: reconnect next time (the watchdog ends an orphan)
            get_logger().debug("heartbeat to shoalrun's store failed: %s", error)
            job_store = None
        time.sleep(PERIOD_S)
