"""Local steps with outer updates (DiLoCo), as the planner sees them: the settings, the codecs' costs, and the choice
of the round's length H and codec from the measured link and step time.

Each host is one DiLoCo worker: its ranks take synchronous inner steps with the user's optimizer (the gradients are
averaged inside the host only). Every H inner steps the hosts average the pseudo-gradient (the weights at the round's
start minus the weights now) in a codec, and an outer optimizer (Nesterov SGD by default) applies it to the round's
start weights (Douillard et al., "DiLoCo", arXiv 2311.08105). With H = 1, outer SGD at learning rate 1 without
momentum, and the fp32 codec, this is synchronous data-parallel SGD.

As in Streaming DiLoCo (Douillard et al., arXiv 2501.18512), the model is cut into fragments of whole parameters, each
synced on its own step of the round (H / fragments apart) and landed τ inner steps after it was sent, while the next
steps compute: the link carries a fragment at a time, and the round's end work is spread over the round.

The package imports no framework; the torch carrier is ``shoal.torch.local_steps``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.plan.calibration import Calibration
from shoal.plan.outer_wire import WIRE_FRAMING, Codec, exchange_parts, link_share

DEFAULT_EVERY_CAP = 500
"""The longest round the planner chooses: DiLoCo trains with H = 500 and finds larger H slower to converge."""
DEFAULT_EVERY_FLOOR = 20
"""The shortest round the planner chooses. An outer Nesterov step multiplies a round's progress by about
lr / (1 - momentum) once its momentum builds up (7 with DiLoCo's 0.7 and 0.9); over rounds of a few steps that is a
larger learning rate. On ``shoal.bench.far --task chars`` with DiLoCo's values, rounds of 2 to 15 steps diverged."""
DEFAULT_WIRE_SHARE = 0.01
"""The bytes the outer exchange may send per inner step, as a share of what uncompressed synchronous allreduce sends
per step: a far link is often metered, and shared with other traffic. DiLoCo's rounds of 500 steps send 500 times
fewer; at 1/100 a 2-host int8 round is at least 28 steps, fp32's 107."""
DEFAULT_BUDGET = 0.05
"""The share of a round that the outer exchange may add: the planner's H is the smallest that keeps the exchange
within it (a longer round only makes the optimization staler)."""
DEFAULT_FRAGMENTS = 4
"""The fragments a model is cut into by default (fewer where it has fewer parameters, or where one parameter is
larger than a fragment's share)."""
LOCAL_MARGIN = 0.8
"""``auto-far`` takes local steps only where their predicted step time is at most this share of the best synchronous
plan's (a quarter faster): changing the optimization must buy a real saving, and the synchronous plan's prediction
counts its whole exchange, of which backward hides some."""


@dataclass(frozen=True)
class LocalSteps:
    """The settings of local steps (``DistributedOptimizer(comm="local" | "auto-far", local_steps=...)``)."""

    every: int | None = None
    """H, the inner steps per outer round; None: the planner chooses it from the measured link and step time."""
    codec: Codec | str | None = None
    """The pseudo-gradient's codec (``fp32``, ``bf16``, ``int8``, ``int4``); None: the planner chooses."""
    outer_lr: float = 0.5
    """The outer optimizer's learning rate. DiLoCo's is 0.7, with momentum 0.9, for rounds of 500 steps; over the
    rounds of 20 to 100 steps the planner chooses, that multiplies each round's progress by about 7 and trained worse
    than plain averaging (docs/far.md: held-out loss 2.65 against 2.30 on ``bench.far --task chars``, 0.22 against
    0.11 on digits), where 0.5 and 0.5 matched it."""
    outer_momentum: float = 0.5
    """Its Nesterov momentum; 0: plain SGD (with ``outer_lr=1``: the hosts' weights averaged, local SGD)."""
    max_every: int = DEFAULT_EVERY_CAP
    """The longest round the planner may choose."""
    min_every: int = DEFAULT_EVERY_FLOOR
    """The shortest round the planner may choose (a given ``every`` may be shorter)."""
    wire_share: float | None = DEFAULT_WIRE_SHARE
    """The most bytes the outer exchange may send per inner step, as a share of uncompressed synchronous allreduce's
    per step: the planner's H is at least what keeps it (``wire_floor``); None: no such floor."""
    budget: float = DEFAULT_BUDGET
    """The share of a round the outer exchange may add, for the planner's H (without overlap)."""
    overlap: bool = True
    """The outer exchange runs while the next inner steps compute, and lands ``delay`` steps after it was sent (as
    Streaming DiLoCo's overlapped outer steps); False: every host waits for it where it is sent."""
    fragments: int = DEFAULT_FRAGMENTS
    """The model is cut into up to this many fragments of whole parameters, of about equal entries in the model's
    order, each synced on its own step of the round; 1: the whole model at the round's end."""
    delay: int | None = None
    """τ, the inner steps between a fragment's send and its landing (at most H: a fragment lands before it is sent
    again); None: the planner's (``with_delay``). Only with overlap."""

    def __post_init__(self) -> None:
        if self.every is not None and (not isinstance(self.every, int) or self.every < 1):
            raise ValueError(f"every must be an int >= 1 (inner steps per outer round), got {self.every!r}")
        if self.codec is not None:
            try:
                object.__setattr__(self, "codec", Codec(self.codec))
            except ValueError:
                raise ValueError(f"codec must be one of {[c.value for c in Codec]}, got {self.codec!r}") from None
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 1 <= self.min_every <= self.max_every:
            raise ValueError(f"need 1 <= min_every <= max_every, got {self.min_every} and {self.max_every}")
        if self.wire_share is not None and not 0 < self.wire_share <= 1:
            raise ValueError(f"wire_share must be in (0, 1] or None, got {self.wire_share}")
        if not 0 < self.budget < 1:
            raise ValueError(f"budget must be in (0, 1), got {self.budget}")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"fragments must be an int >= 1, got {self.fragments!r}")
        if self.delay is not None:
            if not isinstance(self.delay, int) or self.delay < 1:
                raise ValueError(f"delay must be an int >= 1 (inner steps), got {self.delay!r}")
            if not self.overlap:
                raise ValueError("delay needs overlap=True: without overlap a fragment lands where it is sent")


@dataclass(frozen=True)
class RoundPlan:
    """The planner's local steps for a model: H, the codec, and what they are predicted to cost."""

    every: int
    codec: Codec
    wire_s: float
    """One outer exchange on the wire."""
    step_s: float
    """One inner step's measured time (compute, and the in-host exchange)."""
    hosts: int
    local_s: float = 0.0
    """The codec's local work per exchange, all fragments (never hidden: it runs between the steps)."""
    overlap: bool = True
    fragments: int = 1
    delay: int | None = None
    """τ: a fragment lands this many inner steps after it was sent; None: H with overlap (it lands before it is sent
    again), 0 without."""
    wire_floor: int = 1
    """The shortest H that keeps the options' ``wire_share`` (``wire_floor``); re-planning keeps it too."""
    entries: int = 0
    """The model's parameters (0: not known, and ``replan`` keeps the codec)."""
    codec_local: tuple[float, ...] = ()
    """Each codec's predicted local work per exchange (in ``Codec``'s order), for ``replan``'s choice of codec."""
    largest_part: float = 0.0
    """The largest fragment's share of the entries (0: equal parts). Fragments are runs of whole parameters, and one
    parameter can hold most of a model (the digits MLP's 1024×1024 layer: 93%)."""

    @property
    def tau(self) -> int:
        """τ in force: ``delay``, or what None stands for."""
        if self.delay is not None:
            return self.delay
        return self.every if self.overlap else 0

    @property
    def exchange_s(self) -> float:
        return self.wire_s + self.local_s

    @property
    def fragment_wire_s(self) -> float:
        """The largest fragment's wire: every fragment lands τ steps after it is sent, so τ must hide this one."""
        return self.wire_s * (self.largest_part or 1 / self.fragments)

    @property
    def fits(self) -> bool:
        """The exchange hides behind the inner steps: a round's wire behind the round, each fragment's behind its τ
        steps (always False without overlap)."""
        return self.overlap and self.wire_s <= self.every * self.step_s and self.fragment_wire_s <= self.tau * self.step_s

    @property
    def exposed_s(self) -> float:
        """The wire seconds per round that the inner steps do not hide: what the round cannot carry, or what each
        fragment's τ steps do not hide, whichever is more (all of it without overlap)."""
        if not self.overlap:
            return self.wire_s
        hidden = min(self.every, self.fragments * self.tau) * self.step_s
        return max(0.0, self.wire_s - hidden)

    @property
    def per_step_s(self) -> float:
        """The predicted time of one inner step, with the outer exchange's exposed part spread over the round."""
        return self.step_s + (self.exposed_s + self.local_s) / self.every

    def describe(self) -> str:
        cut = f" in {self.fragments} fragments" if self.fragments > 1 else ""
        landing = f", each landing {self.tau} steps after it is sent" if self.overlap else ""
        text = (
            f"local steps: every {self.every} steps{cut}{landing}, {self.codec} codec, outer exchange "
            f"{self.exchange_s * 1e3:.1f} ms over {self.hosts} hosts against {self.step_s * 1e3:.2f} ms per inner step"
        )
        if self.overlap and self.wire_s > self.every * self.step_s:
            hidden = self.every * self.step_s
            text += f"; the exchange does not fit in the {hidden * 1e3:.0f} ms of a round that hide it"
        elif self.overlap and not self.fits:
            text += (
                f"; a fragment's exchange ({self.fragment_wire_s * 1e3:.1f} ms) does not fit in the "
                f"{self.tau * self.step_s * 1e3:.0f} ms of the {self.tau} steps that hide it"
            )
        return text + ("" if self.overlap else ", not overlapped")

    def as_dict(self) -> dict[str, object]:
        return {
            "every": self.every,
            "codec": self.codec.value,
            "exchange_ms": round(self.exchange_s * 1e3, 3),
            "step_ms": round(self.step_s * 1e3, 3),
            "hosts": self.hosts,
            "overlap": self.overlap,
            "fragments": self.fragments,
            "delay": self.tau,
            "fits": self.fits,
        }


OVERLAP_SLACK = 1.5
"""With overlap, H is this many times the steps the exchange lasts, and so is a fragment's τ: the exchange shares the
host's cores with the inner steps, and a link's time varies."""


FRAGMENT_SLACK = 1.1
"""The plan cuts the model into fragments only while that lengthens the round, and the predicted step, by at most
this factor: each fragment pays the link's latency once more, and on a link whose latency dominates a longer round
is a staler optimization."""

CODEC_SLACK = 1.02
"""Where codecs tie on H (the floor, or the cap), the plan takes the one with the least wire time among those whose
predicted step is within this factor of the tie's fastest: the far link is shared, and often metered, and a byte
that buys no time is waste (the lossy codecs keep error feedback; docs/far.md measures their loss)."""


def fragment_bounds(sizes: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """The parameters (of ``sizes`` entries, in the model's order) cut into at most ``fragments`` runs of whole
    parameters of about equal entries: ``(first, end)`` index pairs, none empty. Each run takes parameters while
    they bring it nearer to its share (the entries left over the fragments left), so a parameter larger than a
    share makes a fragment of its own, and there may be fewer."""
    bounds: list[tuple[int, int]] = []
    first, left = 0, sum(sizes)
    for remaining in range(fragments, 0, -1):
        if first >= len(sizes):
            break
        share = left / remaining
        end, filled = first + 1, sizes[first]
        while end < len(sizes) and (remaining == 1 or abs(filled + sizes[end] - share) < abs(filled - share)):
            filled += sizes[end]
            end += 1
        bounds.append((first, end))
        first, left = end, left - filled
    return bounds


def plan_rounds(
    calibration: Calibration,
    hosts: int,
    entries: int,
    step_s: float,
    options: LocalSteps = LocalSteps(),
    fragments: int = 1,
    sizes: Sequence[int] = (),
) -> RoundPlan:
    """H, the codec, the fragments (at most ``fragments``) and τ for a model of ``entries`` float32 parameters
    whose inner step takes ``step_s`` (``sizes``: each parameter's entries, in the model's order, which set the
    fragments' parts; none: equal parts).

    Per codec (the given one, else each), H is the shortest round that hides the outer exchange of the whole model
    (with overlap: the exchange fits in ``OVERLAP_SLACK`` times fewer steps than H; without: it adds at most
    ``budget`` of the round), capped at ``max_every``. The codec with the shortest H wins: a shorter round is a less
    stale optimization. On a tie, the least wire time wins among those whose predicted step is within
    ``CODEC_SLACK`` of the fastest (``fewest_bytes``). A given ``every`` is kept, and the codec is then the one
    with the cheapest exchange. Each fragment costs the link's latency once more: the plan takes the most fragments
    whose round and predicted step are at most ``FRAGMENT_SLACK`` longer (and, where the whole model's exchange
    hides, that still hides; where it does not, a capped round's exposed latencies make the step longer). τ is
    ``with_delay``'s.
    """
    codecs = [Codec(options.codec)] if options.codec is not None else list(Codec)

    @functools.cache
    def parts(count: int) -> tuple[tuple[tuple[float, float], ...], float]:
        """Each codec's (wire, local work) in ``count`` fragments, and the largest fragment's share."""
        exchanges = tuple(exchange_parts(calibration, hosts, entries, c, count) for c in Codec)
        largest = max((sum(sizes[a:b]) for a, b in fragment_bounds(sizes, count)), default=0) / max(entries, 1)
        return exchanges, largest

    def plan(codec: Codec, count: int) -> RoundPlan:
        exchanges, largest = parts(count)
        wire, local = exchanges[list(Codec).index(codec)]
        floor = wire_floor(codec, hosts, entries, options)
        every = options.every if options.every is not None else round_length(wire, local, step_s, options, floor)
        works = tuple(work for _, work in exchanges)
        rounds = RoundPlan(
            every, codec, wire, step_s, hosts, local, options.overlap, count, None, floor, entries, works, largest
        )
        return with_delay(rounds, options)

    if options.every is not None:
        whole = min((plan(c, 1) for c in codecs), key=lambda p: (p.exchange_s, codecs.index(p.codec)))
    else:
        whole = fewest_bytes([plan(c, 1) for c in codecs], codecs)
    for count in range(fragments, 1, -1):
        cut = plan(whole.codec, count)
        if cut.every <= FRAGMENT_SLACK * whole.every and cut.per_step_s <= FRAGMENT_SLACK * whole.per_step_s:
            if cut.fits or not whole.fits:
                return cut
    return whole


def fewest_bytes(plans: list[RoundPlan], codecs: list[Codec]) -> RoundPlan:
    """The plan with the shortest H; on a tie, the least wire time among those whose step is within ``CODEC_SLACK``
    of the tie's fastest (then the more precise codec)."""
    shortest = min(p.every for p in plans)
    tied = [p for p in plans if p.every == shortest]
    fastest = min(p.per_step_s for p in tied)
    near = [p for p in tied if p.per_step_s <= CODEC_SLACK * fastest]
    return min(near, key=lambda p: (p.wire_s, codecs.index(p.codec)))


def with_delay(plan: RoundPlan, options: LocalSteps) -> RoundPlan:
    """``plan`` with its τ: none without overlap; the given ``delay``; else the fewest inner steps that hide a
    fragment's wire ``OVERLAP_SLACK`` times over, and at least until the next fragment leaves (H / fragments: the
    hosts' steps jitter, and a τ that covers only the wire makes the host ahead wait at landings). Never more than
    H; with one fragment, H (it lands at the next round's end)."""
    if not plan.overlap:
        delay = 0
    elif options.delay is not None:
        delay = options.delay
    else:
        wire = math.ceil(OVERLAP_SLACK * plan.fragment_wire_s / max(plan.step_s, 1e-9))
        delay = max(wire, math.ceil(plan.every / plan.fragments))
    return dataclasses.replace(plan, delay=min(plan.every, max(delay, 1 if plan.overlap else 0)))


def round_length(wire_s: float, local_s: float, step_s: float, options: LocalSteps, floor: int = 1) -> int:
    """The shortest H of at least ``floor`` (``wire_floor``'s) that hides an exchange of ``wire_s`` on the wire and
    ``local_s`` of codec work behind inner steps of ``step_s`` (``plan_rounds``' rule), capped at
    ``options.max_every``."""
    if options.overlap:
        needed = max(OVERLAP_SLACK * wire_s, local_s / options.budget) / max(step_s, 1e-9)
    else:
        needed = (wire_s + local_s) / (options.budget * max(step_s, 1e-9))
    return max(options.min_every, min(options.max_every, max(floor, math.ceil(needed))))


def wire_floor(codec: Codec, hosts: int, entries: int, options: LocalSteps) -> int:
    """The shortest H whose outer exchange in ``codec`` sends at most ``options.wire_share`` of the bytes per step
    that uncompressed synchronous allreduce sends (per link: a ring moves 2(N-1)/N of float32, an allgather N-1
    times the codes; the exchange's side with its ``WIRE_FRAMING``); 1 without a share or a second host."""
    if options.wire_share is None or hosts < 2:
        return 1
    sent = WIRE_FRAMING * link_share(codec, hosts) * codec.wire_bytes(entries)
    ratio = sent / (link_share(Codec.FP32, hosts) * Codec.FP32.wire_bytes(max(entries, 1)))
    return max(1, math.ceil(ratio / options.wire_share - 1e-9))


def replan(plan: RoundPlan, wire_s: float, local_s: float, step_s: float, options: LocalSteps) -> RoundPlan:
    """The plan with H and τ chosen again from measured times (``wire_s``: a round's fragments on the wire, as the
    last host to send saw them; the slowest rank's work and step): the link or the step changed, or the calibration
    misjudged them. The fragments stay; a given ``every``, ``delay`` or codec is kept.

    Where the options leave the codec open, it is chosen again by ``plan_rounds``' rule, each codec priced from what
    was measured: the wire scaled to its bytes on the link, the work with the plan's codec's predicted part
    (``codec_local``) swapped for its own. A calibration can misjudge a slow link by far (a rate shaper lets its
    small probes through at the full rate: at 10 Mbit/s a first plan predicted 27 ms for a round that took 1.07 s),
    and a codec chosen from it would otherwise stay for the whole run."""
    known = options.codec is None and plan.entries > 0 and len(plan.codec_local) == len(Codec)
    codecs = list(Codec) if known else [plan.codec]

    def again(codec: Codec) -> RoundPlan:
        wire, local, floor = wire_s, local_s, plan.wire_floor
        if codec is not plan.codec:
            sent = [link_share(c, plan.hosts) * c.wire_bytes(plan.entries) for c in (codec, plan.codec)]
            wire *= sent[0] / sent[1]
            works = [plan.codec_local[list(Codec).index(c)] for c in (codec, plan.codec)]
            local = max(0.0, local + works[0] - works[1])
            floor = wire_floor(codec, plan.hosts, plan.entries, options)
        every = plan.every if options.every is not None else round_length(wire, local, step_s, options, floor)
        fresh = dataclasses.replace(
            plan, codec=codec, every=every, wire_s=wire, step_s=step_s, local_s=local, delay=None, wire_floor=floor
        )
        return with_delay(fresh, options)

    return fewest_bytes([again(codec) for codec in codecs], codecs)


def prefer_local(sync_step_s: float, rounds: RoundPlan) -> bool:
    """``auto-far``'s choice: local steps only where they beat the best synchronous step by ``LOCAL_MARGIN``."""
    return rounds.hosts > 1 and rounds.per_step_s <= LOCAL_MARGIN * sync_step_s
