"""The elastic driver's watch over its members' heartbeats: a member stopped or cut off from the job's store is ended
in seconds, as a failed worker (``shoal.runtime.liveness`` decides when a silence is a failure)."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from shoal.runner.elastic_worker import ElasticWorker, WorkerState, alive
from shoal.runtime.elastic_rendezvous import ElasticKeys
from shoal.runtime.liveness import Liveness, liveness_settings

CHECK_S = 0.25
"""How often the driver reads the members' heartbeats."""


class HeartbeatWatch:
    """Each member's heartbeat history, read from the store every ``CHECK_S``."""

    def __init__(self) -> None:
        self._liveness = Liveness(liveness_settings())
        self._checked = 0.0

    def check(self, store: Any, keys: ElasticKeys, workers: list[ElasticWorker]) -> None:
        """End members of ``workers`` cut off from the store or stopped (their heartbeat silent for longer than their
        own history makes likely) while others still reach it: they cannot take part in a round. When none reaches
        it, the store's side is at fault and nobody is ended. An ended member's exit is a failure like any other."""
        now = time.monotonic()
        if now - self._checked < CHECK_S:
            return
        self._checked = now
        members = alive(workers, WorkerState.MEMBER)
        for worker in members:
            key = keys.heartbeat(worker.worker_id)
            if store.check([key]):
                self._liveness.observe(worker.worker_id, store.get(key), now)
        heard = [w for w in members if self._liveness.heard(w.worker_id)]  # a worker still starting has not beaten
        silent = self._liveness.suspected([w.worker_id for w in heard], now)  # empty when all are (an outage)
        for worker in (w for w in heard if w.worker_id in silent):
            print(
                f"shoalrun: worker {worker.worker_id} (rank {worker.rank}) on host {worker.hostname} has not reached the "
                f"job's store while the others have (stopped, or cut off from the network?): {silent[worker.worker_id]}; "
                "ending it",
                file=sys.stderr,
                flush=True,
            )
            worker.process.signal_tree(signal.SIGKILL)
            self._liveness.forget(worker.worker_id)
