"""A static job's liveness: shoalrun reads its workers' heartbeats as the elastic driver does (``shoal.runtime.
liveness``), so a worker that is stopped (SIGSTOP, a frozen host) or cut off is named with its rank and host within
seconds, not found by a collective's timeout minutes later. A static job keeps Horovod's semantics (a lost worker
fails the job), but a pause is not a loss: the watch only reports a worker once the failure detector suspects it,
and fails the job once the worker has been silent for the ``elastic_unreachable_seconds`` ceiling (default 30 s)
while the others were heard. When no worker reaches the store, the store's side is at fault and nothing happens."""

from __future__ import annotations

import sys
from typing import Any

from shoal.comm.names import secret_namespace
from shoal.config import env_name
from shoal.runtime.elastic_rendezvous import ElasticKeys
from shoal.runtime.heartbeat import static_worker_id
from shoal.runtime.liveness import Liveness, liveness_settings

CHECK_S = 0.25
"""How often shoalrun reads the heartbeats."""


class StaticWatch:
    """Reads the workers' heartbeat counters; says which worker to fail the job for."""

    def __init__(self, secret: str) -> None:
        self.keys = ElasticKeys(secret_namespace(secret))
        self.liveness = Liveness(liveness_settings())
        self.checked = 0.0
        self.reported: set[str] = set()

    def check(self, store: Any, workers: list[Any], now: float) -> Any | None:
        """The worker (one of ``workers``' running ranks; servers are not watched) whose silence fails the job now,
        or None; reports each suspected worker once."""
        if store is None or now - self.checked < CHECK_S:
            return None
        self.checked = now
        ids = {static_worker_id(w.slot.rank): w for w in workers if w.server_index is None and w.returncode is None}
        for worker_id in ids:
            key = self.keys.heartbeat(worker_id)
            if store.check([key]):
                self.liveness.observe(worker_id, store.get(key), now)
        heard = [w for w in ids if self.liveness.heard(w)]
        suspected = self.liveness.suspected(heard, now)
        ceiling = self.liveness.settings.ceiling_s
        for worker_id, why in suspected.items():
            if worker_id in self.reported:
                continue
            self.reported.add(worker_id)
            worker = ids[worker_id]
            print(
                f"shoalrun: rank {worker.slot.rank} on host {worker.slot.hostname} has not reached the job's store while "
                f"the others have (stopped, or cut off from the network?): {why}; the job fails if it stays silent for "
                f"{ceiling:.0f} s ({env_name('ELASTIC_UNREACHABLE_SECONDS')})",
                file=sys.stderr,
                flush=True,
            )
        self.reported &= set(suspected)  # a worker heard again may be reported again later
        lost = [w for w in suspected if self.liveness.silence(w, now) >= ceiling]
        return ids[lost[0]] if lost else None
