"""The background engine thread and its cycle.

Each cycle, on every rank, in lockstep:

1. take newly submitted requests; those whose signature is in the response cache just set their bit;
2. one small allreduce (bitwise AND) of the bit vector plus three flags: "nothing new", "no stall", "no shutdown";
3. only if some rank has new (uncached) requests: one allgather of their metadata, after which every rank runs
   the coordinator's checks on the same data and derives the same responses (or the same mismatch errors);
4. fuse the responses and execute them in the agreed order; completed handles wake their waiters.

A rank with nothing to do sleeps until work arrives or ``idle_cycle_time_ms`` passes, so idle engines cost almost
nothing, and a busy one never spins: its cycle blocks in the collective until the others arrive.

Two shortcuts keep the order of collectives the same on every rank: a cached set that repeats is sent with its
readiness in one round (``shoal.engine.one_round``), and a thread blocked on its own call runs the cycles itself
while no other thread does (``Engine.drive``). One thread at a time runs cycles.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from shoal.comm import collectives
from shoal.comm.hierarchical import HierarchicalAllreduce, build_cross_groups
from shoal.comm.names import host_tag
from shoal.comm.shared_arena import SharedArena
from shoal.comm.shm import create_local_group
from shoal.engine.autotune import SETTINGS_WIRE_LENGTH, AutotuneConfig, Autotuner, TunedSettings, import_optuna
from shoal.engine.config import EngineConfig
from shoal.engine.executor import Executor, ProcessSetState
from shoal.engine.fusion import plan_batches
from shoal.engine.negotiation import MessageTable, Response
from shoal.engine.one_round import OneRound
from shoal.engine.request import DATA_KINDS, Kind, Request, RequestMeta
from shoal.engine.response_cache import ResponseCache
from shoal.engine.stall import CollectiveWatch, StallInspector
from shoal.engine.timeline import Timeline
from shoal.engine.validation import check_request
from shoal.engine.wire_format import decode_requests, decode_stall_report, encode_requests, encode_stall_report
from shoal.exceptions import HorovodInternalError
from shoal.log import get_logger
from shoal.runtime.topology import Topology

_FLAG_NOTHING_NEW, _FLAG_NO_STALL, _FLAG_NO_SHUTDOWN = 1, 2, 4
_ALL_FLAGS = _FLAG_NOTHING_NEW | _FLAG_NO_STALL | _FLAG_NO_SHUTDOWN
_WORD_MASK = (1 << 63) - 1
"""63 bits per int64 word, so that no word is negative and every bit means one cache id."""


@dataclass(frozen=True)
class ArenaSite:
    """What a rank needs to create and check its host's shared-memory arenas."""

    token: str
    """The job's part of segment names."""
    host: str
    """The host's part of segment names."""
    local_rank: int
    local_size: int


class EngineStoppedError(HorovodInternalError):
    """The engine is no longer running (shut down, or failed); no new request can be served."""


class Engine:
    """One per process: owns the request queue and the thread that issues every collective."""

    def __init__(self, topology: Topology, config: EngineConfig, store: Any = None, job: str = "nojob") -> None:
        self.rank = rank = topology.rank
        self.size = size = topology.size
        self.config = config
        # The engine owns a group of its own, so that the user's own torch.distributed calls on the default group
        # (DDP, a raw all_reduce) never interleave with the engine's collectives on the same connections.
        # Every group gets an explicit timeout (torch's default is 30 minutes); see EngineConfig.collective_timeout_s.
        self._world: Any = collectives.new_group(list(range(size)), config.transport_timeout_s)
        self._job = job
        self._host = host_tag(topology.host_of_rank[rank])
        self.hierarchical = self._setup_hierarchical(topology, store, job)
        self.process_sets: dict[int, ProcessSetState] = {0: ProcessSetState(tuple(range(size)), self._world)}
        self.timeline: Timeline | None = None
        if config.timeline_path:
            self.timeline = self._open_timeline(config.timeline_path, config.timeline_mark_cycles)
        self._watch = CollectiveWatch(
            rank,
            config.stall_check_time_s,
            config.stall_shutdown_time_s,
            config.transport_timeout_s,
            self._stall_shutdown,
            config.stall_check_disabled,
        )
        self._executor = Executor(
            rank, self.process_sets, lambda: self.timeline, self.hierarchical, self._watch, config.transport_timeout_s
        )
        self._cache_enabled = config.cache_capacity > 0
        """False with no cache, or while autotune has it off; implies a capacity > 0 when True."""
        self.tuned_bucket_bytes: int | None = None
        """The optimizer's gradient bucket chosen by autotune; None: the optimizer's own."""
        self._autotune: Autotuner | None = None
        if config.autotune:
            import_optuna()  # every rank, so that a missing optuna fails init everywhere alike
            settings = TunedSettings(config.fusion_threshold_bytes, config.cycle_time_ms, None, self._cache_enabled)
            tuning = AutotuneConfig(
                config.autotune_log_file,
                config.autotune_warmup_samples,
                config.autotune_steps_per_sample,
                config.autotune_max_samples,
                config.autotune_gaussian_process_noise,
            )
            self._autotune = Autotuner(tuning, rank, self.hierarchical is not None, settings)
        self._cache = ResponseCache(config.cache_capacity, rank)
        self._bit_words = (config.cache_capacity + 62) // 63
        self._table = MessageTable(size)
        self._stall = StallInspector(
            config.stall_check_time_s, config.stall_shutdown_time_s, disabled=config.stall_check_disabled
        )
        self._lock = threading.Condition()
        self._queue: list[Request] = []
        self._in_flight: set[tuple[int, str]] = set()
        self._pending: dict[tuple[int, str], Request] = {}
        self._pending_cached: dict[tuple[int, str], int] = {}
        self._to_send: list[RequestMeta] = []
        self._shutdown_requested = False
        self._stopped: BaseException | None = None
        self._driver: str | None = None
        """Who runs cycles now: "engine" (its thread), "caller" (a thread blocked on its own call), None; under _lock."""
        self._ended = False
        """A cycle failed or gave a stop verdict: no thread runs another; the engine thread releases the connections."""
        self._one_round = OneRound(config.one_round_cycles and self._cache_enabled, size)
        self.cycles = 0
        self.one_round_cycles = 0
        """Cycles that sent a cached set's readiness with its data (``shoal.engine.one_round``)."""
        self.caller_cycles = 0
        """Cycles run by a thread blocked on its own call rather than by the engine thread (``drive``)."""
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
        keys = [(request.meta.process_set, request.meta.name) for request in requests]
        with self._lock:
            if self._stopped is not None:
                raise EngineStoppedError(f"Shoal's engine is not running: {self._stopped}")
            for request, key in zip(requests, keys, strict=True):
                if key in self._in_flight or keys.count(key) > 1:
                    raise ValueError(
                        f"a request named '{request.meta.name}' is already in flight; names of outstanding "
                        "requests must be unique (wait for it with synchronize(), or pass a different name=)"
                    )
            self._in_flight.update(keys)
            self._queue.extend(requests)
            if wake:
                self._lock.notify_all()
        timeline = self.timeline
        if timeline is not None:
            for request in requests:
                timeline.begin(request.meta.name, f"NEGOTIATE_{request.meta.kind.value.upper()}")

    @property
    def autotune_frozen(self) -> bool | None:
        """None without autotune; else whether the best setting has been frozen (on this rank's engine)."""
        return None if self._autotune is None else self._autotune.frozen

    @property
    def collective_calls(self) -> int:
        """Data collectives issued so far (a fused buffer counts once)."""
        return self._executor.collective_calls

    def execution(self, name: str, process_set: int = 0) -> tuple[float, int, int] | None:
        """The last execution of request ``name``: (its share by size of its batch's seconds, its elements, the
        fused batch's elements); None before it ran."""
        return self._executor.executions.get((process_set, name))

    def arena_site(self) -> ArenaSite | None:
        """Where this rank's shared-memory arenas live (``shoal.comm.shared_arena``); None when the engine reduces
        without shared memory (one rank per host, hierarchical allreduce off or unavailable). Agreed by all ranks."""
        if self.hierarchical is None:
            return None
        local = self.hierarchical.local
        return ArenaSite(self._job, self._host, local.local_rank, local.local_size)

    def register_arena(self, key: str, arena: SharedArena) -> None:
        """From now on, allreduces that name ``key`` in ``RequestMeta.shared`` are ranges of ``arena``."""
        if key in self._executor.arenas:
            raise ValueError(f"shared arena {key!r} is already registered")
        self._executor.arenas[key] = arena

    def stop(self, timeout_s: float | None = None) -> bool:
        """Ask every rank's engine to stop, fail what is pending, and wait for the thread to end.

        Args:
            timeout_s: how long to wait for the thread; by default a little longer than the transport timeout,
                since every wait of the engine thread is bounded by it.

        Returns:
            False when the thread is still running (inside a collective): its groups must not be destroyed then.
        """
        with self._lock:
            self._shutdown_requested = True
            self._lock.notify_all()
        self._thread.join(self.config.transport_timeout_s + 30.0 if timeout_s is None else timeout_s)
        self._watch.stop()
        if self._thread.is_alive():
            get_logger().error("Shoal's engine thread did not stop; its process group is left open")
            self._fail_everything(EngineStoppedError("Shoal's engine did not stop in time; pending requests failed"))
            return False
        self.stop_timeline()
        return True

    def _stall_shutdown(self, message: str) -> None:
        """The collective watch's verdict, as the in-cycle inspector's: fail every pending request and stop (the
        blocked thread stops at its next cycle, or at the transport timeout)."""
        get_logger().error("%s", message)
        with self._lock:
            self._shutdown_requested = True
        self._fail_everything(EngineStoppedError(message))

    def _setup_hierarchical(self, topology: Topology, store: Any, job: str) -> HierarchicalAllreduce | None:
        """Shared memory within hosts when asked for (or by default when a host has several ranks), agreed by all."""
        wanted = self.config.hierarchical_allreduce
        if wanted is False or topology.local_size == 1 or store is None:
            return None
        if not topology.is_homogeneous:
            if self.rank == 0:
                get_logger().warning("hierarchical allreduce needs the same number of ranks on every host; using gloo")
            return None
        local = create_local_group(
            store,
            topology.local_rank,
            topology.local_size,
            topology.host_of_rank[self.rank],
            job,
            self.config.shm_slot_bytes,
            self.config.transport_timeout_s,
        )
        # Every host must take the same path, or the collectives would not pair up.
        available = torch.tensor([1 if local is not None else 0], dtype=torch.int64)
        collectives.allreduce_(available, "min", self._world)
        everywhere = bool(available.item())
        if not everywhere:
            if local is not None:
                local.close()
            return None
        cross_group = None
        if topology.cross_size > 1:
            cross_group = build_cross_groups(topology.local_rank_of_rank, topology.local_size, self.config.transport_timeout_s)[
                topology.local_rank
            ]
        assert local is not None
        return HierarchicalAllreduce(local, cross_group, topology.cross_size)

    def _open_timeline(self, path: str, mark_cycles: bool) -> Timeline | None:
        """As in Horovod, rank 0 writes the timeline; a path containing ``{rank}`` gives every rank its own file."""
        if "{rank}" in path:
            return Timeline(path.replace("{rank}", str(self.rank)), self.rank, mark_cycles)
        return Timeline(path, self.rank, mark_cycles) if self.rank == 0 else None

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Start writing a timeline at run time (replacing any current one)."""
        new = self._open_timeline(path, mark_cycles)
        with self._lock:
            old, self.timeline = self.timeline, new
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        """Stop writing the timeline and close its file.

        Every reader takes ``self.timeline`` once into a local, and a closed timeline ignores further events, so
        the engine thread never sees it vanish between a check and a use.
        """
        with self._lock:
            old, self.timeline = self.timeline, None
        if old is not None:
            old.close()

    # ----- engine-thread side -----

    def _run(self) -> None:
        stalled_cycles = 0  # consecutive cycles that completed nothing while this rank had work pending
        while self._claim(stalled_cycles):
            progress = self._drive_one_cycle()
            if progress is None:
                break
            stalled_cycles = 0 if progress or not self._pending else stalled_cycles + 1
        self._release_connections()
        self._watch.stop()

    def _claim(self, stalled_cycles: int) -> bool:
        """Engine thread: sleep until there is work (or the idle period passed) and no caller is running cycles,
        then take the drive; False once the engine has ended."""
        timed_out = False
        with self._lock:
            while not self._ended:
                if self._driver is None and (self._queue or self._shutdown_requested or timed_out):
                    self._driver = "engine"
                    return True
                timed_out = not self._lock.wait(self._wait_ms(stalled_cycles) / 1000.0)
        return False

    def _drive_one_cycle(self) -> bool | None:
        """Run one cycle as the driver, then give up the drive: whether it completed anything, or None when the
        engine ended in it (a stop verdict, or a failed collective)."""
        try:
            progress, stop = self._cycle()
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
        stalled_cycles = 0
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
                stalled_cycles = 0 if progress else stalled_cycles + 1
                if not progress:
                    with self._lock:
                        if not self._queue and not self._shutdown_requested:
                            self._lock.wait(self._wait_ms(stalled_cycles) / 1000.0)
        finally:
            with self._lock:
                if self._queue or self._pending or self._shutdown_requested:
                    self._lock.notify_all()  # the engine thread carries what is left

    def _release_connections(self) -> None:
        """Close this rank's side of every connection the engine owns, as soon as the engine thread ends.

        A peer blocked on this rank (say, rank 0 waiting for rank 1 while rank 1 saw rank 2 die) must fail at once
        rather than at the gloo timeout: it is what lets elastic survivors re-form promptly. A gloo group's sockets
        close only when the last reference to it goes (``abort()`` and ``shutdown()`` leave them open), so the
        engine drops all of its references; leaving the shared-memory segment marks this rank as gone for the
        others' liveness checks.
        """
        hierarchical, self.hierarchical = self.hierarchical, None
        self._executor.hierarchical = None
        groups = [state.group for state in self.process_sets.values() if state.group is not None and self.rank in state.members]
        if hierarchical is not None:
            hierarchical.close()
            if hierarchical.cross_group is not None:
                groups.append(hierarchical.cross_group)
        self.process_sets.clear()  # the executor shares this mapping
        for arena in self._executor.arenas.values():
            arena.close()
        self._executor.arenas.clear()
        self._world = None
        for group in groups:
            try:
                collectives.destroy_group(group)
            except (RuntimeError, ValueError) as error:  # already gone with the default group
                get_logger().debug("engine group already released: %s", error)
        del groups, hierarchical
        gc.collect()  # engine objects refer to each other; free the groups now, not at some later collection

    def _wait_ms(self, stalled_cycles: int) -> float:
        """How long to sleep before the next cycle, unless a local submission wakes the engine first.

        While this rank waits on others (say, for their backprop to reach the same layer), each empty cycle doubles
        the pause up to the idle period: on a 2-core machine every cycle's collective takes CPU from backprop.
        """
        if not self._pending:
            return self.config.idle_cycle_time_ms
        # The exponent is capped: after hours of waiting the count is huge, and 2**count would overflow a float.
        return min(self.config.cycle_time_ms * (2 ** min(stalled_cycles, 32)), self.config.idle_cycle_time_ms)

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            self._stopped = error
            requests = list(self._pending.values()) + self._queue
            self._queue = []
            self._pending.clear()
            self._pending_cached.clear()
            self._in_flight.clear()
        for request in requests:
            request.fail(error)

    def _members_of(self) -> dict[int, tuple[int, ...]]:
        return {set_id: state.members for set_id, state in self.process_sets.items()}

    def _take_new_requests(self) -> bool:
        with self._lock:
            new, self._queue = self._queue, []
            shutting_down = self._shutdown_requested
        for request in new:
            key = (request.meta.process_set, request.meta.name)
            self._pending[key] = request
            cache_id = self._cache.lookup(request.meta) if self._cache_enabled else None
            if cache_id is not None:
                self._pending_cached[key] = cache_id
            else:
                self._to_send.append(request.meta)
        return shutting_down

    def _bit_vector(self, shutting_down: bool, stall_wanted: bool) -> torch.Tensor:
        """Flags in word 0, then one bit per cache id: set when this rank is ready for that cached response.

        A rank also sets the bit of a response it cannot block: one of a process set it is not in, and, once it
        has joined, any response it will stand in for (unless every member has joined: then nobody runs it).
        """
        flags = _ALL_FLAGS
        if self._to_send:
            flags &= ~_FLAG_NOTHING_NEW
        if stall_wanted:
            flags &= ~_FLAG_NO_STALL
        if shutting_down:
            flags &= ~_FLAG_NO_SHUTDOWN
        bits = 0
        for cache_id in self._pending_cached.values():
            bits |= 1 << cache_id
        joined = set(self._table.joined)
        if len(self.process_sets) > 1 or self.rank in joined:
            for cache_id in self._cache.ids():
                state = self.process_sets.get(self._cache.response(cache_id).process_set)
                if state is None:
                    continue
                outsider = self.rank not in state.members
                stand_in = self.rank in joined and not all(m in joined for m in state.members)
                if outsider or stand_in:
                    bits |= 1 << cache_id
        words = [flags] + [(bits >> (63 * i)) & _WORD_MASK for i in range(self._bit_words)]
        return torch.tensor(words, dtype=torch.int64)

    @staticmethod
    def _ready_ids(words: list[int]) -> list[int]:
        """Cache ids whose bit survived the AND, ascending."""
        ids = []
        for index, word in enumerate(words[1:]):
            while word:
                low = word & -word
                ids.append(63 * index + low.bit_length() - 1)
                word ^= low
        return ids

    def _cycle(self) -> tuple[bool, BaseException | None]:
        self.cycles += 1
        timeline = self.timeline
        if timeline is not None:
            timeline.mark_cycle(self.cycles)
        shutting_down = self._take_new_requests()
        now = time.monotonic()
        oldest = max((now - r.submitted_at for r in self._pending.values()), default=0.0)
        stall_wanted = self._stall.wants_check(oldest)
        if self._one_round.armed is not None:
            return self._speculative_cycle(self._one_round.armed, shutting_down or stall_wanted), None
        words = self._bit_vector(shutting_down, stall_wanted)
        with self._watch.watching("the negotiation cycle"):
            if self.hierarchical is not None:
                self.hierarchical.allreduce_(words, "band")
            else:
                collectives.bitwise_and_(words, self._world)
        agreed = words.tolist()
        flags = agreed[0]
        if not flags & _FLAG_NO_SHUTDOWN:
            return False, EngineStoppedError("Shoal was shut down (shutdown() was called on a rank)")
        responses: list[Response] = []
        for cache_id in self._ready_ids(agreed):
            self._cache.touch(cache_id)
            responses.append(self._cache.response(cache_id))
        if not flags & _FLAG_NOTHING_NEW:
            responses.extend(self._negotiate_new(responses))
        stop = None
        if not flags & _FLAG_NO_STALL:
            stop = self._inspect_stalls()
        self._execute(responses)
        self._follow(responses, flags == _ALL_FLAGS)
        timeline = self.timeline
        if timeline is not None:
            timeline.flush()
        return bool(responses), stop

    def _follow(self, responses: list[Response], clean: bool) -> None:
        """Tell the one-round bookkeeping what this ordinary cycle completed (agreed by every rank)."""
        if not self._one_round.enabled:
            return
        settled = (self._autotune is None or self._autotune.frozen) and not self._table.joined
        cache_ids = [self._cache.id_for_name(r.process_set, r.name) for r in responses]
        fusion = (self.config.fusion_threshold_bytes, self.config.fusion_solo_bytes)
        self._one_round.after_ordinary(responses, cache_ids, clean, settled, fusion)

    def _speculative_cycle(self, armed: list[tuple[int, Response]], busy: bool) -> bool:
        """One SUM allreduce of the armed set's data and counts (see ``shoal.engine.one_round``); True when some
        request completed. ``busy``: this rank wants a stall check or a shutdown, which ordinary cycles carry."""
        self.one_round_cycles += 1
        plan = self._one_round.plan
        if plan is None:
            plan = self._one_round.plan = self._executor.plan_round(armed)
        pending, pending_cached = self._pending, self._pending_cached
        ready = [pending_cached.get(key) == cache_id for key, cache_id in zip(plan.keys, plan.cache_ids, strict=True)]
        quiet = not busy and not self._to_send and len(pending) == sum(ready)
        requests = [pending[key] if ok else None for key, ok in zip(plan.keys, ready, strict=True)]
        started = time.perf_counter()
        counts = self._executor.speculate(plan, requests, [*map(int, ready), int(quiet)])
        seconds = time.perf_counter() - started
        size = self.size
        delivered = [count == size for count in counts[:-1]]
        self._one_round.after_round(True in delivered, counts[-1] == size)
        done = [r for r, ok in zip(plan.responses, delivered, strict=True) if ok]
        for cache_id, ok in zip(plan.cache_ids, delivered, strict=True):
            if ok:
                self._cache.touch(cache_id)
        self._retire(done)
        self._executor.deliver(plan, requests, delivered, seconds)  # autotune, if on, is frozen here
        timeline = self.timeline
        if timeline is not None:
            timeline.flush()
        return bool(done)

    def _negotiate_new(self, cached: list[Response]) -> list[Response]:
        sending, self._to_send = self._to_send, []
        with self._watch.watching("negotiation of new requests"):
            messages = collectives.allgather_bytes(encode_requests(sending), self.size, self._world)
        gathered = [decode_requests(message, rank) for rank, message in enumerate(messages)]
        timeline = self.timeline
        if timeline is not None:
            seen_by: dict[str, list[int]] = {}
            for rank, metas in enumerate(gathered):
                for meta in metas:
                    seen_by.setdefault(meta.name, []).append(rank)
            for name, ranks in seen_by.items():
                timeline.ready(name, ranks)
        ready_now = {(r.process_set, r.name) for r in cached}
        for metas in gathered:
            for meta in metas:
                key = (meta.process_set, meta.name)
                cache_id = self._cache.id_for_name(*key)
                if cache_id is not None and key not in ready_now:
                    # Some rank sent a different signature under a cached name: every rank drops the entry and
                    # re-sends its own request for that name through the coordinator.
                    self._cache.evict(cache_id)
                    self._requeue_cached(key)
        self._table.ingest(gathered)
        return self._table.take_ready(self._members_of())

    def _requeue_cached(self, key: tuple[int, str]) -> None:
        if self._pending_cached.pop(key, None) is not None:
            self._to_send.append(self._pending[key].meta)

    def _inspect_stalls(self) -> BaseException | None:
        now = time.monotonic()
        report = [(k[0], k[1], now - r.submitted_at) for k, r in self._pending.items()]
        with self._watch.watching("the stall check"):
            messages = collectives.allgather_bytes(encode_stall_report(report), self.size, self._world)
        reports = [decode_stall_report(message, rank) for rank, message in enumerate(messages)]
        message = self._stall.inspect(reports, self._members_of(), self.rank)
        return RuntimeError(message) if message is not None else None

    def _execute(self, responses: list[Response]) -> None:
        timeline = self.timeline
        if timeline is not None:
            for response in responses:
                if (response.process_set, response.name) in self._pending:
                    timeline.end(response.name, f"NEGOTIATE_{response.kind.value.upper()}")
        done = self._retire(responses)
        in_progress = list(done.values())
        self._executor.joined = frozenset(self._table.joined)
        try:
            for batch in plan_batches(responses, self.config.fusion_threshold_bytes, self.config.fusion_solo_bytes):
                self._executor.run(batch, done)
        except BaseException as error:  # the requests taken out of _pending must fail too, or their waiters hang
            for request in in_progress:
                if not request.done.is_set():
                    request.fail(EngineStoppedError(f"Shoal's engine failed: {error}"))
            raise
        if self._autotune is not None:
            moved = sum(r.meta.nbytes for r in responses if r.kind in DATA_KINDS and r.error is None)
            if self._autotune.record(moved):
                self._next_autotune_sample()
        for response in responses:
            if self._cacheable(response):
                evicted = self._cache.insert(response)
                if evicted is not None:
                    self._requeue_cached((evicted.process_set, evicted.name))

    def _retire(self, responses: list[Response]) -> dict[tuple[int, str], Request]:
        """Take these responses' requests out of the pending ones, and their names out of flight; returns this rank's
        requests among them, to be completed."""
        done: dict[tuple[int, str], Request] = {}
        for response in responses:
            key = (response.process_set, response.name)
            self._pending_cached.pop(key, None)
            request = self._pending.pop(key, None)
            if request is not None:
                done[key] = request
        with self._lock:  # before completion wakes a waiter that may resubmit the same name at once
            for key in done:
                self._in_flight.discard(key)
        return done

    def _next_autotune_sample(self) -> None:
        """A sample ended on every rank in this cycle: rank 0 decides the next settings, all apply them."""
        assert self._autotune is not None
        decided = self._autotune.next_settings() if self.rank == 0 else torch.zeros(SETTINGS_WIRE_LENGTH, dtype=torch.float64)
        with self._watch.watching("the autotune broadcast"):
            collectives.broadcast_(decided, 0, self._world)
        settings = self._autotune.apply(decided)
        self.config.fusion_threshold_bytes = settings.fusion_threshold_bytes
        self.config.cycle_time_ms = settings.cycle_time_ms
        self._cache_enabled = settings.cache_enabled and self._cache.capacity > 0
        self._executor.use_hierarchical = settings.hierarchical
        self.tuned_bucket_bytes = settings.bucket_bytes

    def _cacheable(self, response: Response) -> bool:
        """Cache only clean data collectives that every member submitted (no joined rank stood in)."""
        if not self._cache_enabled or response.error is not None or response.kind not in DATA_KINDS:
            return False
        state = self.process_sets.get(response.process_set)
        if state is None or self._cache.id_for_name(response.process_set, response.name) is not None:
            return False
        return all(response.rank_metas[r] is not None for r in state.members)


__all__ = ["Engine", "EngineStoppedError", "Kind"]
