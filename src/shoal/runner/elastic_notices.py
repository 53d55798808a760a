"""Preemption notices in an elastic job: a worker's (it leaves at its next commit, nothing rolled back) and the whole
job's (every worker leaves at its next commit and shoalrun exits 0).

A worker says it got a notice through the store (``shoal.runtime.preemption``); the whole job gets one when shoalrun
receives a notice signal other than SIGINT, SIGTERM and SIGHUP (SIGUSR1 by default), or when every member got one.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from shoal.config import LaunchConfig, worker_setting
from shoal.config.worker import parse_signal_names
from shoal.runner.elastic_worker import ElasticWorker, WorkerState
from shoal.runtime.elastic_rendezvous import ElasticKeys


class Notices:
    """What notices the job's workers and the job itself got, and the job's end after its own."""

    def __init__(self, config: LaunchConfig, verbose: Callable[[str], None]) -> None:
        self._config = config
        self._verbose = verbose
        self.job: str | None = None
        """The notice the whole job got (a signal's name), once it did: every worker leaves at its next commit."""
        self._deadline: float | None = None
        """When the workers given the job's notice must have left (set when their empty round is published)."""
        self._noticed_members: list[ElasticWorker] = []
        """The members holding the training state when the whole job got notice."""

    def signals(self) -> list[int]:
        """The notice signals shoalrun takes for the whole job: the workers' (``--preemption-signals``) except those
        that end the job at once (SIGINT, SIGTERM, SIGHUP)."""
        names = self._config.preemption_signals or str(worker_setting("preemption_signals"))
        return [n for n in parse_signal_names(names) if n not in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]

    def on_signal(self, signum: int, _frame: object) -> None:
        """shoalrun received a notice signal: the whole job has notice."""
        self.job = self.job or signal.Signals(signum).name

    def check_all(
        self, store: Any, keys: ElasticKeys, workers: list[ElasticWorker], members: list[ElasticWorker]
    ) -> str | None:
        """Note the ``workers`` that say they got a notice; the whole job has one when every member has. Returns why the
        job re-forms (a member is leaving), or None."""
        reasons = [self.check(store, keys, worker) for worker in workers]
        if self.job is None and members and all(w.leaving is not None for w in members):
            self.job = members[0].leaving  # nobody would stay: the whole job is being preempted
        return next((reason for reason in reasons if reason is not None), None)

    def check(self, store: Any, keys: ElasticKeys, worker: ElasticWorker) -> str | None:
        """Note whether ``worker`` says it got a notice; returns why the job re-forms (a member is leaving), or None."""
        key = keys.leaving(worker.worker_id)
        if worker.leaving is not None or not store.check([key]):
            return None
        worker.leaving = store.get(key).decode()
        if worker.state != WorkerState.MEMBER:
            self._verbose(f"worker {worker.worker_id} got {worker.leaving} before it joined; it leaves now")
            return None
        print(
            f"shoalrun: worker {worker.worker_id} (rank {worker.rank}) on host {worker.hostname} got {worker.leaving}; "
            "it leaves at its next commit, with nothing rolled back",
            file=sys.stderr,
            flush=True,
        )
        return f"worker {worker.worker_id} is leaving after {worker.leaving}"

    def end_after(
        self,
        members: list[ElasticWorker],
        starting: list[ElasticWorker],
        everyone: list[ElasticWorker],
        publish_empty: Callable[[], None],
        terminate_all: Callable[[], None],
    ) -> int | None:
        """Once the job has notice: publish a round without members (``publish_empty``: each worker leaves at its next
        commit), then end the job when all have left (0), or when they have not within the grace period (128 + the
        signal, after ``terminate_all``)."""
        assert self.job is not None
        now = time.monotonic()
        if self._deadline is None:
            grace_s = self._config.preemption_grace_seconds
            grace_s = float(worker_setting("preemption_grace_seconds") if grace_s is None else grace_s)
            self._deadline = now + grace_s
            # Only these hold the state: whether they leave cleanly decides the exit code (a worker still starting,
            # or a member of a round that never formed, has nothing to hand over, whatever its exit).
            self._noticed_members = [w for w in members if w.joined]
            print(
                f"shoalrun: the job got {self.job}; every worker leaves at its next commit, with nothing "
                f"rolled back, and the job ends (grace {grace_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            publish_empty()
            for worker in starting:  # newcomers hold nothing to hand over
                worker.process.signal_tree(signal.SIGTERM)
        if all(w.process.returncode is not None for w in everyone):
            failed = [w.worker_id for w in self._noticed_members if w.process.returncode != 0]
            if failed:
                print(f"shoalrun: after {self.job}, worker(s) {', '.join(failed)} failed", file=sys.stderr)
                return 1
            print(f"shoalrun: every worker left at a commit after {self.job}", file=sys.stderr, flush=True)
            return 0
        if now >= self._deadline:
            print(
                f"shoalrun: workers still running {now - self._deadline:.0f} s past the grace period after "
                f"{self.job} (--preemption-grace-seconds); ending them",
                file=sys.stderr,
                flush=True,
            )
            terminate_all()
            return 128 + signal.Signals[self.job].value
        return None

    def say_ending(self, store: Any, keys: ElasticKeys | None) -> None:
        """Tell workers given notice that the whole job ends: they exit at once rather than wait for a commit."""
        if store is not None and keys is not None:
            try:
                store.set(keys.ending, "1")
            except Exception as error:  # ending anyway; SIGKILL follows the grace period
                self._verbose(f"could not mark the job as ending: {error}")
