"""Elastic rendezvous: the keys shoalrun's elastic driver and its workers share in the job store.

The driver (``shoal.runner.elastic_driver``) hosts the store, so it survives any worker. It numbers the job's
successive memberships as *rounds*. For round R it writes every member's assignment (rank, size, host and local
ranks; or ``removed`` for a live worker that is not in it), then publishes R. A worker joins the newest round that
assigns it, waits until every member has arrived, and only then builds its process group under keys private to
round R, so a dead peer from an older round can never be waited on.

A worker whose job broke simply comes back to ``join_round``: its ``ready`` key then names the round it was in,
which tells the driver that round is broken even when no worker exit explains it.

A round forms or is abandoned exactly once: the last member to arrive marks it ``formed``; a member that sees a newer
round published first marks it ``abandoned`` (a compare-and-set decides which came first), so all members agree.
"""

from __future__ import annotations

import os
import time
from typing import Any

from shoal.config.worker import ELASTIC_ID_ENV, SlotInfo
from shoal.exceptions import ElasticRendezvousError, WorkerRemovedError

REMOVED = "removed"
_POLL_S = 0.02
ROUND_CONNECT_TIMEOUT_S = 15.0
"""How long a member of a formed round waits for another member's connection while the round's process groups are
made. Every member has arrived by then, so the connections come within a second or two even on a loaded machine;
one that does not come is a member that died after publishing its address (gloo would otherwise wait as long as for
a collective), and the worker joins the next round. Collectives keep their own, longer timeout."""


def is_elastic_worker() -> bool:
    """True in a worker started by shoalrun in elastic mode."""
    return bool(os.environ.get(ELASTIC_ID_ENV))


def round_connect_timeout() -> float | None:
    """How long this process's groups may wait for a member's connection: ``ROUND_CONNECT_TIMEOUT_S`` in an elastic
    worker, None (as long as a collective) elsewhere, where ranks may reach a group's creation far apart."""
    return ROUND_CONNECT_TIMEOUT_S if is_elastic_worker() else None


class ElasticKeys:
    """Key names under the job's namespace; the one place both sides spell them."""

    def __init__(self, namespace: str) -> None:
        self.base = f"{namespace}/elastic"

    @property
    def round(self) -> str:
        """The newest published round number."""
        return f"{self.base}/round"

    def assignment(self, round_number: int, worker_id: str) -> str:
        """Worker ``worker_id``'s assignment in a round (JSON, or ``removed``)."""
        return f"{self.base}/r{round_number}/assign/{worker_id}"

    def arrived(self, round_number: int) -> str:
        """How many members of a round have arrived."""
        return f"{self.base}/r{round_number}/arrived"

    def state(self, round_number: int) -> str:
        """``formed`` or ``abandoned``, set once."""
        return f"{self.base}/r{round_number}/state"

    def broken(self, round_number: int) -> str:
        """Set by the driver (to the worker's id) when a member of a round failed: no collective of that round can
        complete any more, so its survivors stop waiting in one."""
        return f"{self.base}/r{round_number}/broken"

    def group_prefix(self, round_number: int) -> str:
        """Prefix for the process group's own keys in a round."""
        return f"{self.base}/r{round_number}/pg/"

    def ready(self, worker_id: str) -> str:
        """A worker waiting for a round writes the last round it was in (0: none yet)."""
        return f"{self.base}/ready/{worker_id}"

    def heartbeat(self, worker_id: str) -> str:
        """A counter the worker's heartbeat thread bumps every second (the driver finds workers cut off)."""
        return f"{self.base}/heartbeat/{worker_id}"

    def leaving(self, worker_id: str) -> str:
        """Set by a worker given a preemption notice (the signal's name): it leaves at its next commit."""
        return f"{self.base}/leaving/{worker_id}"

    @property
    def ending(self) -> str:
        """Set by the driver before it ends the whole job: a worker given notice then exits at once."""
        return f"{self.base}/ending"

    def arrival(self, round_number: int, worker_id: str) -> str:
        """Set when a worker arrives in a round (the driver finds members that never come)."""
        return f"{self.base}/r{round_number}/arrival/{worker_id}"


def failed_member(store: Any, keys: ElasticKeys, round_number: int) -> str | None:
    """The worker whose failure made the driver mark ``round_number`` broken, or None while it is not."""
    if not store.check([keys.broken(round_number)]):
        return None
    return str(store.get(keys.broken(round_number)).decode())


def current_round(store: Any, keys: ElasticKeys) -> int:
    """The newest round the driver published (0 before the first)."""
    if not store.check([keys.round]):
        return 0
    return int(store.get(keys.round).decode())


def join_round(store: Any, keys: ElasticKeys, worker_id: str, last_round: int, timeout_s: float) -> tuple[SlotInfo, int]:
    """Wait for the newest round after ``last_round`` that assigns this worker, and for all its members to arrive.

    Returns:
        This worker's assignment and the round number.

    Raises:
        WorkerRemovedError: the driver left this worker out of the job.
        ElasticRendezvousError: no round formed within ``timeout_s`` (the driver is gone or gave up).
    """
    store.set(keys.ready(worker_id), str(last_round))
    deadline = time.monotonic() + timeout_s
    joined: set[int] = set()
    while time.monotonic() < deadline:
        newest = current_round(store, keys)
        key = keys.assignment(newest, worker_id)
        if newest > last_round and newest not in joined and store.check([key]):
            value = store.get(key).decode()
            if value == REMOVED:
                raise WorkerRemovedError(f"the elastic driver left this worker out of round {newest}")
            joined.add(newest)
            assignment = SlotInfo.from_json(value)
            if _await_members(store, keys, newest, worker_id, assignment.size, deadline):
                return assignment, newest
            continue
        time.sleep(_POLL_S * 5)
    raise ElasticRendezvousError(
        f"no elastic round including this worker formed within {timeout_s:.0f} s (after round {last_round})"
    )


def _await_members(store: Any, keys: ElasticKeys, round_number: int, worker_id: str, size: int, deadline: float) -> bool:
    """Arrive in a round; True once it formed, False if a newer round superseded it first."""
    state_key = keys.state(round_number)
    store.set(keys.arrival(round_number, worker_id), "1")
    if store.add(keys.arrived(round_number), 1) >= size:
        store.compare_set(state_key, "", "formed")
    while time.monotonic() < deadline:
        if store.check([state_key]):
            return bool(store.get(state_key).decode() == "formed")
        if current_round(store, keys) > round_number:
            # Whichever of "formed" (the last arrival) and "abandoned" (us) is set first wins, for everyone.
            return bool(store.compare_set(state_key, "", "abandoned").decode() == "formed")
        time.sleep(_POLL_S)
    return False
