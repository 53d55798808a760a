"""The engine's cycle: what every rank does, in lockstep, to agree on and run the next collectives.

1. take newly submitted requests; those whose signature is in the response cache just set their bit;
2. one small allreduce (bitwise AND) of the bit vector plus three flags: "nothing new", "no stall", "no shutdown";
3. only if some rank has new (uncached) requests: one allgather of their metadata, after which every rank runs
   the coordinator's checks on the same data and derives the same responses (or the same mismatch errors);
4. fuse the responses and execute them in the agreed order; completed handles wake their waiters.

A cached set that repeats is sent with its readiness in one round instead (``shoal.engine.one_round``); the stall
inspector and autotune ride on the same cycles. Cache ids agree on every rank because all ranks insert, touch and
evict in the agreed response order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.comm import collectives
from shoal.engine.autotune import SETTINGS_WIRE_LENGTH, AutotuneConfig, Autotuner, TunedSettings, import_optuna
from shoal.engine.config import EngineConfig
from shoal.engine.executor import Executor
from shoal.engine.fusion import plan_batches
from shoal.engine.inbox import EngineStoppedError, Inbox, Key
from shoal.engine.negotiation import MessageTable, Response
from shoal.engine.one_round import OneRound, deliver, plan_round, speculate
from shoal.engine.request import DATA_KINDS, Request, RequestMeta
from shoal.engine.response_cache import ResponseCache
from shoal.engine.stall import StallInspector
from shoal.engine.timeline import Timeline
from shoal.engine.transport import Transport
from shoal.engine.wire_format import decode_requests, decode_stall_report, encode_requests, encode_stall_report

_FLAG_NOTHING_NEW, _FLAG_NO_STALL, _FLAG_NO_SHUTDOWN = 1, 2, 4
_ALL_FLAGS = _FLAG_NOTHING_NEW | _FLAG_NO_STALL | _FLAG_NO_SHUTDOWN
_WORD_MASK = (1 << 63) - 1
"""63 bits per int64 word, so that no word is negative and every bit means one cache id."""


def make_autotuner(config: EngineConfig, rank: int, hierarchical: bool, settings: TunedSettings) -> Autotuner | None:
    """The engine's autotuner when ``config.autotune`` asks for one (optuna is imported on every rank, so that a
    missing optuna fails init everywhere alike)."""
    if not config.autotune:
        return None
    import_optuna()
    tuning = AutotuneConfig(
        config.autotune_log_file,
        config.autotune_warmup_samples,
        config.autotune_steps_per_sample,
        config.autotune_max_samples,
        config.autotune_gaussian_process_noise,
    )
    return Autotuner(tuning, rank, hierarchical, settings)


QUIET_CYCLES = 10
"""Idle cycles that completed nothing, anywhere, before an idle engine's pause starts to grow (``pause_ms``)."""


def pause_ms(
    cycle_time_ms: float,
    idle_cycle_time_ms: float,
    pending: bool,
    stalled_cycles: int,
    quiet_cycles: int = 0,
    quiet_cycle_time_ms: float | None = None,
    quiet_after: int = QUIET_CYCLES,
) -> float:
    """How long to sleep before the next cycle, unless a local submission wakes the engine first.

    While this rank waits on others (say, for their backprop to reach the same layer), each empty cycle doubles the
    pause up to the idle period: on a 2-core machine every cycle's collective takes CPU from backprop. With nothing
    pending, the pause is the idle period; after ``quiet_after`` idle cycles that completed nothing (``quiet_cycles``:
    no rank's collective either, since every completed one completes in a cycle every rank joins), it doubles each
    cycle up to ``quiet_cycle_time_ms``. Each cycle is a round trip over every host's link: hosts far apart running
    local steps have nothing to exchange for most of a round, and 50 idle cycles a second sent 73 kB/s per host.
    """
    if not pending:
        if quiet_cycle_time_ms is None or quiet_cycles <= quiet_after:
            return idle_cycle_time_ms
        grown = idle_cycle_time_ms * (2 ** min(quiet_cycles - quiet_after, 32))
        return min(grown, max(quiet_cycle_time_ms, idle_cycle_time_ms))
    # The exponent is capped: after hours of waiting the count is huge, and 2**count would overflow a float.
    return min(cycle_time_ms * (2 ** min(stalled_cycles, 32)), idle_cycle_time_ms)


@dataclass
class Pauses:
    """A driver's count of empty cycles, for ``pause_ms``."""

    stalled: int = 0
    """Consecutive cycles that completed nothing while this rank had work pending."""
    quiet: int = 0
    """Consecutive cycles that completed nothing while this rank had nothing pending."""
    quiet_after: int = QUIET_CYCLES
    """Such cycles before the pause grows: fewer where the job's work comes in bursts far apart (local steps)."""

    def after(self, progress: bool, pending: bool) -> None:
        """Count a cycle: whether it completed anything, and whether this rank has work pending after it."""
        self.stalled = 0 if progress or not pending else self.stalled + 1
        self.quiet = 0 if progress or pending else self.quiet + 1

    def ms(self, config: EngineConfig, cycle_time_ms: float, pending: bool) -> float:
        """The pause before the next cycle (``pause_ms``; ``cycle_time_ms``: the tuned busy pause)."""
        idle_ms, quiet_ms = config.idle_cycle_time_ms, config.quiet_cycle_time_ms
        return pause_ms(cycle_time_ms, idle_ms, pending, self.stalled, self.quiet, quiet_ms, self.quiet_after)


def ready_ids(words: list[int]) -> list[int]:
    """Cache ids whose bit survived the AND, ascending."""
    ids = []
    for index, word in enumerate(words[1:]):
        while word:
            low = word & -word
            ids.append(63 * index + low.bit_length() - 1)
            word ^= low
    return ids


def inspect_stalls(inspector: StallInspector, pending: dict[Key, Request], transport: Transport) -> BaseException | None:
    """The stall check, every rank in the same cycle: the ranks allgather how long each pending request has waited,
    and ``inspector`` names the missing ranks; a stop verdict past the shutdown time."""
    now = time.monotonic()
    report = [(key[0], key[1], now - request.submitted_at) for key, request in pending.items()]
    with transport.watch.watching("the stall check"):
        messages = collectives.allgather_bytes(encode_stall_report(report), transport.size, transport.world)
    reports = [decode_stall_report(message, rank) for rank, message in enumerate(messages)]
    message = inspector.inspect(reports, transport.members_of(), transport.rank)
    return RuntimeError(message) if message is not None else None


def mark_ready(timeline: Timeline, gathered: list[list[RequestMeta]]) -> None:
    """On the timeline, which ranks sent each newly negotiated request."""
    seen_by: dict[str, list[int]] = {}
    for rank, metas in enumerate(gathered):
        for meta in metas:
            seen_by.setdefault(meta.name, []).append(rank)
    for name, ranks in seen_by.items():
        timeline.ready(name, ranks)


class Cycle:
    """The cycle protocol of one engine: the pending requests, the response cache and the message table, the
    bit vector, negotiation, the stall inspector, autotune and the one-round decision. Run by one thread at a time."""

    def __init__(
        self,
        config: EngineConfig,
        transport: Transport,
        executor: Executor,
        inbox: Inbox,
        timeline: Callable[[], Timeline | None],
    ) -> None:
        self.config = config
        self.rank, self.size = transport.rank, transport.size
        self.transport = transport
        self.executor = executor
        self.inbox = inbox
        self._timeline = timeline
        self.cache_enabled = config.cache_capacity > 0
        """False with no cache, or while autotune has it off; implies a capacity > 0 when True."""
        self.tuned = TunedSettings(config.fusion_threshold_bytes, config.cycle_time_ms, None, self.cache_enabled)
        """The settings in force: the configured ones until autotune applies its own (``config`` stays as given)."""
        self.autotune = make_autotuner(config, self.rank, transport.hierarchical is not None, self.tuned)
        self.cache = ResponseCache(config.cache_capacity, self.rank)
        self._bit_words = (config.cache_capacity + 62) // 63
        self._table = MessageTable(self.size)
        self._stall = StallInspector(
            config.stall_check_time_s, config.stall_shutdown_time_s, disabled=config.stall_check_disabled
        )
        self.pending: dict[Key, Request] = {}
        self._pending_cached: dict[Key, int] = {}
        self._to_send: list[RequestMeta] = []
        self.one_round = OneRound(config.one_round_cycles and self.cache_enabled, self.size)
        self.cycles = 0
        self.one_round_cycles = 0
        """Cycles that sent a cached set's readiness with its data (``shoal.engine.one_round``)."""

    def drop_pending(self) -> list[Request]:
        """Forget every pending request (the engine stops); returns them, to fail."""
        requests = list(self.pending.values())
        self.pending.clear()
        self._pending_cached.clear()
        return requests

    def run(self) -> tuple[bool, BaseException | None]:
        """One cycle: whether it completed anything, and a stop verdict (a shutdown, a stall) or None."""
        self.cycles += 1
        timeline = self._timeline()
        if timeline is not None:
            timeline.mark_cycle(self.cycles)
        shutting_down = self._take_new_requests()
        now = time.monotonic()
        oldest = max((now - r.submitted_at for r in self.pending.values()), default=0.0)
        stall_wanted = self._stall.wants_check(oldest)
        if self.one_round.armed is not None:
            return self._speculative_cycle(self.one_round.armed, shutting_down or stall_wanted), None
        words = self._bit_vector(shutting_down, stall_wanted)
        with self.transport.watch.watching("the negotiation cycle"):
            self.transport.and_words_(words)
        agreed = words.tolist()
        flags = agreed[0]
        if not flags & _FLAG_NO_SHUTDOWN:
            return False, EngineStoppedError("Shoal was shut down (shutdown() was called on a rank)")
        responses: list[Response] = []
        for cache_id in ready_ids(agreed):
            self.cache.touch(cache_id)
            responses.append(self.cache.response(cache_id))
        if not flags & _FLAG_NOTHING_NEW:
            responses.extend(self._negotiate_new(responses))
        stop = None
        if not flags & _FLAG_NO_STALL:
            stop = inspect_stalls(self._stall, self.pending, self.transport)
        self._execute(responses)
        self._follow(responses, flags == _ALL_FLAGS)
        timeline = self._timeline()
        if timeline is not None:
            timeline.flush()
        return bool(responses), stop

    def _take_new_requests(self) -> bool:
        new, shutting_down = self.inbox.take()
        for request in new:
            key = (request.meta.process_set, request.meta.name)
            self.pending[key] = request
            cache_id = self.cache.lookup(request.meta) if self.cache_enabled else None
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
        process_sets = self.transport.process_sets
        if len(process_sets) > 1 or self.rank in joined:
            for cache_id in self.cache.ids():
                state = process_sets.get(self.cache.response(cache_id).process_set)
                if state is None:
                    continue
                outsider = self.rank not in state.members
                stand_in = self.rank in joined and not all(m in joined for m in state.members)
                if outsider or stand_in:
                    bits |= 1 << cache_id
        words = [flags] + [(bits >> (63 * i)) & _WORD_MASK for i in range(self._bit_words)]
        return torch.tensor(words, dtype=torch.int64)

    def _follow(self, responses: list[Response], clean: bool) -> None:
        """Tell the one-round bookkeeping what this ordinary cycle completed (agreed by every rank)."""
        if not self.one_round.enabled:
            return
        settled = (self.autotune is None or self.autotune.frozen) and not self._table.joined
        cache_ids = [self.cache.id_for_name(r.process_set, r.name) for r in responses]
        fusion = (self.tuned.fusion_threshold_bytes, self.config.fusion_solo_bytes)
        self.one_round.after_ordinary(responses, cache_ids, clean, settled, fusion)

    def _speculative_cycle(self, armed: list[tuple[int, Response]], busy: bool) -> bool:
        """One SUM allreduce of the armed set's data and counts (see ``shoal.engine.one_round``); True when some
        request completed. ``busy``: this rank wants a stall check or a shutdown, which ordinary cycles carry."""
        self.one_round_cycles += 1
        plan = self.one_round.plan
        if plan is None:
            state = self.transport.process_sets[armed[0][1].process_set]
            plan = self.one_round.plan = plan_round(armed, state)
        pending, pending_cached = self.pending, self._pending_cached
        ready = [pending_cached.get(key) == cache_id for key, cache_id in zip(plan.keys, plan.cache_ids, strict=True)]
        quiet = not busy and not self._to_send and len(pending) == sum(ready)
        requests = [pending[key] if ok else None for key, ok in zip(plan.keys, ready, strict=True)]
        started = time.perf_counter()
        counts = speculate(self.executor, plan, requests, [*map(int, ready), int(quiet)])
        seconds = time.perf_counter() - started
        size = self.size
        delivered = [count == size for count in counts[:-1]]
        self.one_round.after_round(True in delivered, counts[-1] == size)
        done = [r for r, ok in zip(plan.responses, delivered, strict=True) if ok]
        for cache_id, ok in zip(plan.cache_ids, delivered, strict=True):
            if ok:
                self.cache.touch(cache_id)
        self._retire(done)
        deliver(self.executor, plan, requests, delivered, seconds)  # autotune, if on, is frozen here
        timeline = self._timeline()
        if timeline is not None:
            timeline.flush()
        return bool(done)

    def _negotiate_new(self, cached: list[Response]) -> list[Response]:
        sending, self._to_send = self._to_send, []
        with self.transport.watch.watching("negotiation of new requests"):
            messages = collectives.allgather_bytes(encode_requests(sending), self.size, self.transport.world)
        gathered = [decode_requests(message, rank) for rank, message in enumerate(messages)]
        timeline = self._timeline()
        if timeline is not None:
            mark_ready(timeline, gathered)
        ready_now = {(r.process_set, r.name) for r in cached}
        for metas in gathered:
            for meta in metas:
                key = (meta.process_set, meta.name)
                cache_id = self.cache.id_for_name(*key)
                if cache_id is not None and key not in ready_now:
                    # Some rank sent a different signature under a cached name: every rank drops the entry and
                    # re-sends its own request for that name through the coordinator.
                    self.cache.evict(cache_id)
                    self._requeue_cached(key)
        self._table.ingest(gathered)
        return self._table.take_ready(self.transport.members_of())

    def _requeue_cached(self, key: Key) -> None:
        if self._pending_cached.pop(key, None) is not None:
            self._to_send.append(self.pending[key].meta)

    def _execute(self, responses: list[Response]) -> None:
        timeline = self._timeline()
        if timeline is not None:
            for response in responses:
                if (response.process_set, response.name) in self.pending:
                    timeline.end(response.name, f"NEGOTIATE_{response.kind.value.upper()}")
        done = self._retire(responses)
        in_progress = list(done.values())
        self.executor.joined = frozenset(self._table.joined)
        try:
            for batch in plan_batches(responses, self.tuned.fusion_threshold_bytes, self.config.fusion_solo_bytes):
                self.executor.run(batch, done)
        except BaseException as error:  # the requests taken out of pending must fail too, or their waiters hang
            for request in in_progress:
                if not request.done.is_set():
                    request.fail(EngineStoppedError(f"Shoal's engine failed: {error}"))
            raise
        if self.autotune is not None:
            moved = sum(r.meta.nbytes for r in responses if r.kind in DATA_KINDS and r.error is None)
            if self.autotune.record(moved):
                self._next_autotune_sample()
        for response in responses:
            if self._cacheable(response):
                evicted = self.cache.insert(response)
                if evicted is not None:
                    self._requeue_cached((evicted.process_set, evicted.name))

    def _retire(self, responses: list[Response]) -> dict[Key, Request]:
        """Take these responses' requests out of the pending ones, and their names out of flight; returns this rank's
        requests among them, to be completed."""
        done: dict[Key, Request] = {}
        for response in responses:
            key = (response.process_set, response.name)
            self._pending_cached.pop(key, None)
            request = self.pending.pop(key, None)
            if request is not None:
                done[key] = request
        self.inbox.release(list(done))  # before completion wakes a waiter that may resubmit the same name at once
        return done

    def _next_autotune_sample(self) -> None:
        """A sample ended on every rank in this cycle: rank 0 decides the next settings, all apply them."""
        assert self.autotune is not None
        decided = self.autotune.next_settings() if self.rank == 0 else torch.zeros(SETTINGS_WIRE_LENGTH, dtype=torch.float64)
        with self.transport.watch.watching("the autotune broadcast"):
            collectives.broadcast_(decided, 0, self.transport.world)
        self.tuned = self.autotune.apply(decided)
        self.cache_enabled = self.tuned.cache_enabled and self.cache.capacity > 0
        self.transport.use_hierarchical = self.tuned.hierarchical

    def _cacheable(self, response: Response) -> bool:
        """Cache only clean data collectives that every member submitted (no joined rank stood in)."""
        if not self.cache_enabled or response.error is not None or response.kind not in DATA_KINDS:
            return False
        state = self.transport.process_sets.get(response.process_set)
        if state is None or self.cache.id_for_name(response.process_set, response.name) is not None:
            return False
        return all(response.rank_metas[r] is not None for r in state.members)
