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

import functools
import math
import signal
import sys
import threading
import time
from typing import Any

from shoal.config import LaunchConfig
from shoal.runner.cooldown import HostCooldown
from shoal.runner.discovery import HostDiscovery
from shoal.runner.elastic_liveness import HeartbeatWatch
from shoal.runner.elastic_notices import Notices
from shoal.runner.elastic_rounds import Rounds
from shoal.runner.elastic_worker import ElasticWorker, WorkerStarter, WorkerState, alive
from shoal.runner.hosts import HostSlots, SlotInfo
from shoal.runner.launcher import Job, requested_hosts
from shoal.runner.supervise import describe_status, say_verbose
from shoal.runtime.elastic_rendezvous import ElasticKeys


class ElasticSupervisor:
    """The supervisor of a shoalrun job whose membership may change (``Job(..., supervisor=...)``; ``job_of`` builds
    that job)."""

    def __init__(self, config: LaunchConfig, static_hosts: list[HostSlots], discovery: HostDiscovery | None = None) -> None:
        """An elastic job over the static hosts (or those the discovery script prints, or ``discovery`` finds:
        shoal.ray passes Ray's nodes)."""
        if config.num_proc is None or config.min_np is None or config.max_np is None:
            raise ValueError("an elastic job needs -np, --min-np and --max-np (LaunchConfig.check() fills them in)")
        if discovery is None:
            discovery = HostDiscovery.of_script(static_hosts, config.host_discovery_script, config.slots_per_host or 1)
        discovery.start()
        self.config = config
        self.verbose = functools.partial(say_verbose, config)
        self.job: Job | None = None
        """The job it supervises, once ``launch`` runs."""
        self.num_proc, self.min_np, self.max_np = config.num_proc, config.min_np, config.max_np
        self.discovery = discovery
        self.cooldown = HostCooldown(config.blacklist_cooldown_range)
        """Hosts whose workers failed: none get new workers for the rest of the job, or until their cooldown ends."""
        self.starter = WorkerStarter(discovery, self.cooldown, self.verbose)
        self.elastic = self.starter.workers
        """Every worker the job started, in order."""
        self.rounds = Rounds(config, self.elastic, discovery, self.max_np, self.verbose)
        """The rounds of membership: the next one's members, when one is needed, and watching it form."""
        self.heartbeats = HeartbeatWatch()
        """Ends a member stopped or cut off from the store, in seconds."""
        self.notices = Notices(config, self.verbose)

    # ----- the worker set -----

    def _alive(self, *states: WorkerState) -> list[ElasticWorker]:
        return alive(self.elastic, *states)

    def job_of(self, **job_options: Any) -> Job:
        """The job this supervises; ``job_options`` go to ``Job`` (spawner, rendezvous address, store callbacks)."""
        # The hosts known now only choose the rendezvous address: hosts discovered later may be remote, so then
        # the store listens on every interface.
        known = [SlotInfo(h.hostname, 0, 1, 0, 1, 0, 1) for h in self.discovery.hosts()]
        return Job(self.config, slots=known, bind_all=self.discovery.dynamic, supervisor=self, **job_options)

    def _job(self) -> Job:
        assert self.job is not None, "launch() first"
        return self.job

    def workers_on(self, job: Job, hostnames: set[str]) -> int:
        # The machine's slots, up to --max-np: the most workers it will run at once (the job's slot list names each
        # host once, so it would say one, and every worker would take all the cores).
        return min(sum(h.slots for h in self.discovery.hosts() if h.hostname in hostnames), self.max_np)

    # ----- preemption notices -----

    def _check_notices(self) -> None:
        """Note workers that say they got a preemption notice (``shoal.runtime.preemption``)."""
        store, keys = self.rounds.store, self.rounds.keys
        if store is None or keys is None:
            return
        starting_or_member = self._alive(WorkerState.STARTING, WorkerState.MEMBER)
        reason = self.notices.check_all(store, keys, starting_or_member, self._alive(WorkerState.MEMBER))
        self.rounds.reason = self.rounds.reason or reason

    def _end_after_notice(self) -> int | None:
        """The job's end once it has notice (``Notices.end_after``)."""

        def publish_empty() -> None:
            if self.rounds.store is not None and self.rounds.keys is not None:
                self.rounds.publish([])

        members, starting = self._alive(WorkerState.MEMBER), self._alive(WorkerState.STARTING)
        return self.notices.end_after(members, starting, self.elastic, publish_empty, self._job().terminate_all)

    def ending(self, job: Job) -> None:
        """Say the job is ending: workers given notice exit at once rather than wait for a commit."""
        self.notices.say_ending(self.rounds.store, self.rounds.keys)

    # ----- supervision -----

    def _reap(self) -> int | None:
        """Note exited workers; returns a job exit code when the job is over."""
        for worker in self.elastic:
            code = worker.process.returncode
            if code is None or worker.state in (WorkerState.FINISHED, WorkerState.FAILED, WorkerState.LEFT):
                continue
            if code == 0:
                store, keys = self.rounds.store, self.rounds.keys
                if store is not None and keys is not None:  # it may have left before its notice was seen
                    self.rounds.reason = self.rounds.reason or self.notices.check(store, keys, worker)
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
            self._job().drain_output_of(worker.process)
            if given_notice:  # the round without it is out already; the others restore, as after a crash
                print(
                    f"shoalrun: worker {worker.worker_id} (rank {worker.rank}) on host {worker.hostname} "
                    f"{describe_status(code)}: it reached no commit within --preemption-grace-seconds of its "
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
                    f"{describe_status(code)} after other workers had finished; ending the job",
                    file=sys.stderr,
                    flush=True,
                )
                return 128 - code if code < 0 else code
            print(
                f"shoalrun: worker {worker.worker_id} (rank {worker.rank}) on host {worker.hostname} "
                f"{describe_status(code)}; {_no_new_workers(worker.hostname, cooldown_s)}; re-forming the job",
                file=sys.stderr,
                flush=True,
            )
            self.rounds.reason = f"worker {worker.worker_id} failed"
            self.rounds.mark_broken(worker)
        if any(w.state == WorkerState.FINISHED for w in self.elastic):
            # A short last round may have formed since the loop last looked: its members are training, not waiting.
            self.rounds.note_formed()
            members = self._alive(WorkerState.MEMBER)
            if any(w.joined for w in members):
                return None  # members holding the state are still finishing their last steps
            if members and self.rounds.number == 1 and not self.rounds.formed:
                return None  # a script that never rendezvoused (no elastic state): each worker runs to its end
            # Training is over; newcomers still waiting to join (or removed workers still leaving) are not needed.
            self.notices.say_ending(self.rounds.store, self.rounds.keys)
            for worker in self._alive(WorkerState.STARTING, WorkerState.REMOVED, WorkerState.MEMBER):
                worker.process.signal_tree(signal.SIGTERM)
            return 0
        if self.notices.job is None and self.elastic and all(w.process.returncode is not None for w in self.elastic):
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

    def launch(self, job: Job) -> int:
        """Start the job, keep it going through failures and host changes, return shoalrun's exit code. In the main
        thread, a notice signal to shoalrun (SIGUSR1 by default) that the process does not handle already is a notice
        to the whole job."""
        self.job = job
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            # Only signals nobody here handles yet: a program that runs the job (shoal.bench.netns) may use one.
            free = [sig for sig in self.notices.signals() if signal.getsignal(sig) is signal.SIG_DFL]
            previous = {sig: signal.signal(sig, self.notices.on_signal) for sig in free}
        try:
            return self._launch(job)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.discovery.stop()

    def _launch(self, job: Job) -> int:
        from shoal.comm.names import secret_namespace

        config = self.config
        if not self.discovery.wait_for_slots(self.min_np, config.elastic_timeout, self.cooldown.excluded()):
            return job.fail(
                f"fewer than --min-np {self.min_np} slots were available within --elastic-timeout "
                f"{config.elastic_timeout:.0f} s"
            )
        if job.wait_for_store():  # the driver writes rounds into the store from the start
            self.rounds.attach(job.store, ElasticKeys(secret_namespace(job.secret)))
            self.starter.fill(job, min(self.num_proc, self.max_np))
            # Every worker started for the first round is in it, alive or not: one that already exited (a short
            # script, the others still being spawned) is then reaped as a member, finished or failed, not as a
            # newcomer that left without joining (which once ended a job of quick workers "none finished", exit 1).
            self.rounds.publish([w for w in self.elastic if w.state == WorkerState.STARTING])
        while True:
            interrupted = job.interrupted()  # a signal, or the store could not be hosted
            if interrupted is not None:
                return interrupted
            outcome = self._reap()
            if outcome is not None:
                if outcome != 0:
                    job.terminate_all()
                return outcome
            finished = any(w.state == WorkerState.FINISHED for w in self.elastic)
            if not finished and self.notices.job is None:
                self._check_notices()
            if not finished and self.notices.job is not None:  # nothing re-forms once the whole job has notice
                outcome = self._end_after_notice()
                if outcome is not None:
                    return outcome
            elif not finished:
                if self.rounds.store is not None and self.rounds.keys is not None:
                    self.heartbeats.check(self.rounds.store, self.rounds.keys, self.elastic)
                code = self._maybe_reform()
                if code is not None:
                    return code
            time.sleep(0.05)

    def _maybe_reform(self) -> int | None:
        config = self.config
        self.rounds.watch()
        if self.discovery.dynamic or config.blacklist_cooldown_range is not None:
            self.starter.fill(self._job(), self.max_np)  # static hosts come back only after a cooldown
        reason = self.rounds.wanted()
        if reason is None:
            return None
        members = self.rounds.next_members()
        if any(w.joined for w in self.elastic) and not any(m.joined for m in members):
            return self._job().fail("every worker that held the training state is gone; newcomers cannot continue from it")
        if len(members) < self.min_np:
            failure = self.rounds.too_few(len(members), self.min_np, self.cooldown.describe())
            return None if failure is None else self._job().fail(failure)
        if config.reset_limit is not None and self.rounds.resets >= config.reset_limit:
            return self._job().fail(f"the job needs to re-form ({reason}) but --reset-limit {config.reset_limit} is reached")
        self.rounds.settled()
        print(
            f"shoalrun: re-forming the job with {len(members)} workers ({reason}); reset {self.rounds.resets + 1}",
            file=sys.stderr,
            flush=True,
        )
        self.rounds.publish(members)
        return None


def _no_new_workers(hostname: str, cooldown_s: float) -> str:
    """What a failure means for its host: ``host h gets no new workers`` (for the rest of the job, or its cooldown)."""
    return f"host {hostname} gets no new workers{'' if math.isinf(cooldown_s) else f' for {cooldown_s:.0f} s'}"


def elastic_hosts(config: LaunchConfig) -> list[HostSlots]:
    """The static hosts of an elastic job (empty when a discovery script provides them)."""
    return [] if config.host_discovery_script else requested_hosts(config)
