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

from dataclasses import dataclass, field

from shoal.engine.executor import RoundPlan
from shoal.engine.fusion import plan_batches
from shoal.engine.negotiation import Response
from shoal.engine.request import Kind, ReduceOp

MAX_BYTES = 64 * 1024
"""The largest set worth a bet: at 1 Gbit/s, 64 KiB takes about as long as the round trip it saves."""

_EXACT_COUNTS = {"float32": 2**24, "float64": 2**53, "int32": 2**31 - 1, "int64": 2**63 - 1, "float16": 2048}
"""Dtypes whose sums of ones stay exact up to this many ranks (bfloat16 is exact to 256 only; it is left out)."""


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


__all__ = ["MAX_BYTES", "OneRound"]
