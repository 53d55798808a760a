"""Local steps with outer updates (DiLoCo) for ``DistributedOptimizer(comm="local")``: the torch carrier of
``shoal.plan.far``.

Each host is one DiLoCo worker. Its ranks reduce their gradients among themselves every step (the optimizer's
exchange runs on the host's process set; a host of one rank exchanges nothing), and step the user's optimizer. Every
H steps ``OuterRounds.after_step`` ends a round: the pseudo-gradient (the round's start weights minus the weights now)
is sent to be averaged across hosts by one rank per host in the chosen codec, and lands (broadcast inside each host)
at the next round's end, or at once without overlap; then the weights go back to the round's start, the outer
optimizer steps with the average as their gradient, and the steps taken since it was sent are added back.
``FarChoice`` is ``comm="auto-far"``'s switch to all this from the synchronous plan.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.core.rules import ReduceOp
from shoal.core.session import poll, synchronize
from shoal.log import get_logger
from shoal.plan.far import Codec, LocalSteps, RoundPlan, plan_rounds, prefer_local, replan
from shoal.runtime import context
from shoal.torch import functions
from shoal.torch.host_groups import HostGroups
from shoal.torch.outer_codec import Feedback, decode, padded_buffer

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over the model's parameters."""

_log = get_logger()

PROBE_STEPS = 5
"""Inner steps timed before the planner chooses H where it was not given."""
WEIGH_STEPS = 8
"""``auto-far`` weighs local steps after this many synchronous steps (its plan is made after the first)."""


@dataclass
class Pending:
    """An outer exchange on its way."""

    handles: list[int]
    """The engine's handles (a host's first rank), none elsewhere."""
    codec: Codec
    count: int
    weights: torch.Tensor
    """This rank's weights when it was sent: the inner steps since are kept on top of the outer update."""
    round: int
    sent_at: float
    steps: int = 0
    """The inner steps of the round it carries."""
    done_at: float | None = None
    """When the inner steps first saw it done (polled after each step)."""
    stats: int | None = None
    """The handle of the measured times sent with it (the slowest rank's, for ``replan``)."""


def slowest_plan(hosts: int, entries: int, times: list[float], options: LocalSteps, name: str) -> RoundPlan:
    """H and the codec from the job's calibration and the slowest rank's median of ``times`` (its inner steps).
    Collective: every rank plans alike."""
    from shoal.torch.layer_comm.calibrate import job_calibration

    ordered = sorted(times or [0.0])
    mine = torch.tensor([ordered[len(ordered) // 2]], dtype=torch.float64)
    slowest = float(functions.allreduce(mine, name=name, op=ReduceOp.Max)[0])
    return plan_rounds(job_calibration(), hosts, entries, slowest, options)


class FarChoice:
    """``auto-far``: whether local steps beat the synchronous plan, decided once the plan has run a few steps, and
    the switch to them."""

    def __init__(self, exchange: Any, groups: HostGroups) -> None:
        self.exchange = exchange
        self.groups = groups

    def sync_comm_s(self) -> float:
        """The synchronous plan's predicted exchange per step: every layer's chosen scheme (0 before a plan)."""
        plans = self.exchange.router.plans or []
        return sum(plan.predicted_ms.get(plan.choice, 0.0) for plan in plans) / 1e3

    def decide(self, entries: int, options: LocalSteps, computed: list[float]) -> RoundPlan | None:
        """Local steps planned from the measured compute (``computed``: this rank's steps, less their waits) against
        the synchronous plan's step (that compute plus its predicted exchange); switch to them where they win.
        Collective: every rank decides alike, from the slowest rank's compute. Returns the rounds, or None."""
        rounds = slowest_plan(self.groups.hosts, entries, computed, options, "shoal.outer.compute")
        sync = rounds.step_s + self.sync_comm_s()
        chosen = prefer_local(sync, rounds)
        if context.current().topology.rank == 0:
            print(
                f"[shoal] comm='auto-far' chose {'local steps' if chosen else 'the synchronous plan'}: synchronous "
                f"{1e3 * sync:.2f} ms per step (compute {1e3 * rounds.step_s:.2f} ms, exchange predicted) against "
                f"{1e3 * rounds.per_step_s:.2f} ms; {rounds.describe()}",
                file=sys.stderr,
                flush=True,
            )
        if not chosen:
            return None
        self.go_local(rounds)
        return rounds

    def go_local(self, rounds: RoundPlan) -> None:
        """From the next step on, the gradients are reduced inside each host only, and the plan says local steps."""
        self.exchange.point_at(self.groups.inner)
        self.exchange.router.go_local(rounds)


class OuterRounds:
    """The outer rounds of one optimizer: the round's start weights, the outer optimizer, the codec's residual."""

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
        self.plan: RoundPlan | None = None
        """H and the codec in force (given, or planned)."""
        if options.every is not None and options.codec is not None:
            self.plan = RoundPlan(options.every, Codec(options.codec), 0.0, 0.0, groups.hosts, overlap=options.overlap)
        self._times: collections.deque[float] = collections.deque(maxlen=32)
        """The last inner steps' wall seconds (a round's end left out)."""
        self._last: float | None = None
        self._ends: collections.deque[tuple[float, float]] = collections.deque(maxlen=3)
        """The last rounds' (wire, round-end work) seconds: H follows their medians, or the last wire if slower."""
        self._wire = 0.0
        """The last landed exchange's wire seconds, as this rank saw it (0 where it sends nothing)."""
        self.replans: list[tuple[int, int, float]] = []
        """(round, H, ``time.time()``) each time measured times changed H."""
        self.steps = 0
        """Inner steps since the round's start."""
        self.rounds = 0
        """Outer rounds taken."""
        self.start = self._flat().clone()
        """The weights at the round's start, flat in float32."""
        self.feedback: Feedback | None = None
        """The lossy codec's error feedback (this host's)."""
        self._work: torch.Tensor | None = None
        self.disabled = False
        """``auto-far`` kept the synchronous plan: the rounds never run."""
        self.planning_s = 0.0
        """Wall seconds the plan took (the calibration's probes, where this job had not measured them yet)."""
        self.in_flight: Pending | None = None
        """The exchange sent at the last round's end, while it overlaps this round."""
        self.exchange_s = 0.0
        """Wall seconds this rank spent at rounds' ends (encoding, sending, and waiting where not hidden)."""
        self.sent_bytes = 0
        """Bytes this rank sent in outer exchanges (its codec's payload per round)."""
        self.lost_steps = 0
        """Inner steps of hosts that left an elastic job before their work reached an outer update."""

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (as ``_flat`` lays it out) as one view per parameter, in its shape."""
        parts = torch.split(flat, [p.numel() for p in self.params])
        return [part.view_as(param) for part, param in zip(parts, self.params, strict=True)]

    def entries(self) -> int:
        return int(self.start.numel())

    def after_step(self, waited: float = 0.0) -> bool:
        """The user's optimizer stepped (having waited ``waited`` seconds for the exchange): count the inner step,
        and run the outer round when it is due. Returns whether a round ran."""
        self.steps += 1
        if self.groups.hosts == 1 or self.disabled:  # one host: its ranks are synchronous, nothing to meet on
            self.steps = 0
            return False
        now = time.perf_counter()
        if self._last is not None:
            self._times.append(now - self._last)
            if self.weigh is not None:
                self._computed.append(now - self._last - waited)
        self._last = now
        if self.weigh is not None:
            if self.steps >= WEIGH_STEPS:
                self._weigh(self.weigh)
            return False
        pending = self.in_flight
        if pending is not None and pending.done_at is None and all(poll(h) for h in pending.handles):
            pending.done_at = now
        if self.plan is None:
            if self.steps < PROBE_STEPS:
                return False
            started = time.perf_counter()
            self.plan = self.choose()
            self.planning_s = time.perf_counter() - started
        assert self.plan is not None
        if self.steps < self.plan.every:
            return False
        self.round()
        return True

    @torch.no_grad()
    def _weigh(self, weigh: FarChoice) -> None:
        """``auto-far``'s choice, once (collective): switch to local steps, or stay synchronous for good."""
        self.weigh = None
        rounds = weigh.decide(self.entries(), self.options, list(self._computed)[1:])  # step 1 warmed up the plan
        if rounds is None:
            self.disabled = True
            return
        self.plan = rounds
        self.start = self._flat()
        self.steps = 0
        self._times.clear()

    def choose(self) -> RoundPlan:
        """Plan H and the codec from the slowest rank's inner step. Collective."""
        plan = slowest_plan(self.groups.hosts, self.entries(), list(self._times), self.options, "shoal.outer.step_time")
        _log.info("%s", plan.describe())
        return plan

    @torch.no_grad()
    def round(self) -> None:
        """The round's end: land the previous round's exchange where it overlapped this one, then send this
        round's pseudo-gradient (and, without overlap, wait for it and apply it)."""
        assert self.plan is not None
        started = time.perf_counter()
        waited = 0.0
        if self.in_flight is not None:
            waited = self._land(self.in_flight)
            self.in_flight = None
        now = self._flat()
        pending = self._send(self.start - now, now)
        self._ends.append((self._wire, time.perf_counter() - started - waited))
        wires, works = zip(*self._ends, strict=True)
        wire, local = max(statistics.median(wires), wires[-1]), statistics.median(works)
        measured = torch.tensor([wire, local, statistics.median(self._times or [0.0])], dtype=torch.float64)
        name = f"shoal.outer.times.{self.rounds}"
        pending.stats = functions.allreduce_async(measured, name=name, op=ReduceOp.Max)
        if self.plan.overlap:
            self.in_flight = pending
        else:
            self._land(pending)
        self.steps = 0
        self.rounds += 1
        self.exchange_s += time.perf_counter() - started
        self._last = time.perf_counter()  # the round's end is not an inner step

    @torch.no_grad()
    def finish(self) -> bool:
        """Make the hosts meet now: land what is in flight, then average the hosts' weights (a blocking exchange of
        the steps since, without an outer step: an outer step's momentum, taken once more at an arbitrary point,
        overshoots). Returns whether anything was exchanged."""
        if self.groups.hosts == 1 or (self.in_flight is None and self.steps == 0):
            return False
        if self.plan is None:
            self.plan = self.choose()
        if self.in_flight is not None:
            self._land(self.in_flight)
            self.in_flight = None
        now = self._flat()
        self._land(self._send(self.start - now, now), average=True)
        self.steps = 0
        self.rounds += 1
        return True

    def _send(self, delta: torch.Tensor, weights: torch.Tensor) -> Pending:
        """Start averaging ``delta`` across hosts (one rank per host sends; the others only wait for the result)."""
        assert self.plan is not None
        codec, groups = self.plan.codec, self.groups
        handles: list[int] = []
        if groups.leaders is not None and groups.leader:
            name = f"shoal.outer.{self.rounds}"
            if codec is Codec.FP32:
                payload = [delta]
                handles = [functions.allreduce_async(delta, name=name, op=ReduceOp.Average, process_set=groups.leaders)]
            else:
                if self.feedback is None or self.feedback.codec is not codec:
                    self.feedback = Feedback(codec)
                payload = self.feedback.encode(delta)
                handles = [
                    functions.allgather_async(part.unsqueeze(0), name=f"{name}.{index}", process_set=groups.leaders)
                    for index, part in enumerate(payload)
                ]
            self.sent_bytes += sum(part.numel() * part.element_size() for part in payload)
        return Pending(handles, codec, delta.numel(), weights, self.rounds, time.perf_counter(), self.steps)

    def _land(self, pending: Pending, average: bool = False) -> float:
        """Wait for an exchange, step the outer optimizer from the round's start with the hosts' mean pseudo-gradient
        (``average``: no outer step, the hosts' mean weights), and keep the inner steps taken since it was sent on
        top (none without overlap); then choose H again from the times measured with it. Returns the seconds spent
        waiting."""
        started = time.perf_counter()
        mean = self._mean(pending)
        waited = time.perf_counter() - started
        if pending.handles:
            self._wire = (pending.done_at or time.perf_counter()) - pending.sent_at
        if pending.stats is not None:
            self._replan(synchronize(pending.stats))
        progress = self._flat() - pending.weights
        kept = [param.grad for param in self.params]
        for param, start, step in zip(self.params, self._views(self.start), self._views(mean), strict=True):
            param.copy_(start)
            param.grad = step.to(param.dtype)
        try:
            if average:
                torch._foreach_sub_(self.params, [param.grad for param in self.params])  # type: ignore[misc]
            else:
                self.outer.step()
        finally:
            for param, grad in zip(self.params, kept, strict=True):
                param.grad = grad
        self.start = self._flat()
        if bool(progress.any()):
            for param, carried in zip(self.params, self._views(progress), strict=True):
                param.add_(carried.to(param.dtype))
        return waited

    def _replan(self, measured: torch.Tensor) -> None:
        """H again from the slowest rank's measured wire, round-end work and inner step (the same on every rank)."""
        assert self.plan is not None
        wire, local, step = (float(v) for v in measured)
        if wire <= 0 or step <= 0:
            return
        plan = replan(self.plan, wire, local, step, self.options)
        if plan.every != self.plan.every:
            self.replans.append((self.rounds, plan.every, time.time()))
            _log.info("local steps: every %d steps now (was %d): %s", plan.every, self.plan.every, plan.describe())
        self.plan = plan

    def _mean(self, pending: Pending) -> torch.Tensor:
        """The hosts' mean pseudo-gradient, the same on every rank (summed in host order)."""
        groups = self.groups
        if pending.handles:
            results = [synchronize(handle) for handle in pending.handles]
            if pending.codec is Codec.FP32:
                mean = results[0]
            else:
                mean = torch.zeros(pending.count)
                self._work = work = padded_buffer(self._work, pending.count)
                for host in range(results[0].shape[0]):
                    mean += decode(pending.codec, [part[host] for part in results], pending.count, work)
                mean /= results[0].shape[0]
        else:
            mean = torch.empty(pending.count)
        if groups.host is not None:
            name = f"shoal.outer.host.{pending.round}"
            mean = functions.broadcast(mean, groups.root, name=name, process_set=groups.host)
        return mean


def default_outer(options: LocalSteps) -> OuterFactory:
    """DiLoCo's outer optimizer, SGD with Nesterov momentum, at ``options``' learning rate and momentum (plain SGD at
    momentum 0)."""

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        momentum = options.outer_momentum
        return torch.optim.SGD(params, lr=options.outer_lr, momentum=momentum, nesterov=momentum > 0)

    return build
