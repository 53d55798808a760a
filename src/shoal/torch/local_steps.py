"""Local steps with outer updates (DiLoCo) for ``DistributedOptimizer(comm="local")``: the torch carrier of
``shoal.plan.far``.

Each host is one DiLoCo worker. Its ranks reduce their gradients among themselves every step (the optimizer's
exchange runs on the host's process set; a host of one rank exchanges nothing), and step the user's optimizer. The
model is cut into fragments of whole parameters (``fragment_bounds``). Every H steps each fragment, on its own step of
the round (H / fragments apart; the last at the round's end), sends its pseudo-gradient (its weights at its last
outer update minus its weights now), to be averaged across hosts by one rank per host in the chosen codec. It lands
(broadcast inside each host) τ inner steps later, or at once without overlap: the fragment's weights go back to
their start, the outer optimizer steps them with the average as their gradient, and the steps taken since it was
sent are added back. ``shoal.torch.far_choice`` is ``comm="auto-far"``'s switch to all this.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch

from shoal.core.rules import ReduceOp
from shoal.core.session import engine, poll, synchronize
from shoal.log import get_logger
from shoal.plan.far import LocalSteps, RoundPlan, fragment_bounds, replan
from shoal.plan.outer_wire import Codec
from shoal.torch import functions
from shoal.torch.far_choice import WEIGH_STEPS, FarChoice, slowest_plan
from shoal.torch.host_groups import HostGroups
from shoal.torch.layer_comm.report import report_rounds
from shoal.torch.outer_link import OuterLink, Pending
from shoal.torch.round_times import RoundTimes

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over the model's parameters."""

_log = get_logger()

PROBE_STEPS = 5
"""Inner steps timed before the planner chooses H where it was not given."""
QUIET_AFTER = 2
"""The engine's idle cycles before its pause grows (``Pauses.quiet_after``, 10 by default) once local steps are in
force: the hosts' exchanges come in bursts a fraction of a round apart, and each idle cycle crosses the far link
(about 1.4 kB per host) and takes CPU from the steps. ``bench.far --task chars`` at 10 Mbit/s, 20,000 samples: 538
and 540 bytes per sample in the rounds against 612 and 618 with 10, in 30.2 and 30.9 s against 31.3 and 32.2 s.
Only where every host has one rank: a host of several exchanges every step in cycles that every rank of the job
joins, and a host behind would then wake up to 200 ms late for them."""


class Fragments:
    """The model's parameters cut into fragments of whole parameters (``fragment_bounds``), and their flat float32
    copies (``None``: the whole model)."""

    def __init__(self, params: list[torch.Tensor], count: int) -> None:
        self.params = params
        self.bounds: list[tuple[int, int]] = []
        """Each fragment's parameters, as ``(first, end)`` indices."""
        self.spans: list[slice] = []
        """Each fragment's entries in the flat weights."""
        self.cut(count)

    def sizes(self) -> list[int]:
        """Each parameter's entries, in order."""
        return [param.numel() for param in self.params]

    def cut(self, count: int) -> None:
        self.bounds = fragment_bounds(self.sizes(), count)
        offsets = [0]
        for param in self.params:
            offsets.append(offsets[-1] + param.numel())
        self.spans = [slice(offsets[first], offsets[end]) for first, end in self.bounds]

    def __len__(self) -> int:
        return len(self.bounds)

    def of(self, fragment: int | None) -> list[torch.Tensor]:
        if fragment is None:
            return self.params
        first, end = self.bounds[fragment]
        return self.params[first:end]

    def flat(self, fragment: int | None = None) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.of(fragment)])

    def views(self, flat: torch.Tensor, fragment: int | None = None) -> list[torch.Tensor]:
        """``flat`` (as ``flat`` lays it out) as one view per parameter, in its shape."""
        params = self.of(fragment)
        parts = torch.split(flat, [p.numel() for p in params])
        return [part.view_as(param) for part, param in zip(parts, params, strict=True)]


class OuterRounds:
    """The outer rounds of one optimizer: the fragments' start weights, the outer optimizer, the codec's residuals,
    the exchanges in flight."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        options: LocalSteps,
        groups: HostGroups,
        outer_optimizer: OuterFactory | None = None,
        weigh: FarChoice | None = None,
    ) -> None:
        self.params = list(params)
        self.weigh = weigh
        """``auto-far``'s choice still to make (then None); the rounds do nothing until it chooses local steps."""
        self._computed: collections.deque[float] = collections.deque(maxlen=32)
        """While weighing: each step's wall seconds less its wait for the synchronous exchange."""
        self.options = options
        self.groups = groups
        factory = outer_optimizer or default_outer(options)
        self.outer = factory(self.params)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(self.outer).__name__}")
        self.inner = 0
        """Inner steps taken with local steps in force."""
        self.in_flight: dict[int, Pending] = {}
        """The exchanges on their way, by fragment."""
        self.cut = Fragments(self.params, options.fragments)
        self.synced = [0] * len(self.cut)
        """Per fragment, ``inner`` when its last landed exchange was sent."""
        self.plan: RoundPlan | None = None
        """H, the codec, the fragments and τ in force (given, or planned)."""
        if options.every is not None and options.codec is not None:
            # Nothing measured yet: a fragment lands before it is sent again, until the first times re-plan τ.
            codec, delay, fragments = Codec(options.codec), options.delay, self.fragments
            self.adopt(RoundPlan(options.every, codec, 0.0, 0.0, groups.hosts, 0.0, options.overlap, fragments, delay))
        self.times = RoundTimes()
        self.replans: list[tuple[int, int, float, str]] = []
        """(round, H, ``time.time()``, codec) each time measured times changed H or the codec."""
        self.steps = 0
        """Inner steps since the round's start."""
        self.sent = 0
        """The fragments sent in this round (they go in order)."""
        self.rounds = 0
        """Outer rounds taken."""
        self.start = self.cut.flat().clone()
        """The weights at the fragments' last outer updates, flat in float32."""
        self.link = OuterLink(groups)
        """The outer exchanges' codecs and transport."""
        self.disabled = False
        """``auto-far`` kept the synchronous plan: the rounds never run."""
        self.planning_s = 0.0
        """Wall seconds the plan took (the calibration's probes, where this job had not measured them yet)."""
        self.lost_steps = 0
        """Inner steps of hosts that left an elastic job before their work reached an outer update."""

    @property
    def fragments(self) -> int:
        return len(self.cut)

    def adopt(self, plan: RoundPlan | None) -> None:
        """Put ``plan`` in force, with the model cut into its fragments (as many as the settings allow before a
        plan); only while none is in flight."""
        if plan is None or plan.fragments != self.fragments:
            assert not self.in_flight, "the fragments change only while none is in flight"
            self.cut.cut(plan.fragments if plan is not None else self.options.fragments)
            self.synced = [self.inner] * self.fragments
        if plan is not None:  # the plan_report shows it
            report_rounds(plan := dataclasses.replace(plan, fragments=self.fragments))
            if 1 < self.groups.hosts == engine().size:  # hosts of one rank: nothing crosses the link but the rounds
                engine().pauses.quiet_after = QUIET_AFTER
        self.plan = plan

    def unsynced(self) -> int:
        """The host's inner steps not yet in an outer update that landed for every fragment."""
        return self.inner - min(self.synced, default=self.inner)

    def restart(self) -> None:
        """Every fragment starts a round from the weights now (nothing in flight, no step unsynced)."""
        self.start = self.cut.flat()
        self.steps = self.sent = 0
        self.synced = [self.inner] * self.fragments

    def after_step(self, waited: float = 0.0) -> bool:
        """The user's optimizer stepped (having waited ``waited`` seconds for the exchange): count the inner step,
        and send or land the fragments that are due. Returns whether any was."""
        self.steps += 1
        if self.groups.hosts == 1 or self.disabled:  # one host: its ranks are synchronous, nothing to meet on
            self.steps = 0
            return False
        now = time.perf_counter()
        took = self.times.step(now)
        if took is not None and self.weigh is not None:
            self._computed.append(took - waited)
        if self.weigh is not None:
            if self.steps >= WEIGH_STEPS:
                self._weigh(self.weigh)
            return False
        self.inner += 1
        for pending in self.in_flight.values():
            pending.age += 1
            if pending.done_at is None and all(poll(h) for h in pending.handles):
                pending.done_at = now
        if self.plan is None:
            if self.steps < PROBE_STEPS:
                return False
            started = time.perf_counter()
            self.adopt(self.choose())
            self.planning_s = time.perf_counter() - started
        assert self.plan is not None
        return self._advance(self.plan)

    @torch.no_grad()
    def _weigh(self, weigh: FarChoice) -> None:
        """``auto-far``'s choice, once (collective): switch to local steps, or stay synchronous for good."""
        self.weigh = None
        rounds = weigh.decide(self.cut.sizes(), self.options, list(self._computed)[1:], self.fragments)
        if rounds is None:  # step 1 warmed up the plan
            self.disabled = True
            return
        self.adopt(rounds)
        self.restart()
        self.times.steps.clear()

    def choose(self) -> RoundPlan:
        """Plan H, the codec and τ from the slowest rank's inner step. Collective."""
        plan = slowest_plan(
            self.groups.hosts, self.cut.sizes(), list(self.times.steps), self.options, "shoal.outer.step_time", self.fragments
        )
        _log.info("%s", plan.describe())
        return plan

    def _due(self, plan: RoundPlan) -> int:
        """The inner step of the round at which the next fragment is sent."""
        return (self.sent + 1) * plan.every // plan.fragments

    @torch.no_grad()
    def _advance(self, plan: RoundPlan) -> bool:
        """Land the exchanges τ steps old (and any whose fragment is due again), then send the fragments due at
        this step of the round; the round ends with its last fragment."""
        landing = sorted(f for f, pending in self.in_flight.items() if pending.age >= plan.tau)
        sending = []
        while self.sent < self.fragments and self.steps >= self._due(plan):
            sending.append(self.sent)
            self.sent += 1
        landing += [f for f in sending if f in self.in_flight and f not in landing]
        if not landing and not sending:
            return False
        begun = started = time.perf_counter()
        waited = sum(self._land(self.in_flight.pop(fragment)) for fragment in landing)
        for fragment in sending:
            pending = self._send(fragment)
            if fragment == self.fragments - 1:
                self._end_round(pending, time.perf_counter() - started - waited)
                self.times.waited_s += waited
                started, waited = time.perf_counter(), 0.0
            if plan.overlap:
                self.in_flight[fragment] = pending
            else:
                waited += self._land(pending)
        self.times.work += time.perf_counter() - started - waited
        self.times.waited_s += waited
        self.times.exchange_s += time.perf_counter() - begun
        self.times.last = time.perf_counter()  # the outer work is not an inner step
        return True

    def _end_round(self, last: Pending, work: float) -> None:
        """The round's last fragment is sent: the times measured go with it (``RoundTimes.end_round``, for
        ``replan`` where it lands), and the next round starts."""
        measured = self.times.end_round(work, bool(last.handles))
        last.stats = functions.allreduce_async(measured, name=f"shoal.outer.times.{self.rounds}", op=ReduceOp.Max)
        self.steps = self.sent = 0
        self.rounds += 1

    @torch.no_grad()
    def finish(self) -> bool:
        """Make the hosts meet now: land what is in flight, then average the hosts' weights (a blocking exchange of
        every fragment's steps since, without an outer step: an outer step's momentum, taken once more at an
        arbitrary point, overshoots). Returns whether anything was exchanged."""
        if self.groups.hosts == 1 or (not self.in_flight and self.unsynced() == 0):
            return False
        if self.plan is None:
            self.adopt(self.choose())
        for fragment in sorted(self.in_flight):
            self._land(self.in_flight.pop(fragment))
        for pending in [self._send(fragment) for fragment in range(self.fragments)]:
            self._land(pending, average=True)
        self.steps = self.sent = 0
        self.rounds += 1
        return True

    def _send(self, fragment: int) -> Pending:
        """Start averaging the fragment's pseudo-gradient across hosts."""
        assert self.plan is not None
        weights = self.cut.flat(fragment)
        delta = self.start[self.cut.spans[fragment]] - weights
        return self.link.send(self.plan.codec, fragment, delta, weights, self.rounds, self.inner)

    def _land(self, pending: Pending, average: bool = False) -> float:
        """Wait for a fragment's exchange, step the outer optimizer on the fragment from its start with the hosts'
        mean pseudo-gradient (``average``: no outer step, the hosts' mean weights), and keep the inner steps taken
        since it was sent on top (none without overlap); a round's last fragment then chooses H and τ again from
        the times measured with it. Returns the seconds spent waiting."""
        fragment = pending.fragment
        started = time.perf_counter()
        mean = self.link.mean(pending)
        measured = synchronize(pending.stats) if pending.stats is not None else None  # a wait too, not outer work
        waited = time.perf_counter() - started
        if pending.handles:
            self.times.on_wire.append((pending.sent_at, pending.done_at or time.perf_counter()))
        if measured is not None:
            self._replan(measured)
        params, span = self.cut.of(fragment), self.cut.spans[fragment]
        progress = self.cut.flat(fragment) - pending.weights
        kept = [param.grad for param in self.params]
        for param in self.params:  # the outer optimizer steps this fragment alone
            param.grad = None
        for param, start, step in zip(
            params, self.cut.views(self.start[span], fragment), self.cut.views(mean, fragment), strict=True
        ):
            param.copy_(start)
            param.grad = step.to(param.dtype)
        try:
            if average:
                torch._foreach_sub_(params, [param.grad for param in params])  # type: ignore[misc]
            else:
                self.outer.step()
        finally:
            for param, grad in zip(self.params, kept, strict=True):
                param.grad = grad
        self.start[span] = self.cut.flat(fragment)
        self.synced[fragment] = pending.sent_step
        if bool(progress.any()):
            for param, carried in zip(params, self.cut.views(progress, fragment), strict=True):
                param.add_(carried.to(param.dtype))
        return waited

    def _replan(self, measured: torch.Tensor) -> None:
        """H and τ again from the times measured (``RoundTimes.end_round``, the same on every rank)."""
        assert self.plan is not None
        negated, local, step = (float(v) for v in measured)
        wire = -negated
        if not math.isfinite(wire) or wire <= 0 or step <= 0:
            return
        plan = replan(self.plan, wire, local, step, self.options)
        if (plan.every, plan.codec) != (self.plan.every, self.plan.codec):
            self.replans.append((self.rounds, plan.every, time.time(), plan.codec.value))
            was = f"{self.plan.every}, {self.plan.codec}"
            _log.info("local steps: every %d steps, %s now (was %s): %s", plan.every, plan.codec, was, plan.describe())
        self.adopt(plan)


def default_outer(options: LocalSteps) -> OuterFactory:
    """DiLoCo's outer optimizer, SGD with Nesterov momentum, at ``options``' learning rate and momentum (plain SGD at
    momentum 0)."""

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        momentum = options.outer_momentum
        return torch.optim.SGD(params, lr=options.outer_lr, momentum=momentum, nesterov=momentum > 0)

    return build
