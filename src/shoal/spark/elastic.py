"""``shoal.spark.run_elastic``: Shoal's elastic driver (the one behind ``shoalrun --min-np``) with Spark tasks as
its slots.

The driver submits one Spark job of one task per slot, up to ``max_num_proc``; each task registers its host in the
job's store and runs the workers the driver gives it (``shoal.spark._slot``). The slots the store knows, by host,
are the elastic driver's host discovery. A slot that dies (executor lost, Python worker killed) fails only its own
Spark job: its worker dies with it, the others roll back to their last commit, and the driver submits a new slot,
which Spark places wherever it has a free core (an executor that joined, or the one that lost its task). Its worker
joins at the survivors' next ``state.commit()``.
"""

from __future__ import annotations

import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, cast

from shoal.config import LaunchConfig
from shoal.runner.discovery import HostDiscovery
from shoal.runner.elastic_driver import ElasticSupervisor
from shoal.runner.function_job import FunctionJob
from shoal.runner.hosts import HostSlots
from shoal.runner.spawners import LaunchError, PolledProcess, Spawner, Worker, WorkerSpec
from shoal.runner.task import task_prefix
from shoal.spark._slot import END_KEY, signal_number, slot_key
from shoal.spark._task import TaskSettings

__all__ = ["run_elastic"]

COOLDOWN_RANGE = (1.0, 10.0)
"""Seconds before a host whose worker failed gets a new one (growing with its failures): on Spark the replacement
of a lost task often lands on the same host, so a host is never excluded for the rest of the job."""
RESUBMIT_DELAY_S = 1.0


class SparkSlots:
    """The slots (Spark tasks) that registered in the store and still run, as hosts with that many slots."""

    def __init__(self, context: Any, group: str, wanted: int, verbose: bool) -> None:
        self._context, self._group, self._wanted, self._verbose_on = context, group, wanted, verbose
        self._view: Any = None
        self._settings: TaskSettings | None = None
        self._submitted = 0
        self._resubmits_left = 4 * wanted
        self.hosts_of: dict[int, str] = {}
        self.dead: set[int] = set()
        self.busy: set[int] = set()
        self.commands: dict[int, int] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._ending = False
        self._slot_lock = threading.Lock()
        self.last_error = ""
        """The last Spark error of a slot's job (its first informative line), for the job's failure message."""

    def begin(self, view: Any, settings: TaskSettings) -> None:
        """Submit the first ``wanted`` slots (once the store exists)."""
        self._view, self._settings = view, settings
        for _ in range(self._wanted):
            self._submit()

    def _submit(self) -> None:
        with self._slot_lock:
            if self._ending:  # checked under the lock: no slot job may start after end() cancelled them
                return
            slot = self._submitted
            self._submitted += 1
            thread = threading.Thread(target=self._slot_job, args=(slot,), name=f"shoal-spark-slot-{slot}", daemon=True)
            self._threads[slot] = thread
        thread.start()

    def _slot_job(self, slot: int) -> None:
        """One slot's Spark job; when it fails while the job goes on, a new slot replaces it."""
        from shoal.spark._slot import run_slot

        settings = self._settings
        assert settings is not None
        self._context.setJobGroup(self._group, f"shoal.spark.run_elastic: slot {slot}", interruptOnCancel=True)
        error: BaseException | None = None
        try:
            self._context.parallelize([slot], 1).mapPartitions(lambda _: run_slot(settings, slot)).collect()
        except BaseException as failure:
            error = failure
        with self._slot_lock:
            self.dead.add(slot)
            if self._ending:
                return
        if error is not None:
            from shoal.spark import _first_line

            self.last_error = _first_line(error)
            print(f"shoal.spark.run_elastic: Spark slot {slot} failed: {self.last_error}", file=sys.stderr, flush=True)
        elif self._verbose_on:
            print(f"shoal.spark.run_elastic: Spark slot {slot} ended", file=sys.stderr, flush=True)
        if self._resubmits_left <= 0:
            print(
                f"shoal.spark.run_elastic: {4 * self._wanted} Spark slots were replaced already; no more are asked for",
                file=sys.stderr,
                flush=True,
            )
            return
        self._resubmits_left -= 1
        time.sleep(RESUBMIT_DELAY_S)
        self._submit()

    def poll(self) -> list[HostSlots]:
        """Register the slots that announced their host since the last poll; the slots known now (the elastic job's
        ``HostDiscovery`` source)."""
        if self._view is None:
            return []
        if self._ending:  # the store may be closing: the slots as they stand
            return self.hosts()
        with self._slot_lock:
            unregistered = [slot for slot in range(self._submitted) if slot not in self.hosts_of]
        found = {
            slot: self._view.get(slot_key(slot, "host")).decode()
            for slot in unregistered
            if self._view.check([slot_key(slot, "host")])
        }
        with self._slot_lock:
            self.hosts_of.update(found)
        # A dead slot counts until the driver has seen its worker's end (hosts()): otherwise the host would offer
        # fewer slots than it has workers for a moment, and the driver would remove a healthy one.
        return self.hosts()

    def hosts(self) -> list[HostSlots]:
        """The slots known now: registrations as of the last poll, deaths as they happen (so that the driver never
        starts a worker for a slot that died since the poll)."""
        counts: dict[str, int] = {}
        with self._slot_lock:
            for slot, host in self.hosts_of.items():
                if slot not in self.dead or slot in self.busy:
                    counts[host] = counts.get(host, 0) + 1
        return [HostSlots(host, count) for host, count in sorted(counts.items())]

    def take(self, hostname: str) -> int:
        """A registered, live slot on ``hostname`` with no worker; it is busy until its worker exits."""
        with self._slot_lock:
            for slot, host in sorted(self.hosts_of.items()):
                if host == hostname and slot not in self.dead and slot not in self.busy:
                    self.busy.add(slot)
                    return slot
        raise LaunchError(f"shoal.spark.run_elastic: no free Spark slot on {hostname}")

    def release(self, slot: int) -> None:
        with self._slot_lock:
            self.busy.discard(slot)
            self.commands[slot] = self.commands.get(slot, 0) + 1

    def is_dead(self, slot: int) -> bool:
        with self._slot_lock:
            return slot in self.dead

    def finish(self, wait_s: float = 5.0) -> None:
        """Tell every slot to end (while the store is still up), and give the running ones ``wait_s`` to do so."""
        self._ending = True  # no more polls of the store (see poll)
        if self._view is None:
            return
        self._view.set(END_KEY, b"1")
        deadline = time.monotonic() + wait_s
        with self._slot_lock:
            running = [thread for slot, thread in self._threads.items() if slot in self.hosts_of]
        for thread in running:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def end(self, wait_s: float = 30.0) -> None:
        """Cancel the slots' Spark jobs that are left (slots Spark never started, or the job failed)."""
        self._ending = True  # no more polls of the store (see poll)
        self._context.cancelJobGroup(self._group)
        deadline = time.monotonic() + wait_s
        with self._slot_lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


class SlotProcess(PolledProcess):
    """What the elastic driver needs of a ``Popen``, for a worker run by a slot."""

    def __init__(self, view: Any, slots: SparkSlots, slot: int, index: int) -> None:
        self._view, self._slots, self.slot, self.index = view, slots, slot, index
        self.stdin = None
        self.returncode: int | None = None
        self._checked = 0.0

    def poll(self) -> int | None:
        """The worker's exit code once the slot reported it; -9 when the slot itself died."""
        if self.returncode is not None or time.monotonic() - self._checked < 0.05:
            return self.returncode
        self._checked = time.monotonic()
        exit_key = slot_key(self.slot, "exit", self.index)
        if self._view.check([exit_key]):
            self.returncode = int(self._view.get(exit_key))
            self._slots.release(self.slot)
        elif self._slots.is_dead(self.slot):
            self.returncode = -int(signal.SIGKILL)
            self._slots.release(self.slot)
        return self.returncode

    def send(self, sig: int) -> None:
        if self.poll() is not None:
            return
        count = int(self._view.add(slot_key(self.slot, "sigs", self.index), 0))
        self._view.set(slot_key(self.slot, "sig", self.index, count), signal_number(sig))
        self._view.add(slot_key(self.slot, "sigs", self.index), 1)


@dataclass
class SlotWorker(Worker):
    """A worker run by a Spark slot: signals go through the store to the slot, which signals the worker's group."""

    def signal_tree(self, sig: int) -> None:
        cast(SlotProcess, self.process).send(sig)


class SparkSlotSpawner(Spawner):
    """Runs each worker of an elastic job in a free Spark slot (``SparkSlots``), by writing its command into the
    store; ``output`` gives the job's output streams once the store is up (the ``_Output`` whose ranks to follow),
    or None."""

    def __init__(self, slots: SparkSlots, output: Callable[[], Any]) -> None:
        self._slots = slots
        self._output = output

    def remote(self, hostname: str) -> bool:
        return True  # an executor may be on any machine: it reaches the store over the network

    def spawn(self, spec: WorkerSpec) -> Worker:
        store = self.job.store
        assert store is not None, "the elastic driver starts workers once its store is up"
        view = store.with_prefix(task_prefix(self.job.secret))
        chosen = self._slots.take(spec.slot.hostname)
        index = self._slots.commands.get(chosen, 0)
        view.set(slot_key(chosen, "cmd", index), pickle.dumps((spec.slot.rank, spec.env)))
        output = self._output()
        if output is not None:
            output.watch(spec.slot.rank)
        self.job.verbose(f"worker [{spec.slot.rank}] in Spark slot {chosen} on {spec.slot.hostname}")
        return SlotWorker(slot=spec.slot, process=cast(Any, SlotProcess(view, self._slots, chosen, index)))


def run_elastic(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: Mapping[str, str | None] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    nics: Sequence[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Train ``fn(*args, **kwargs)`` elastically on Spark; the results of the last round's workers, in rank order.

    Horovod's ``horovod.spark.run_elastic``. ``fn`` is an elastic training function, as under ``shoalrun
    --min-np``: ``hvd.init()``, an ``hvd.elastic.TorchState`` and a function decorated with ``@hvd.elastic.run``.

    Args:
        fn, args, kwargs: the training function and its arguments (the same on every worker).
        num_proc: workers to start with; default ``spark.default.parallelism``.
        min_num_proc: the fewest workers to train with (default ``num_proc``); ``min_np`` is the same.
        max_num_proc: the most (default ``num_proc``): as many Spark slots are asked for; ``max_np`` is the same.
        start_timeout: seconds for a worker to start and reach the store; default as ``run``.
        elastic_timeout: seconds to wait for ``min_num_proc`` slots, at the start and after a failure (default
            the ``ELASTIC_TIMEOUT`` setting, 600).
        reset_limit: how many times the job may re-form (default unlimited).
        env, stdout, stderr, verbose, nics, prefix_output_with_timestamp: as for ``run``.

    Raises:
        RuntimeError: the job failed (fewer than ``min_num_proc`` slots for ``elastic_timeout``, the reset limit,
            every worker raising: the tracebacks and the last Spark slot error are in the message), or no
            SparkContext is active. A worker that raised but was recovered from, in a job that finished, is printed.
        ValueError: the counts are not ``1 <= min <= num_proc <= max``.
    """
    from shoal.spark import _driver_address, _Output, _spark_context, _start_timeout

    context = _spark_context()
    num_proc = int(num_proc or context.defaultParallelism)
    low = int(min_num_proc or min_np or num_proc)
    high = int(max_num_proc or max_np or num_proc)
    if not 1 <= low <= num_proc <= high:
        raise ValueError(
            f"shoal.spark.run_elastic: need 1 <= min_num_proc <= num_proc <= max_num_proc, got {low}, {num_proc}, {high}"
        )
    config = _config(num_proc, low, high, reset_limit, elastic_timeout, _start_timeout(start_timeout), verbose)
    if verbose >= 1:
        print(f"shoal.spark.run_elastic: {num_proc} processes ({low} to {high})", file=sys.stderr, flush=True)
    function = FunctionJob("shoal.spark.run_elastic", fn, args, kwargs)
    group = f"shoal.spark.run_elastic.{time.time_ns()}"
    slots = SparkSlots(context, group, high, verbose >= 2)
    sinks = {name: sink for name, sink in (("stdout", stdout), ("stderr", stderr)) if sink is not None}
    output: _Output | None = None

    def publish(store: Any) -> None:
        nonlocal output
        view = function.publish(store, job.secret)
        if sinks:
            output = _Output(view, 0, sinks, prefix_output_with_timestamp)
        settings = TaskSettings(
            job.rendezvous_addr, job.rendezvous_port, job.secret, config.start_timeout, dict(env or {}),
            stream_output=bool(sinks), executable=None,
        )  # fmt: skip
        slots.begin(view, settings)

    def collect(store: Any) -> None:
        if output is not None:
            output.drain()
        function.take_workers(function.view(store, job.secret), [worker.worker_id for worker in supervisor.elastic])
        slots.finish()

    supervisor = ElasticSupervisor(config, [], discovery=HostDiscovery([], slots.poll, interval_s=0.2, live=slots.hosts))
    job = supervisor.job_of(
        spawner=SparkSlotSpawner(slots, lambda: output),
        rendezvous_addr=_driver_address(context, nics),
        on_store=publish,
        on_finish=collect,
    )
    drainer = _Drainer(lambda: output)
    try:
        drainer.start()
        code = job.run()
    finally:
        drainer.stop()
        slots.end()
    last = f"\nthe last Spark slot error: {slots.last_error}" if slots.last_error else ""
    return function.of_finished(code, supervisor.elastic, last)


def _config(
    num_proc: int, low: int, high: int, reset_limit: int | None, elastic_timeout: float | None, start: float, verbose: int
) -> LaunchConfig:
    config = LaunchConfig(
        num_proc=num_proc,
        min_np=low,
        max_np=high,
        reset_limit=reset_limit,
        start_timeout=start,
        verbose=verbose >= 2,
        blacklist_cooldown_range=COOLDOWN_RANGE,
        command=["python", "-m", "shoal.runner.task"],
    )
    if elastic_timeout is not None:
        config.elastic_timeout = float(elastic_timeout)
    config.check()
    return config


class _Drainer:
    """Streams the workers' output to the driver's sinks while the job runs."""

    def __init__(self, output: Callable[[], Any]) -> None:
        self._output = output
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shoal-spark-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            output = self._output()
            if output is not None:
                try:
                    output.drain()
                except Exception:  # the store closed as the job ended: collect() drained what was left
                    return
