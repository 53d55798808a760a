"""The one-round cycle: a cached set of small allreduces that repeats carries its readiness with its data.

An ordinary cycle costs two round trips: the bit-vector AND that says which cached requests every rank has, then
the data. When cached sets completed in the last two productive cycles, with nothing new anywhere, every rank bets that
the next cycle repeats their union and sends, in one SUM allreduce, that set's data (zeros for a request it
does not have yet) followed by one count per request and a "quiet" count (see ``Engine._speculative_cycle``):

- a request whose count reached the world size was sent by every rank, so its part of the sum is the allreduce;
  the others are dropped, their ranks' requests stay pending, and their inputs were never touched (the sum is made
  on a copy);
- the quiet count reaches the world size when no rank has anything besides that set (no new request, no other
  cached one, no stall check, no shutdown); otherwise every rank goes back to ordinary cycles.

Every rank decides to speculate, and on what, from agreed outcomes only, so all issue the same collectives. Only
small CPU allreduces of one fused batch qualify: a bet that fails costs that set's bytes instead of a bit vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.engine.buffers import dtype_of, postscale_factor, scale_, scale_into
from shoal.engine.executor import Executor
from shoal.engine.fusion import plan_batches
from shoal.engine.negotiation import Response
from shoal.engine.request import Kind, ReduceOp, Request
from shoal.engine.transport import ProcessSetState, TransportError
from shoal.log import get_logger

MAX_BYTES = 64 * 1024
"""The largest set worth a bet: at 1 Gbit/s, 64 KiB takes about as long as the round trip it saves."""

_EXACT_COUNTS = {"float32": 2**24, "float64": 2**53, "int32": 2**31 - 1, "int64": 2**63 - 1, "float16": 2048}
"""Dtypes whose sums of ones stay exact up to this many ranks (bfloat16 is exact to 256 only; it is left out)."""


@dataclass
class RoundPlan:
    """An armed one-round set's buffers (``Executor.plan_round``), made once and reused every round it is sent."""

    responses: list[Response]
    keys: list[tuple[int, str]]
    """(process set, name) of each response, in order."""
    cache_ids: list[int]
    buffer: torch.Tensor
    """Every part's data, then one count per part and the quiet count: what the round's one allreduce sends."""
    data: torch.Tensor
    """The parts' data, without the counts."""
    parts: list[torch.Tensor]
    """Each response's flat range of the buffer."""
    control: Any
    """The counts, as a numpy view of the buffer (read and written without a torch call per value)."""
    sizes: list[int]
    """Each response's elements."""
    prescale: float
    postscale: float
    """The factor applied to a delivered part (Average's division by the members included)."""
    state: ProcessSetState
    wire_us: tuple[float, float, str] = (0.0, 0.0, "")
    """The last round on the timeline's clock: (wire start, wire end, its phase name)."""


@dataclass
class OneRound:
    """Which cached set, if any, the next cycle speculates on."""

    enabled: bool
    world_size: int
    _last: list[tuple[int, Response]] | None = None
    armed: list[tuple[int, Response]] | None = field(default=None)
    """(cache id, response) of the set the next cycle sends in one round; None: an ordinary cycle."""
    plan: RoundPlan | None = None
    """The armed set's buffers, made by the engine at its first round (``Executor.plan_round``); None when the set
    changes."""
    _armed_key: frozenset[tuple[int, str]] = frozenset()
    """The armed set's key in ``_bets``, kept from arming so that a round does not rebuild it."""
    _bets: dict[frozenset[tuple[int, str]], list[int]] = field(default_factory=dict)
    """Per set: [rounds that completed some of it, rounds lost on it]. A round is lost when it completed nothing and
    some rank had other work: that other work then needs an ordinary cycle, one round trip more than without the
    bet (a step's gradients completing over several cycles do this). A set lost more often than it paid is never
    armed again."""

    def qualifies(self, responses: list[Response], threshold_bytes: int, solo_bytes: int) -> bool:
        """Small SUM/AVERAGE allreduces of the world on CPU, in one fused batch, with counts that stay exact."""
        if not responses or sum(r.meta.nbytes for r in responses) > MAX_BYTES:
            return False
        for response in responses:
            meta = response.meta
            if response.kind != Kind.ALLREDUCE or response.error is not None or meta.process_set != 0:
                return False
            if meta.shared is not None or meta.device != "cpu" or meta.op not in (ReduceOp.Sum, ReduceOp.Average):
                return False
            if self.world_size > _EXACT_COUNTS.get(meta.dtype, 0):
                return False
        return len(plan_batches(responses, threshold_bytes, solo_bytes)) == 1

    def after_ordinary(
        self, completed: list[Response], cache_ids: list[int | None], clean: bool, settled: bool, fusion: tuple[int, int]
    ) -> None:
        """Follow an ordinary cycle's agreed outcome.

        Arms on the union of the last two productive cycles' sets (a step's allreduces may complete over several
        cycles) when both were cached, qualifying and ``clean`` (nothing new on any rank), and ``settled`` (no rank
        has joined, autotune is off or frozen). Anything else starts again.
        """
        if not self.enabled:
            return
        if not clean or not settled:
            self.disarm()
            return
        if not completed:
            return  # an idle or waiting cycle changes nothing
        if None in cache_ids or not self.qualifies(completed, *fusion):
            self.disarm()
            return
        pairs = [(cache_id, r) for cache_id, r in zip(cache_ids, completed, strict=True) if cache_id is not None]
        if self._last is not None:
            seen = {cache_id for cache_id, _ in self._last}
            union = self._last + [pair for pair in pairs if pair[0] not in seen]
            key = _key(union)
            paid, lost = self._bets.get(key, (0, 0))
            if lost <= paid and self.qualifies([r for _, r in union], *fusion):
                self.armed, self.plan, self._armed_key = union, None, key
        self._last = pairs

    def after_round(self, delivered: bool, quiet: bool) -> None:
        """Follow an armed cycle's agreed outcome: keep the bet while every rank is quiet, and score it."""
        assert self.armed is not None
        if delivered or not quiet:
            if len(self._bets) >= _MAX_SCORED:
                self._bets.clear()
            score = self._bets.setdefault(self._armed_key, [0, 0])
            score[0 if delivered else 1] += 1
        if not quiet:
            self.disarm()

    def disarm(self) -> None:
        self._last, self.armed, self.plan = None, None, None


_MAX_SCORED = 4096
"""Scores kept at most (then forgotten all at once): names that change every step must not grow them forever."""


def _key(pairs: list[tuple[int, Response]]) -> frozenset[tuple[int, str]]:
    return frozenset((response.process_set, response.name) for _, response in pairs)


def plan_round(armed: list[tuple[int, Response]], state: ProcessSetState) -> RoundPlan:
    """The buffers of an armed set (of process set ``state``), made once and reused every round the set is sent."""
    responses = [response for _, response in armed]
    meta = responses[0].meta
    assert meta.op is not None
    sizes = [math.prod(r.meta.shape) for r in responses]
    total = sum(sizes)
    buffer = torch.empty(total + len(responses) + 1, dtype=dtype_of(meta))
    *parts, control = buffer.split([*sizes, len(responses) + 1])
    return RoundPlan(
        responses=responses,
        keys=[(r.process_set, r.name) for r in responses],
        cache_ids=[cache_id for cache_id, _ in armed],
        buffer=buffer,
        data=buffer[:total],
        parts=parts,
        control=control.numpy(),
        sizes=sizes,
        prescale=meta.prescale,
        postscale=postscale_factor(ReduceOp(meta.op), meta.postscale, len(state.members)),
        state=state,
    )


def speculate(executor: Executor, plan: RoundPlan, requests: list[Request | None], control: list[int]) -> list[int]:
    """One SUM allreduce of a planned set's data, zeros where ``requests`` has None, with ``control`` appended,
    in the plan's own buffer (the inputs stay as they are, so a part that not every rank sent is simply dropped).

    Returns the summed control values; the reduced data stays in the plan's buffer for ``deliver``. A failure
    here is on the wire, or before it while the peers are inside the collective: either way the engine must
    stop (``TransportError``).
    """
    first = plan.responses[0]
    transport = executor.transport
    try:
        for part, request in zip(plan.parts, requests, strict=True):
            if request is not None and request.tensor is not None:
                part.copy_(request.tensor.view(-1))
            else:
                part.zero_()
        plan.control[:] = control
        scale_(plan.data, plan.prescale)
        executor.collective_calls += 1
        timeline = executor.timeline()
        started_us = timeline.now_us() if timeline is not None else 0.0
        transport.reduce_(plan.buffer, "sum", first.process_set, plan.state, first.name)
        if timeline is not None:
            plan.wire_us = (started_us, timeline.now_us(), transport.reduce_phase(plan.buffer, first.process_set))
    except TransportError:
        raise
    except Exception as error:
        raise TransportError(f"one-round allreduce of '{first.name}' failed on rank {executor.rank}: {error}") from error
    return [int(value) for value in plan.control.tolist()]


def deliver(executor: Executor, plan: RoundPlan, requests: list[Request | None], delivered: list[bool], seconds: float) -> None:
    """Finish a one-round cycle: scale the parts every rank sent, copy them out and complete their requests. The
    other parts' requests stay pending, with nothing in the timeline: to them the round was a negotiation."""
    every = zip(plan.responses, requests, plan.parts, plan.sizes, delivered, strict=True)
    kept = [(response, request, part, size) for response, request, part, size, ok in every if ok and request is not None]
    if not kept:
        return
    done = [response for response, _, _, _ in kept]
    _mark_round(executor, plan, done)
    executor.begin_phase(done, "MEMCPY_OUT_FUSION_BUFFER")
    try:
        for _, request, part, _ in kept:
            assert request is not None
            if request.output is not None:
                scale_into(part, plan.postscale, request.output.view(-1))
    except Exception as error:
        names = ", ".join(repr(r.name) for r in done)
        message = f"Shoal could not complete allreduce of {names} on rank {executor.rank}: {error}"
        get_logger().error("%s", message)
        for _, request, _, _ in kept:
            assert request is not None
            request.fail(RuntimeError(message))
        return
    finally:
        executor.end_phase(done, "MEMCPY_OUT_FUSION_BUFFER")
        executor.end_phase(done, "ALLREDUCE")
    executor.record_seconds(done, seconds, [size for _, _, _, size in kept])
    for _, request, _, _ in kept:
        assert request is not None
        request.complete(request.output)


def _mark_round(executor: Executor, plan: RoundPlan, done: list[Response]) -> None:
    """Timeline rows of the requests a one-round cycle completed: their negotiation ended when the round began,
    which was also their allreduce's wire phase."""
    timeline = executor.timeline()
    if timeline is None:
        return
    started_us, ended_us, phase = plan.wire_us
    for response in done:
        timeline.end(response.name, f"NEGOTIATE_{response.kind.value.upper()}", started_us)
        timeline.begin(response.name, "ALLREDUCE", {"one_round": True}, started_us)
        timeline.begin(response.name, phase, None, started_us)
        timeline.end(response.name, phase, ended_us)


__all__ = ["MAX_BYTES", "OneRound", "RoundPlan", "deliver", "plan_round", "speculate"]
