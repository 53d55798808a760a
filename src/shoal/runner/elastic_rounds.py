"""The elastic driver's rounds of membership: who is in the next one, when one is needed, publishing it, and watching
it form.

Each round is written into the job's store (``shoal.runtime.elastic_rendezvous``): every member's assignment, the
removed workers' ``REMOVED``, then the round number. Rank 0 of a new round is always a worker that was already
training (members keep their rank order), so ``state.sync()`` hands its state to the newcomers.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from shoal.config import LaunchConfig
from shoal.runner.discovery import HostDiscovery, progress_period
from shoal.runner.elastic_worker import ElasticWorker, WorkerState, alive
from shoal.runner.hosts import place_ranks
from shoal.runtime.elastic_rendezvous import REMOVED, ElasticKeys

READY_SETTLE_S = 0.2
"""A worker asking for a new round usually saw a peer die; give the driver a moment to see the exit too."""


class Rounds:
    """The rounds of one elastic job over its ``workers`` (the job's list, shared) and the hosts ``discovery``
    offers. ``attach`` hands it the job's store once that is up."""

    def __init__(
        self, config: LaunchConfig, workers: list[ElasticWorker], discovery: HostDiscovery, max_np: int, verbose: Any
    ) -> None:
        self._config = config
        self._workers = workers
        self._discovery = discovery
        self._max_np = max_np
        self._verbose = verbose
        self.store: Any = None
        self.keys: ElasticKeys | None = None
        self.number = 0
        """The newest round published."""
        self.resets = 0
        """Rounds after the first that formed (the ones superseded before they formed do not count)."""
        self.reason: str | None = None
        """Why the job must re-form (a failure, a member leaving), until the driver re-forms it (``settled``)."""
        self.members: list[ElasticWorker] = []
        self._published_at = 0.0
        self.formed = False
        self.progress_said = 0.0
        """When the driver last said what it waits for."""
        self._ready_seen_at: float | None = None
        self._below_min_since: float | None = None
        """Since when the next round would have fewer than --min-np members."""

    def attach(self, store: Any, keys: ElasticKeys) -> None:
        """The job's store is up: rounds are written there from now on."""
        self.store, self.keys = store, keys

    def publish(self, members: list[ElasticWorker]) -> None:
        """Publish the next round with ``members`` (rank order as given); members left out are told they are
        removed."""
        assert self.store is not None and self.keys is not None
        self.number += 1
        for member, place in zip(members, place_ranks([m.hostname for m in members]), strict=True):
            self.store.set(self.keys.assignment(self.number, member.worker_id), place.to_json())
            member.rank, member.state = place.rank, WorkerState.MEMBER
        for worker in alive(self._workers, WorkerState.MEMBER, WorkerState.STARTING):
            if worker not in members and worker.state == WorkerState.MEMBER:
                worker.state = WorkerState.REMOVED
                self.store.set(self.keys.assignment(self.number, worker.worker_id), REMOVED)
        self.store.set(self.keys.round, str(self.number))
        self.members = list(members)
        self._published_at = time.monotonic()
        self.formed = False
        self._verbose(f"round {self.number}: {len(members)} workers ({', '.join(m.worker_id for m in members)})")

    def settled(self) -> None:
        """The driver re-forms the job now: the reasons seen so far are answered."""
        self.reason = None
        self._ready_seen_at = None
        self._below_min_since = None

    def too_few(self, count: int, min_np: int, cooling: str) -> str | None:
        """The next round would have ``count`` members, fewer than ``min_np``: wait up to --elastic-timeout for
        hosts to offer more, saying so now and then (``cooling``: the hosts cooling down); past it, why the job
        fails."""
        timeout_s = self._config.elastic_timeout
        now = time.monotonic()
        if self._below_min_since is None:
            self._below_min_since = now
            print(
                f"shoalrun: {count} worker(s) left, fewer than --min-np {min_np}; waiting up "
                f"to --elastic-timeout {timeout_s:.0f} s for more hosts",
                file=sys.stderr,
                flush=True,
            )
        if now - self._below_min_since >= timeout_s:
            return (
                f"only {count} worker(s) remain, fewer than --min-np {min_np}, and no "
                f"host offered more slots within --elastic-timeout {timeout_s:.0f} s"
            )
        if now - max(self._below_min_since, self.progress_said) >= progress_period(timeout_s):
            self.progress_said = now
            left = timeout_s - (now - self._below_min_since)
            print(
                f"shoalrun: still {count} worker(s), fewer than --min-np {min_np}; {left:.0f} s "
                f"left for hosts to offer more{f'; cooling down: {cooling}' if cooling else ''}",
                file=sys.stderr,
                flush=True,
            )
        return None

    def next_members(self) -> list[ElasticWorker]:
        """Members that stay (rank order kept, so rank 0 has trained), then newcomers ready to rendezvous."""
        discovery = self._discovery
        slots = {h.hostname: h.slots for h in discovery.hosts()}
        stay = [
            w
            for w in alive(self._workers, WorkerState.MEMBER)
            if (w.hostname in slots or not discovery.dynamic) and w.leaving is None
        ]
        stay.sort(key=lambda w: w.rank if w.rank is not None else 0)
        if discovery.dynamic:  # a host that offers fewer slots keeps its lowest-ranked workers
            kept: dict[str, int] = {}
            for worker in list(stay):
                kept[worker.hostname] = kept.get(worker.hostname, 0) + 1
                if kept[worker.hostname] > slots[worker.hostname]:
                    stay.remove(worker)
        return (stay + self.ready_newcomers())[: self._max_np]

    def ready_newcomers(self) -> list[ElasticWorker]:
        """Newcomers that are ready to rendezvous and got no notice."""
        assert self.store is not None and self.keys is not None
        starting = alive(self._workers, WorkerState.STARTING)
        return [w for w in starting if w.leaving is None and self.store.check([self.keys.ready(w.worker_id)])]

    def wanted(self) -> str | None:
        """Why a new round is needed now, or None."""
        assert self.store is not None and self.keys is not None
        if self.reason is not None:
            return self.reason
        for worker in alive(self._workers, WorkerState.MEMBER):
            key = self.keys.ready(worker.worker_id)
            if self.store.check([key]) and int(self.store.get(key).decode()) >= self.number:
                now = time.monotonic()
                self._ready_seen_at = self._ready_seen_at or now
                if now - self._ready_seen_at >= READY_SETTLE_S:
                    return f"worker {worker.worker_id} asked to re-form the job"
                return None
        if self._discovery.dynamic:
            slots = {h.hostname: h.slots for h in self._discovery.hosts()}
            members = alive(self._workers, WorkerState.MEMBER)
            if any(w.hostname not in slots for w in members):
                return "a host left the discovery output"
            if any(sum(1 for m in members if m.hostname == host) > count for host, count in slots.items()):
                return "a host offers fewer slots"
        if self.ready_newcomers():
            return "new workers are ready to join"
        return None

    def note_formed(self) -> bool:
        """True once the current round has formed; its members are then marked as holding the state."""
        if self.formed:
            return True
        if self.store is None or self.keys is None:
            return False
        state_key = self.keys.state(self.number)
        if not (self.store.check([state_key]) and self.store.get(state_key) == b"formed"):
            return False
        self.formed = True
        for member in self.members:
            member.joined = True
        if self.number > 1:
            self.resets += 1  # rounds superseded before they formed do not count against --reset-limit
        return True

    def watch(self) -> None:
        """Mark members of a formed round as holding the state; end members that never arrive (wedged, partitioned)."""
        assert self.store is not None and self.keys is not None
        if self.note_formed():
            return
        # A member starting up may still be importing torch: --start-timeout on top of --elastic-timeout.
        bound = self._config.elastic_timeout + self._config.start_timeout
        now = time.monotonic()
        waited = now - self._published_at
        period = progress_period(bound)
        due = waited >= bound or (waited >= period and now - self.progress_said >= period)
        if not due:
            return
        missing = [
            m
            for m in self.members
            if m.process.returncode is None and not self.store.check([self.keys.arrival(self.number, m.worker_id)])
        ]
        if waited < bound:
            self.progress_said = now
            if missing:
                print(
                    f"shoalrun: round {self.number} waits for worker(s) {', '.join(m.worker_id for m in missing)} "
                    f"to join; {bound - waited:.0f} s left before they are ended",
                    file=sys.stderr,
                    flush=True,
                )
            return
        for member in missing:
            print(
                f"shoalrun: worker {member.worker_id} did not join round {self.number} within {bound:.0f} s "
                "(--elastic-timeout + --start-timeout); ending it",
                file=sys.stderr,
                flush=True,
            )
            member.process.signal_tree(signal.SIGKILL)
        self._published_at = time.monotonic()  # its exit is a failure like any other, handled by the reaper

    def mark_broken(self, worker: ElasticWorker) -> None:
        """Mark the rounds a failed member may have shared with survivors broken (the newest, and the one before it,
        whose members may not have joined the newest yet): a survivor blocked in a collective it will never join (its
        peer holding the connections open, such as a hung child) then stops waiting, before the next round forms."""
        if self.store is None or self.keys is None:
            return
        for round_number in range(max(1, self.number - 1), self.number + 1):
            try:
                self.store.set(self.keys.broken(round_number), worker.worker_id)
            except Exception as error:  # the store is the driver's own; a failure here is reported, never fatal
                print(f"shoalrun: cannot mark round {round_number} broken: {error}", file=sys.stderr, flush=True)
