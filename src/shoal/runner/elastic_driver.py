"""shoalrun's elastic driver: keep a job running while workers die and hosts come and go.

The driver hosts the job store (it outlives every worker) and forms *rounds* of membership through it (see
``shoal.runtime.elastic_rendezvous``). It starts a new round when

- a member exits non-zero (SIGKILL, a crash, its host vanishing): its host is excluded from new spawns, and the
  survivors, whose collectives failed fast, restore their last commit and join the new round;
- a member asks for one (its collectives failed although no worker exit was seen);
- new slots appear in the host discovery output: newcomers are started there and admitted once they are ready to
  rendezvous; the members learn of it at their next ``state.commit()``;
- a host disappears from discovery: its workers are told they are removed and exit cleanly;
- a member gets a preemption notice (SIGTERM by default; ``shoal.runtime.preemption``): the new round leaves it
  out, every member learns of it at its next commit and goes on from that commit, nothing rolled back, and the
  worker leaves with status 0. Its host gets no new worker before it has gone.
- the whole job gets notice: shoalrun itself receives one of the notice signals other than SIGINT, SIGTERM and
  SIGHUP (SIGUSR1 by default: Slurm's ``sbatch --signal=B:USR1@60``, ``scancel --batch --signal=USR1``), or every
  member has got one: the driver publishes a round with no members, every worker leaves at its next commit with
  status 0, and shoalrun exits 0. Past ``--preemption-grace-seconds`` without it, the workers are ended and shoalrun
  exits with 128 + the signal.

Rank 0 of a new round is always a worker that was already training, so ``state.sync()`` hands its state to the
newcomers. With fewer than ``--min-np`` workers the driver waits up to ``--elastic-timeout`` for discovery to offer
more, then ends everything with a non-zero exit. ``--reset-limit`` bounds how many times the job may re-form.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from typing import Any

from shoal.config import LaunchConfig, worker_setting
from shoal.config.worker import parse_signal_names
from shoal.runner.cooldown import HostCooldown
from shoal.runner.discovery import HostDiscovery, progress_period
from shoal.runner.elastic_worker import ElasticWorker, WorkerState
from shoal.runner.hosts import HostSlots, SlotInfo, place_ranks
from shoal.runner.launcher import Job, _describe_status, requested_hosts
from shoal.runtime.elastic_rendezvous import ELASTIC_ID_ENV, REMOVED, ElasticKeys
from shoal.runtime.liveness import Liveness, liveness_settings

_LIVENESS_CHECK_S = 0.25
"""How often the driver reads the members' heartbeats."""
_READY_SETTLE_S = 0.2
"""A worker asking for a new round usually saw a peer die; give the driver a moment to see the exit too."""


class ElasticJob(Job):
    """A shoalrun job whose membership may change; ``run()`` returns shoalrun's exit code."""

    def __init__(
        self,
        config: LaunchConfig,
        static_hosts: list[HostSlots],
        discovery: HostDiscovery | None = None,
        **job_options: Any,
    ) -> None:
        """An elastic job over the static hosts (or those the discovery script prints, or ``discovery`` finds:
        shoal.ray passes Ray's nodes); ``job_options`` go to ``Job`` (rendezvous address, store callbacks)."""
        if config.num_proc is None or config.min_np is None or config.max_np is None:
            raise ValueError("an elastic job needs -np, --min-np and --max-np (LaunchConfig.check() fills them in)")
        if discovery is None:
            discovery = HostDiscovery.of_script(static_hosts, config.host_discovery_script, config.slots_per_host or 1)
        discovery.start()
        # Only used to choose the rendezvous address: hosts discovered later may be remote, so then listen on all.
        known = [SlotInfo(h.hostname, 0, 1, 0, 1, 0, 1) for h in discovery.hosts()]
        super().__init__(config, slots=known, bind_all=discovery.dynamic, **job_options)
        self.num_proc, self.min_np, self.max_np = config.num_proc, config.min_np, config.max_np
        self.discovery = discovery
        self.elastic: list[ElasticWorker] = []
        self.cooldown = HostCooldown(config.blacklist_cooldown_range)
        """Hosts whose workers failed: none get new workers for the rest of the job, or until their cooldown ends."""
        self.round = 0
        self.resets = 0
        self._spawned = 0
        self._below_min_since: float | None = None
        self._reset_reason: str | None = None
        self._ready_seen_at: float | None = None
        self._keys: ElasticKeys | None = None
        self._round_members: list[ElasticWorker] = []
        self._round_published_at = 0.0
        self._round_formed = False
        self._progress_said = 0.0
        self._liveness = Liveness(liveness_settings())
        """Each member's heartbeat history, and whether its silence is a failure."""
        self._liveness_checked = 0.0
        self._job_notice: str | None = None
        """The notice the whole job got (a signal's name), once it did: every worker leaves at its next commit."""
        self._job_notice_deadline: float | None = None
        """When the workers given the job's notice must have left (set when their empty round is published)."""
        self._noticed_members: list[ElasticWorker] = []
        """The members holding the training state when the whole job got notice."""

    # ----- the worker set -----

    def _alive(self, *states: WorkerState) -> list[ElasticWorker]:
        return [w for w in self.elastic if w.state in states and w.process.returncode is None]

    def workers_on(self, hostnames: set[str]) -> int:
        # The machine's slots, up to --max-np: the most workers it will run at once (the job's slot list names each
        # host once, so it would say one, and every worker would take all the cores).
        return min(sum(h.slots for h in self.discovery.hosts() if h.hostname in hostnames), self.max_np)

    def _start_worker(self, hostname: str) -> None:
        self._spawned += 1
        worker_id = f"{hostname}#{self._spawned}"
        # The slot's rank only labels the output (the n-th worker started is [n-1], so labels never collide);
        # the real rank comes from each round's assignment.
        label = self._spawned - 1
        slot = SlotInfo(hostname, label, label + 1, 0, 1, 0, 1)
        env = {ELASTIC_ID_ENV: worker_id}  # the elastic timeout comes with every worker's settings
        process = self._spawn(slot, env)
        self.workers.append(process)
        self.elastic.append(ElasticWorker(worker_id, hostname, process))
        self.verbose(f"started worker {worker_id}")

    def _fill_slots(self, limit: int) -> None:
        """Start workers on free slots of the known, non-excluded hosts, up to ``limit`` live workers."""
        live = self._alive(WorkerState.STARTING, WorkerState.MEMBER)
        # A host whose worker got a notice gets none while that worker is still leaving; a host that is going away
        # leaves the discovery output.
        leaving = {w.hostname for w in self.elastic if w.leaving is not None and w.process.returncode is None}
        excluded = self.cooldown.excluded() | leaving
        for host in self.discovery.hosts():
            if host.hostname in excluded:
                continue
            on_host = sum(1 for w in live if w.hostname == host.hostname)
            for _ in range(host.slots - on_host):
                if len(live) >= limit:
                    return
                self._start_worker(host.hostname)
                live = self._alive(WorkerState.STARTING, WorkerState.MEMBER)

    # ----- rounds -----

    def _publish_round(self, members: list[ElasticWorker]) -> None:
        assert self._store is not None and self._keys is not None
        self.round += 1
        for member, place in zip(members, place_ranks([m.hostname for m in members]), strict=True):
            self._store.set(self._keys.assignment(self.round, member.worker_id), place.to_json())
            member.rank, member.state = place.rank, WorkerState.MEMBER
        for worker in self._alive(WorkerState.MEMBER, WorkerState.STARTING):
            if worker not in members and worker.state == WorkerState.MEMBER:
                worker.state = WorkerState.REMOVED
                self._store.set(self._keys.assignment(self.round, worker.worker_id), REMOVED)
        self._store.set(self._keys.round, str(self.round))
        self._round_members = list(members)
        self._round_published_at = time.monotonic()
        self._round_formed = False
        self.verbose(f"round {self.round}: {len(members)} workers ({', '.join(m.worker_id for m in members)})")

    def _next_members(self) -> list[ElasticWorker]:
        """Members that stay (rank order kept, so rank 0 has trained), then newcomers ready to rendezvous."""
        assert self._store is not None and self._keys is not None
        slots = {h.hostname: h.slots for h in self.discovery.hosts()}
        stay = [
            w
            for w in self._alive(WorkerState.MEMBER)
            if (w.hostname in slots or not self.discovery.dynamic) and w.leaving is None
        ]
        stay.sort(key=lambda w: w.rank if w.rank is not None else 0)
        if self.discovery.dynamic:  # a host that offers fewer slots keeps its lowest-ranked workers
            kept: dict[str, int] = {}
            for worker in list(stay):
                kept[worker.hostname] = kept.get(worker.hostname, 0) + 1
                if kept[worker.hostname] > slots[worker.hostname]:
                    stay.remove(worker)
        return (stay + self._ready_newcomers())[: self.max_np]

    def _ready_newcomers(self) -> list[ElasticWorker]:
        """Newcomers that are ready to rendezvous and got no notice."""
        assert self._store is not None and self._keys is not None
        starting = self._alive(WorkerState.STARTING)
        return [w for w in starting if w.leaving is None and self._store.check([self._keys.ready(w.worker_id)])]

    def _wants_new_round(self) -> str | None:
        """Why a new round is needed now, or None."""
        assert self._store is not None and self._keys is not None
        if self._reset_reason is not None:
            return self._reset_reason
        for worker in self._alive(WorkerState.MEMBER):
            key = self._keys.ready(worker.worker_id)
            if self._store.check([key]) and int(self._store.get(key).decode()) >= self.round:
                now = time.monotonic()
                self._ready_seen_at = self._ready_seen_at or now
                if now - self._ready_seen_at >= _READY_SETTLE_S:
                    return f"worker {worker.worker_id} asked to re-form the job"
                return None
        if self.discovery.dynamic:
            slots = {h.hostname: h.slots for h in self.discovery.hosts()}
            members = self._alive(WorkerState.MEMBER)
            if any(w.hostname not in slots for w in members):
                return "a host left the discovery output"
            if any(sum(1 for m in members if m.hostname == host) > count for host, count in slots.items()):
                return "a host offers fewer slots"
        if self._ready_newcomers():
            return "new workers are ready to join"
        return None

    # ----- heartbeats -----

    def _check_liveness(self) -> None:
        """End members cut off from the store or stopped (their heartbeat silent for longer than their own history
        makes likely, ``shoal.runtime.liveness``) while others still reach it: they cannot take part in a round. When
        none reaches it, the store's side is at fault and nobody is ended."""
        now = time.monotonic()
        if self._store is None or self._keys is None or now - self._liveness_checked < _LIVENESS_CHECK_S:
            return
        self._liveness_checked = now
        members = self._alive(WorkerState.MEMBER)
        for worker in members:
            key = self._keys.heartbeat(worker.worker_id)
            if self._store.check([key]):
                self._liveness.observe(worker.worker_id, self._store.get(key), now)
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
            worker.process.signal_tree(signal.SIGKILL)  # its exit is a failure like any other, handled by _reap
            self._liveness.forget(worker.worker_id)

    # ----- preemption notices -----

    def _check_notices(self) -> None:
        """Note workers that say they got a preemption notice (``shoal.runtime.preemption``)."""
        if self._store is None or self._keys is None:
            return
        for worker in self._alive(WorkerState.STARTING, WorkerState.MEMBER):
            self._check_notice(worker)
        members = self._alive(WorkerState.MEMBER)
        if self._job_notice is None and members and all(w.leaving is not None for w in members):
            self._job_notice = members[0].leaving  # nobody would stay: the whole job is being preempted

    def _on_job_notice(self, signum: int, _frame: object) -> None:
        self._job_notice = self._job_notice or signal.Signals(signum).name

    def _job_notice_signals(self) -> list[int]:
        """The notice signals shoalrun takes for the whole job: the workers' (``--preemption-signals``) except those
        that end the job at once (SIGINT, SIGTERM, SIGHUP)."""
        names = self.config.preemption_signals or str(worker_setting("preemption_signals"))
        return [n for n in parse_signal_names(names) if n not in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]

    def _end_after_notice(self) -> int | None:
        """Once the job has notice: publish a round without members (each worker leaves at its next commit), then
        end the job when all have left (0), or when they have not within the grace period (128 + the signal)."""
        assert self._job_notice is not None
        now = time.monotonic()
        if self._job_notice_deadline is None:
            grace_s = self.config.preemption_grace_seconds
            grace_s = float(worker_setting("preemption_grace_seconds") if grace_s is None else grace_s)
            self._job_notice_deadline = now + grace_s
            # Only these hold the state: whether they leave cleanly decides the exit code (a worker still starting,
            # or a member of a round that never formed, has nothing to hand over, whatever its exit).
            self._noticed_members = [w for w in self._alive(WorkerState.MEMBER) if w.joined]
            print(
                f"shoalrun: the job got {self._job_notice}; every worker leaves at its next commit, with nothing "
                f"rolled back, and the job ends (grace {grace_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            if self._store is not None and self._keys is not None:
                self._publish_round([])
            for worker in self._alive(WorkerState.STARTING):  # newcomers hold nothing to hand over
                worker.process.signal_tree(signal.SIGTERM)
        if all(w.process.returncode is not None for w in self.elastic):
            failed = [w.worker_id for w in self._noticed_members if w.process.returncode != 0]
            if failed:
                print(f"shoalrun: after {self._job_notice}, worker(s) {', '.join(failed)} failed", file=sys.stderr)
                return 1
            print(f"shoalrun: every worker left at a commit after {self._job_notice}", file=sys.stderr, flush=True)
            return 0
        if now >= self._job_notice_deadline:
            print(
                f"shoalrun: workers still running {now - self._job_notice_deadline:.0f} s past the grace period after "
                f"{self._job_notice} (--preemption-grace-seconds); ending them",
                file=sys.stderr,
                flush=True,
            )
            self.terminate_all()
            return 128 + signal.Signals[self._job_notice].value
        return None

    def _check_notice(self, worker: ElasticWorker) -> None:
        assert self._store is not None and self._keys is not None
        key = self._keys.leaving(worker.worker_id)
        if worker.leaving is not None or not self._store.check([key]):
            return
        worker.leaving = self._store.get(key).decode()
        if worker.state != WorkerState.MEMBER:
            self.verbose(f"worker {worker.worker_id} got {worker.leaving} before it joined; it leaves now")
            return
        print(
            f"shoalrun: worker {worker.worker_id} (rank {worker.rank}) on host {worker.hostname} got {worker.leaving}; "
            "it leaves at its next commit, with nothing rolled back",
            file=sys.stderr,
            flush=True,
        )
        self._reset_reason = self._reset_reason or f"worker {worker.worker_id} is leaving after {worker.leaving}"

    def _say_ending(self) -> None:
        """Tell workers given notice that the whole job ends: they exit at once rather than wait for a commit."""
        if self._store is not None and self._keys is not None:
            try:
                self._store.set(self._keys.ending, "1")
            except Exception as error:  # ending anyway; SIGKILL follows the grace period
                self.verbose(f"could not mark the job as ending: {error}")

    def terminate_all(self) -> None:
        """Say the job is ending, then end every worker as a static job does."""
        self._say_ending()
        super().terminate_all()

    # ----- supervision -----

    def _reap(self) -> int | None:
        """Note exited workers; returns a job exit code when the job is over."""
        for worker in self.elastic:
            code = worker.process.returncode
            if code is None or worker.state in (WorkerState.FINISHED, WorkerState.FAILED, WorkerState.LEFT):
                continue
            if code == 0:
                self._check_notice(worker)  # it may have left before the driver saw its notice
                if worker.leaving is not None and worker.state in (WorkerState.MEMBER, WorkerState.REMOVED):
                    self.verbose(f"worker {worker.worker_id} left after its {worker.leaving} notice")
                    worker.state = WorkerState.LEFT
                    continue
                worker.state = WorkerState.FINISHED if worker.state == WorkerState.MEMBER else WorkerState.LEFT
                continue
            was_member = worker.state == WorkerState.MEMBER
            given_notice = worker.leaving is not None and worker.state == WorkerState.REMOVED
            worker.state = WorkerState.FAILED
            self._end_leftovers(worker)
            cooldown_s = self.cooldown.fail(worker.hostname)  # also for a newcomer: no restart storm there
            self._drain_output_of(worker.process)
            if given_notice:  # the round without it is out already; the others restore, as after a crash
                print(
                    f"shoalrun: worker {worker.worker_id} (rank {worker.rank}) on host {worker.hostname} "
                    f"{_describe_status(code)}: it reached no commit within --preemption-grace-seconds of its "
                    f"{worker.leaving}, so the others restore their last commit; "
                    f"{_no_new_workers(worker.hostname, cooldown_s)}",
                    file=sys.stderr,
                    flush=True,
                )
            finished = [w for w in self.elastic if w.state == WorkerState.FINISHED]
            if not was_member or (finished and not worker.joined):
                continue  # a removed worker, or a newcomer that never took part: nothing to recover from
            if finished:
                print(
                    f"shoalrun: worker {worker.worker_id} (rank {worker.rank}) on host {worker.hostname} "
                    f"{_describe_status(code)} after other workers had finished; ending the job",
                    file=sys.stderr,
                    flush=True,
                )
                return 128 - code if code < 0 else code
            print(
                f"shoalrun: worker {worker.worker_id} (rank {worker.rank}) on host {worker.hostname} "
                f"{_describe_status(code)}; {_no_new_workers(worker.hostname, cooldown_s)}; re-forming the job",
                file=sys.stderr,
                flush=True,
            )
            self._reset_reason = f"worker {worker.worker_id} failed"
            self._mark_broken(worker)
        if any(w.state == WorkerState.FINISHED for w in self.elastic):
            # A short last round may have formed since the loop last looked: its members are training, not waiting.
            self._note_formed()
            members = self._alive(WorkerState.MEMBER)
            if any(w.joined for w in members):
                return None  # members holding the state are still finishing their last steps
            if members and self.round == 1 and not self._round_formed:
                return None  # a script that never rendezvoused (no elastic state): each worker runs to its end
            # Training is over; newcomers still waiting to join (or removed workers still leaving) are not needed.
            self._say_ending()
            for worker in self._alive(WorkerState.STARTING, WorkerState.REMOVED, WorkerState.MEMBER):
                worker.process.signal_tree(signal.SIGTERM)
            return 0
        if self._job_notice is None and self.elastic and all(w.process.returncode is not None for w in self.elastic):
            print("shoalrun: every worker has exited and none finished", file=sys.stderr, flush=True)
            return 1
        return None

    def _end_leftovers(self, worker: ElasticWorker) -> None:
        """SIGKILL what a failed worker left in its process group (a local worker's; for others, what its spawner
        can reach)."""
        try:
            worker.process.signal_tree(signal.SIGKILL)
        except Exception as error:  # an actor already gone, a slot that cannot be reached: nothing left to end
            self.verbose(f"could not end what worker {worker.worker_id} left behind: {error}")

    def _mark_broken(self, worker: ElasticWorker) -> None:
        """Mark the rounds a failed member may have shared with survivors broken (the newest, and the one before it,
        whose members may not have joined the newest yet): a survivor blocked in a collective it will never join (its
        peer holding the connections open, such as a hung child) then stops waiting, before the next round forms."""
        if self._store is None or self._keys is None:
            return
        for round_number in range(max(1, self.round - 1), self.round + 1):
            try:
                self._store.set(self._keys.broken(round_number), worker.worker_id)
            except Exception as error:  # the store is the driver's own; a failure here is reported, never fatal
                print(f"shoalrun: cannot mark round {round_number} broken: {error}", file=sys.stderr, flush=True)

    def run(self) -> int:
        """Start the job, keep it going through failures and host changes, return shoalrun's exit code. In the main
        thread, a notice signal to shoalrun (SIGUSR1 by default) that the process does not handle already is a notice
        to the whole job."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            # Only signals nobody here handles yet: a program that runs the job (shoal.bench.netns) may use one.
            free = [sig for sig in self._job_notice_signals() if signal.getsignal(sig) is signal.SIG_DFL]
            previous = {sig: signal.signal(sig, self._on_job_notice) for sig in free}
        try:
            return super().run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.discovery.stop()

    def _launch(self) -> int:
        from shoal.comm.names import secret_namespace

        config = self.config
        if not self.discovery.wait_for_slots(self.min_np, config.elastic_timeout, self.cooldown.excluded()):
            return self._fail(
                f"fewer than --min-np {self.min_np} slots were available within --elastic-timeout "
                f"{config.elastic_timeout:.0f} s"
            )
        self._store_thread.join()  # the driver writes rounds into the store from the start
        if self._store_error is None:
            self._keys = ElasticKeys(secret_namespace(self.secret))
            self._fill_slots(min(self.num_proc, self.max_np))
            # Every worker started for the first round is in it, alive or not: one that already exited (a short
            # script, the others still being spawned) is then reaped as a member, finished or failed, not as a
            # newcomer that left without joining (which once ended a job of quick workers "none finished", exit 1).
            self._publish_round([w for w in self.elastic if w.state == WorkerState.STARTING])
        while True:
            interrupted = self._interrupted()  # a signal, or the store could not be hosted
            if interrupted is not None:
                return interrupted
            outcome = self._reap()
            if outcome is not None:
                if outcome != 0:
                    self.terminate_all()
                return outcome
            finished = any(w.state == WorkerState.FINISHED for w in self.elastic)
            if not finished and self._job_notice is None:
                self._check_notices()
            if not finished and self._job_notice is not None:  # nothing re-forms once the whole job has notice
                outcome = self._end_after_notice()
                if outcome is not None:
                    return outcome
            elif not finished:
                self._check_liveness()
                code = self._maybe_reform()
                if code is not None:
                    return code
            time.sleep(0.05)

    def _note_formed(self) -> bool:
        """True once the current round has formed; its members are then marked as holding the state."""
        if self._round_formed:
            return True
        if self._store is None or self._keys is None:
            return False
        state_key = self._keys.state(self.round)
        if not (self._store.check([state_key]) and self._store.get(state_key) == b"formed"):
            return False
        self._round_formed = True
        for member in self._round_members:
            member.joined = True
        if self.round > 1:
            self.resets += 1  # rounds superseded before they formed do not count against --reset-limit
        return True

    def _watch_round(self) -> None:
        """Mark members of a formed round as holding the state; end members that never arrive (wedged, partitioned)."""
        assert self._store is not None and self._keys is not None
        if self._note_formed():
            return
        # A member starting up may still be importing torch: --start-timeout on top of --elastic-timeout.
        bound = self.config.elastic_timeout + self.config.start_timeout
        now = time.monotonic()
        waited = now - self._round_published_at
        period = progress_period(bound)
        due = waited >= bound or (waited >= period and now - self._progress_said >= period)
        if not due:
            return
        missing = [
            m
            for m in self._round_members
            if m.process.returncode is None and not self._store.check([self._keys.arrival(self.round, m.worker_id)])
        ]
        if waited < bound:
            self._progress_said = now
            if missing:
                print(
                    f"shoalrun: round {self.round} waits for worker(s) {', '.join(m.worker_id for m in missing)} "
                    f"to join; {bound - waited:.0f} s left before they are ended",
                    file=sys.stderr,
                    flush=True,
                )
            return
        for member in missing:
            print(
                f"shoalrun: worker {member.worker_id} did not join round {self.round} within {bound:.0f} s "
                "(--elastic-timeout + --start-timeout); ending it",
                file=sys.stderr,
                flush=True,
            )
            member.process.signal_tree(signal.SIGKILL)
        self._round_published_at = time.monotonic()  # its exit is a failure like any other, handled by _reap

    def _maybe_reform(self) -> int | None:
        config = self.config
        self._watch_round()
        if self.discovery.dynamic or config.blacklist_cooldown_range is not None:
            self._fill_slots(self.max_np)  # static hosts come back only after a cooldown
        reason = self._wants_new_round()
        if reason is None:
            return None
        members = self._next_members()
        if any(w.joined for w in self.elastic) and not any(m.joined for m in members):
            return self._fail("every worker that held the training state is gone; newcomers cannot continue from it")
        if len(members) < self.min_np:
            now = time.monotonic()
            if self._below_min_since is None:
                self._below_min_since = now
                print(
                    f"shoalrun: {len(members)} worker(s) left, fewer than --min-np {self.min_np}; waiting up "
                    f"to --elastic-timeout {config.elastic_timeout:.0f} s for more hosts",
                    file=sys.stderr,
                    flush=True,
                )
            if now - self._below_min_since >= config.elastic_timeout:
                return self._fail(
                    f"only {len(members)} worker(s) remain, fewer than --min-np {self.min_np}, and no "
                    f"host offered more slots within --elastic-timeout {config.elastic_timeout:.0f} s"
                )
            if now - max(self._below_min_since, self._progress_said) >= progress_period(config.elastic_timeout):
                self._progress_said = now
                left = config.elastic_timeout - (now - self._below_min_since)
                cooling = self.cooldown.describe()
                print(
                    f"shoalrun: still {len(members)} worker(s), fewer than --min-np {self.min_np}; {left:.0f} s "
                    f"left for hosts to offer more{f'; cooling down: {cooling}' if cooling else ''}",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        if config.reset_limit is not None and self.resets >= config.reset_limit:
            return self._fail(f"the job needs to re-form ({reason}) but --reset-limit {config.reset_limit} is reached")
        self._below_min_since = None
        self._reset_reason = None
        self._ready_seen_at = None
        print(
            f"shoalrun: re-forming the job with {len(members)} workers ({reason}); reset {self.resets + 1}",
            file=sys.stderr,
            flush=True,
        )
        self._publish_round(members)
        return None


def _no_new_workers(hostname: str, cooldown_s: float) -> str:
    """What a failure means for its host: ``host h gets no new workers`` (for the rest of the job, or its cooldown)."""
    return f"host {hostname} gets no new workers{'' if math.isinf(cooldown_s) else f' for {cooldown_s:.0f} s'}"


def elastic_hosts(config: LaunchConfig) -> list[HostSlots]:
    """The static hosts of an elastic job (empty when a discovery script provides them)."""
    return [] if config.host_discovery_script else requested_hosts(config)
