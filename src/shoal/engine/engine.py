"""The background engine: the request queue, the hand-off between callers and the engine thread, and the thread.

What each cycle does is ``shoal.engine.cycle``; the groups and paths it runs on are ``shoal.engine.transport``; the
collectives themselves are ``shoal.engine.executor``. A rank with nothing to do sleeps until work arrives or
``idle_cycle_time_ms`` passes, so idle engines cost almost nothing, and a busy one never spins: its cycle blocks in
the collective until the others arrive.

Two shortcuts keep the order of collectives the same on every rank: a cached set that repeats is sent with its
readiness in one round (``shoal.engine.one_round``), and a thread blocked on its own call runs the cycles itself
while no other thread does (``Engine.drive``). One thread at a time runs cycles.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal

from shoal.comm import process_group
from shoal.comm.hierarchical import HierarchicalAllreduce
from shoal.engine import exit_guard
from shoal.engine.config import EngineConfig
from shoal.engine.cycle import Cycle, Pauses
from shoal.engine.executor import Executor
from shoal.engine.inbox import EngineStoppedError, Inbox, Key
from shoal.engine.request import Kind, Request
from shoal.engine.stall import CollectiveWatch
from shoal.engine.timeline import Timeline, open_timeline
from shoal.engine.transport import ArenaSite, Transport  # ArenaSite: re-exported
from shoal.engine.validation import check_request
from shoal.log import get_logger
from shoal.runtime.topology import Topology

if TYPE_CHECKING:
    from shoal.engine.autotune import TunedSettings

ABANDONED_STOP_S = 2.0
"""How long ``stop`` waits for the engine thread once the engine was abandoned (its collective may never return)."""


class Engine:
    """One per process: owns the request queue and the thread that issues every collective."""

    def __init__(
        self,
        topology: Topology,
        config: EngineConfig,
        store: Any = None,
        job: str = "nojob",
        callers_drive: bool = True,
        connect_timeout_s: float | None = None,
    ) -> None:
        """``callers_drive``: a thread blocked on its own call may run cycles itself (``drive``); False: only the engine
        thread ever waits inside a collective, so ``abandon`` always frees the callers (an elastic worker, whose peer
        may vanish while holding its connections open). ``connect_timeout_s``: how long creating the engine's groups
        may wait for a member's connection (``Transport``)."""
        self.rank, self.size = topology.rank, topology.size
        self.config = config
        self._watch = CollectiveWatch(
            self.rank,
            config.stall_check_time_s,
            config.stall_shutdown_time_s,
            config.transport_timeout_s,
            self.abandon,
            config.stall_check_disabled,
        )
        try:
            self.transport = Transport(topology, config, store, job, self._watch, connect_timeout_s)
        except BaseException:
            self._watch.stop()
            raise
        self.timeline: Timeline | None = None
        if config.timeline_path:
            self.timeline = open_timeline(config.timeline_path, self.rank, config.timeline_mark_cycles)
        self._executor = Executor(self.transport, lambda: self.timeline)
        self._inbox = Inbox()
        self._lock = self._inbox.lock
        self.cycle = Cycle(config, self.transport, self._executor, self._inbox, lambda: self.timeline)
        """The protocol every rank runs in lockstep (``cycle.py``): pending requests, the response cache, the bit
        vector, negotiation; ``cycle.run()`` is one cycle."""
        self._driver: Literal["engine", "caller"] | None = None
        """Who runs cycles now: "engine" (its thread), "caller" (a thread blocked on its own call), None; under _lock."""
        self._callers_drive = callers_drive
        self._abandoned = False
        """``abandon`` was called: the collectives in flight may never return."""
        self._ended = False
        """A cycle failed or gave a stop verdict: no thread runs another; the engine thread releases the connections."""
        self.caller_cycles = 0
        """Cycles run by a thread blocked on its own call rather than by the engine thread (``drive``)."""
        self.pauses = Pauses()  # the engine thread's (its quiet_after: fewer with local steps)
        self._thread = threading.Thread(target=self._run, name="shoal-engine", daemon=True)
        self._thread.start()

    # ----- user-thread side -----

    def submit(self, requests: list[Request], wake: bool = True) -> None:
        """Queue requests together (a grouped call lands in one cycle, hence one fused buffer).

        Every request is checked here, on the caller's thread, before any is queued. ``wake=False``: the caller
        goes on to ``drive`` them itself, so the engine thread is not woken for them.

        Raises:
            TypeError: a dtype the engine cannot carry, or an op not defined for it (nothing is queued then).
            ValueError: a name already in flight, an unsupported device or op (nothing is queued then).
            EngineStoppedError: the engine has stopped.
        """
        for request in requests:
            if not request.checked:
                check_request(request.meta)
        self._inbox.put(requests, wake or not self._callers_drive)
        timeline = self.timeline
        if timeline is not None:
            for request in requests:
                timeline.begin(request.meta.name, f"NEGOTIATE_{request.meta.kind.value.upper()}")

    @property
    def autotune_frozen(self) -> bool | None:
        """None without autotune; else whether the best setting has been frozen (on this rank's engine)."""
        autotune = self.cycle.autotune
        return None if autotune is None else autotune.frozen

    @property
    def tuned(self) -> TunedSettings:
        """The settings in force: ``config``'s until autotune applies its own (its ``bucket_bytes``, for the
        optimizer's gradient buckets, is None until then: the optimizer keeps its own)."""
        return self.cycle.tuned

    @property
    def collective_calls(self) -> int:
        """Data collectives issued so far (a fused buffer counts once)."""
        return self._executor.collective_calls

    @property
    def one_round_cycles(self) -> int:
        """Cycles that sent a cached set's readiness with its data (``shoal.engine.one_round``)."""
        return self.cycle.one_round_cycles

    @property
    def hierarchical(self) -> HierarchicalAllreduce | None:
        """The shared-memory (hierarchical) allreduce, or None (``Transport.hierarchical``)."""
        return self.transport.hierarchical

    @property
    def _pending(self) -> dict[Key, Request]:
        return self.cycle.pending

    def execution(self, name: str, process_set: int = 0) -> tuple[float, int, int] | None:
        """The last execution of request ``name``: (its share by size of its batch's seconds, its elements, the
        fused batch's elements); None before it ran."""
        return self._executor.executions.get((process_set, name))

    def stop(self, timeout_s: float | None = None) -> bool:
        """Ask every rank's engine to stop, fail what is pending, and wait for the thread to end.

        Args:
            timeout_s: how long to wait for the thread; by default a little longer than the transport timeout,
                since every wait of the engine thread is bounded by it (``ABANDONED_STOP_S`` once abandoned).

        Returns:
            False when the thread is still running (inside a collective): its groups must not be destroyed then;
            True all the same for an abandoned gloo-only engine, so that the next ``init()`` can make a new world
            (the thread waits on until its peer's connections close or the transport timeout, then ends).
        """
        with self._lock:
            self._inbox.shutdown_requested = True
            self._lock.notify_all()
        if timeout_s is None:
            timeout_s = ABANDONED_STOP_S if self._abandoned else self.config.transport_timeout_s + 30.0
        self._thread.join(timeout_s)
        self._watch.stop()
        if self._thread.is_alive() and self._abandoned and not process_group.world_uses_nccl():
            get_logger().warning("Shoal's engine thread is still inside a collective of the abandoned job; its groups go")
            exit_guard.arm(self._thread)  # the process must not finalize under it (shoal.engine.exit_guard)
            self.stop_timeline()
            return True
        if self._thread.is_alive():
            get_logger().error("Shoal's engine thread did not stop; its process group is left open")
            self._fail_everything(EngineStoppedError("Shoal's engine did not stop in time; pending requests failed"))
            return False
        self.stop_timeline()
        return True

    def abandon(self, message: str) -> None:
        """Fail every pending request and stop, from outside the engine thread: the collective watch's verdict (as
        the in-cycle inspector's), or a peer lost for good (an elastic round broken). A thread blocked in a
        collective stops at its next cycle or at the transport's timeout; ``stop`` then waits for it only briefly."""
        get_logger().error("%s", message)
        with self._lock:
            self._inbox.shutdown_requested = True
            self._abandoned = True
        self._fail_everything(EngineStoppedError(message))

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Start writing a timeline at run time (replacing any current one)."""
        self._swap_timeline(open_timeline(path, self.rank, mark_cycles))

    def stop_timeline(self) -> None:
        """Stop writing the timeline and close its file."""
        self._swap_timeline(None)

    def _swap_timeline(self, new: Timeline | None) -> None:
        """Every reader takes ``self.timeline`` once into a local, and a closed timeline ignores further events, so
        the engine thread never sees it vanish between a check and a use."""
        with self._lock:
            old, self.timeline = self.timeline, new
        if old is not None:
            old.close()

    # ----- engine-thread side -----

    def _run(self) -> None:
        while self._claim(self.pauses):
            progress = self._drive_one_cycle()
            if progress is None:
                break
            self.pauses.after(progress, bool(self._pending))
        self.transport.release()
        self._watch.stop()

    def _claim(self, pauses: Pauses) -> bool:
        """Engine thread: sleep until there is work (or the idle period passed) and no caller is running cycles,
        then take the drive; False once the engine has ended."""
        timed_out = False
        with self._lock:
            while not self._ended:
                if self._driver is None and (self._inbox.queue or self._inbox.shutdown_requested or timed_out):
                    self._driver = "engine"
                    return True
                timed_out = not self._inbox.sleep(self._wait_ms(pauses) / 1000.0)
        return False

    def _drive_one_cycle(self) -> bool | None:
        """Run one cycle as the driver, then give up the drive: whether it completed anything, or None when the
        engine ended in it (a stop verdict, or a failed collective)."""
        try:
            progress, stop = self.cycle.run()
            if stop is None:
                return progress
            self._fail_everything(stop)
        except BaseException as error:  # a collective failed (a peer died, a timeout): fail loudly, never hang
            get_logger().error("engine stopped after an error: %s", error)
            self._fail_everything(EngineStoppedError(f"Shoal's engine failed: {error}"))
        finally:
            with self._lock:
                driver, self._driver = self._driver, None
                if driver == "engine":
                    self._lock.notify_all()  # a caller pausing between its own cycles may find its requests done
        with self._lock:
            self._ended = True
            self._lock.notify_all()  # the engine thread, wherever it waits, ends and releases the connections
        return None

    def drive(self, requests: list[Request]) -> None:
        """Run cycles on the calling thread until ``requests`` are done, while no other thread runs them.

        A blocking call then costs no hand-off to the engine thread and back. Returns early when the engine thread
        is in a cycle or takes over (it carries these requests then) and when the engine ends; the caller waits on
        the requests either way. Cycles run exactly as on the engine thread, one driver at a time.
        """
        if not self._callers_drive:
            return
        pauses = Pauses()
        try:
            while not all(request.done.is_set() for request in requests):
                with self._lock:
                    if self._driver is not None or self._ended:
                        return
                    self._driver = "caller"
                self.caller_cycles += 1
                progress = self._drive_one_cycle()
                if progress is None:
                    return
                pauses.after(progress, pending=True)
                if not progress:
                    with self._lock:
                        if not self._inbox.queue and not self._inbox.shutdown_requested:
                            self._inbox.sleep(self._wait_ms(pauses) / 1000.0)
        finally:
            with self._lock:
                if self._inbox.queue or self._pending or self._inbox.shutdown_requested:
                    self._lock.notify_all()  # the engine thread carries what is left

    def _wait_ms(self, pauses: Pauses) -> float:
        return pauses.ms(self.config, self.cycle.tuned.cycle_time_ms, bool(self._pending))

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            requests = self.cycle.drop_pending() + self._inbox.drain(error)
        for request in requests:
            request.fail(error)


__all__ = ["ArenaSite", "Engine", "EngineStoppedError", "Kind"]
