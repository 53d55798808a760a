"""What the rounds of ``shoal.torch.local_steps`` measure for ``shoal.plan.far.replan``: the inner steps, and per
round the time the link was busy and the outer work."""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence

import torch


def busy_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """The seconds covered by at least one of the ``(start, end)`` spans."""
    busy, reached = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy


class RoundTimes:
    """What the rounds measure for ``replan``: the inner steps' wall seconds, and per round the wire seconds of the
    exchanges landed in it (as this rank saw them: 0 where it sends nothing) and the outer work (encoding, sending,
    landing, not waiting)."""

    def __init__(self) -> None:
        self.steps: collections.deque[float] = collections.deque(maxlen=32)
        self.last: float | None = None
        self.ends: collections.deque[tuple[float, float]] = collections.deque(maxlen=3)
        """The last rounds' (wire, outer work) seconds: H follows their medians, or the last wire if slower."""
        self.on_wire: list[tuple[float, float]] = []
        """This round's landed exchanges, (sent, done) each, as this rank saw them."""
        self.work = 0.0
        self.exchange_s = 0.0
        """All wall seconds this rank spent on outer exchanges (encoding, sending, landing, waiting)."""
        self.waited_s = 0.0
        """The part of ``exchange_s`` spent waiting for exchanges to land (not hidden by the steps since they left)."""

    def step(self, now: float) -> float | None:
        """An inner step ended at ``now``: its wall seconds, where the last one's end is known."""
        took = None if self.last is None else now - self.last
        if took is not None:
            self.steps.append(took)
        self.last = now
        return took

    def end_round(self, work: float, sends: bool) -> torch.Tensor:
        """The round's last fragment is sent, after ``work`` more seconds of outer work: what this rank measured, to
        be reduced with ``ReduceOp.Max`` across ranks for ``replan``, and the next round's counts start. ``sends``:
        this rank crosses the link (a host's first rank).

        ``replan`` takes the slowest rank's work and step, and the shortest wire any sending rank saw (sent negated).
        Hosts run apart, so a host ahead sees an exchange end only once the host behind has sent its part too: its
        wire holds the hosts' skew. The last to send sees the link's own time, which is what a round must carry.
        Taking the skew as wire made H and τ grow, and a longer τ let the host behind fall further behind.

        A round's wire is the time the link was busy: the union of its exchanges' spans, not their sum. Fragments in
        flight at once share the link, each taking longer, and their sum counted that time twice: a short round's
        fragments overlapped, measured more wire, and made the next round long; at 10 Mbit/s H swung between 229
        and 500 from round to round."""
        self.ends.append((busy_seconds(self.on_wire), self.work + work))
        self.on_wire, self.work = [], 0.0
        wires, works = zip(*self.ends, strict=True)
        wire, local = max(statistics.median(wires), wires[-1]), statistics.median(works)
        negated = -wire if sends else -math.inf
        return torch.tensor([negated, local, statistics.median(self.steps or [0.0])], dtype=torch.float64)
