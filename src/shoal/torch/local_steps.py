"""Local steps with outer updates (DiLoCo) for ``DistributedOptimizer(comm="local")``: the torch carrier of
``shoal.plan.far``.

Each host is one DiLoCo worker. Its ranks reduce their gradients among themselves every step (the optimizer's
exchange runs on the host's process set; a host of one rank exchanges nothing), and step the user's optimizer. Every
H steps ``OuterRounds.after_step`` runs an outer round: the pseudo-gradient (the round's start weights minus the
weights now) is averaged across hosts by one rank per host in the chosen codec and broadcast inside each host; the
weights go back to the round's start, and the outer optimizer steps with the average as their gradient.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shoal.core.process_sets import ProcessSet, add_process_set, global_process_set
from shoal.core.rules import ReduceOp
from shoal.log import get_logger
from shoal.plan.far import INT8_CHUNK, Codec, LocalSteps, RoundPlan, plan_rounds
from shoal.plan.schemes import Planned, Scheme
from shoal.runtime import context
from shoal.torch import functions

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over the model's parameters."""

_log = get_logger()

PROBE_STEPS = 5
"""Inner steps timed before the planner chooses H where it was not given (the first is left out: it warms up)."""


@dataclass(frozen=True)
class HostGroups:
    """The process sets local steps run on: each host's ranks (the inner exchange), and one rank per host (the outer
    exchange)."""

    inner: ProcessSet
    """This host's ranks; a host of one rank gets a set it is not in, so that its exchange does nothing (as for a
    Horovod rank outside its optimizer's process set)."""
    leaders: ProcessSet | None
    """The first rank of every host, among whom the pseudo-gradient is averaged; None on a single host."""
    host: ProcessSet | None
    """This host's ranks when it has several (the averaged pseudo-gradient is broadcast in it), else None."""
    leader: bool
    """This rank is its host's first, and takes part in the outer exchange."""
    root: int
    """The global rank of this host's leader."""
    hosts: int

    @classmethod
    def register(cls) -> HostGroups:
        """Register the sets. Collective: every rank registers every host's set, in the same order."""
        topology = context.current().topology
        order: list[str] = []
        for host in topology.host_of_rank:
            if host not in order:
                order.append(host)
        members = {
            host: sorted(
                (r for r in range(topology.size) if topology.host_of_rank[r] == host),
                key=lambda r: topology.local_rank_of_rank[r],
            )
            for host in order
        }
        mine = members[topology.host_of_rank[topology.rank]]
        host_sets = {host: add_process_set(ranks) for host, ranks in members.items() if len(ranks) > 1}
        leaders: ProcessSet | None = None
        if len(order) > 1:
            firsts = [members[host][0] for host in order]
            leaders = global_process_set if len(firsts) == topology.size else add_process_set(firsts)
        own = host_sets.get(topology.host_of_rank[topology.rank])
        return cls(own or ProcessSet([]), leaders, own, mine[0] == topology.rank, mine[0], len(order))


class OuterRounds:
    """The outer rounds of one optimizer: the round's start weights, the outer optimizer, the codec's residual."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        options: LocalSteps,
        groups: HostGroups,
        outer_optimizer: OuterFactory | None = None,
    ) -> None:
        self.params = list(params)
        self.options = options
        self.groups = groups
        factory = outer_optimizer or default_outer(options)
        self.outer = factory(self.params)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(self.outer).__name__}")
        self.plan: RoundPlan | None = None
        """H and the codec in force (given, or planned)."""
        if options.every is not None and options.codec is not None:
            self.plan = RoundPlan(options.every, Codec(options.codec), 0.0, 0.0, groups.hosts)
        self._times: list[float] = []
        self._last: float | None = None
        self.steps = 0
        """Inner steps since the round's start."""
        self.rounds = 0
        """Outer rounds taken."""
        self.start = self._flat().clone()
        """The weights at the round's start, flat in float32."""
        self.feedback: Feedback | None = None
        """The lossy codec's error feedback (this host's)."""
        self.exchange_s = 0.0
        """The last outer exchange's wall seconds on this rank."""
        self.sent_bytes = 0
        """Bytes this rank sent in outer exchanges (its codec's payload per round)."""

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def entries(self) -> int:
        return int(self.start.numel())

    def set_plan(self, plan: RoundPlan) -> None:
        self.plan = plan

    def after_step(self) -> bool:
        """The user's optimizer stepped: count the inner step, and run the outer round when it is due. Returns
        whether a round ran."""
        self.steps += 1
        if self.plan is None:
            now = time.perf_counter()
            if self._last is not None:
                self._times.append(now - self._last)
            self._last = now
            if self.steps < PROBE_STEPS:
                return False
            self.set_plan(self.choose())
        assert self.plan is not None
        if self.steps < self.plan.every:
            return False
        self.outer_step()
        return True

    def choose(self) -> RoundPlan:
        """Plan H and the codec from the job's calibration and the slowest rank's inner step (rank 0's plan, on every
        rank). Collective."""
        from shoal.core.objects import broadcast_object
        from shoal.torch.layer_comm.calibrate import job_calibration

        times = sorted(self._times)
        mine = torch.tensor([times[len(times) // 2] if times else 0.0], dtype=torch.float64)
        slowest = float(functions.allreduce(mine, name="shoal.outer.step_time", op=ReduceOp.Max)[0])
        calibration = job_calibration()
        plan = plan_rounds(calibration, self.groups.hosts, self.entries(), slowest, self.options)
        plan = broadcast_object(plan, root_rank=0, name="shoal.outer.plan")
        _log.info("%s", plan.describe())
        return plan

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the pseudo-gradient across hosts and let the outer optimizer apply it to the round's start."""
        assert self.plan is not None
        started = time.perf_counter()
        delta = self.start - self._flat()
        groups = self.groups
        if groups.leaders is not None and groups.leader:
            delta = self._average(delta, self.plan.codec, groups.leaders)
        if groups.host is not None:
            delta = functions.broadcast(delta, groups.root, name=f"shoal.outer.host.{self.rounds}", process_set=groups.host)
        kept = []
        offset = 0
        for param in self.params:
            count = param.numel()
            param.copy_(self.start[offset : offset + count].view_as(param))
            kept.append(param.grad)
            param.grad = delta[offset : offset + count].view_as(param).to(param.dtype)
            offset += count
        try:
            self.outer.step()
        finally:
            for param, grad in zip(self.params, kept, strict=True):
                param.grad = grad
        self.start = self._flat()
        self.steps = 0
        self.rounds += 1
        self.exchange_s = time.perf_counter() - started

    def _average(self, delta: torch.Tensor, codec: Codec, leaders: ProcessSet) -> torch.Tensor:
        """The hosts' mean pseudo-gradient, the same on every host."""
        name = f"shoal.outer.{self.rounds}"
        if codec is Codec.FP32:
            self.sent_bytes += delta.numel() * 4
            return functions.allreduce(delta, name=name, op=ReduceOp.Average, process_set=leaders)
        if self.feedback is None or self.feedback.codec is not codec:
            self.feedback = Feedback(codec)
        payload = self.feedback.encode(delta)
        self.sent_bytes += sum(part.numel() * part.element_size() for part in payload)
        gathered = [
            functions.allgather(part.unsqueeze(0), name=f"{name}.{index}", process_set=leaders)
            for index, part in enumerate(payload)
        ]
        total = torch.zeros_like(delta)
        for host in range(gathered[0].shape[0]):  # in host order: the same sum on every host
            total += decode(codec, [part[host] for part in gathered], delta.numel())
        return total / gathered[0].shape[0]

    # ----- elastic state -----

    def state(self) -> dict[str, object]:
        """What a host that joins needs: the round's start, the outer optimizer's state, the inner steps taken."""
        return {"start": self.start.clone(), "outer": self.outer.state_dict(), "steps": self.steps, "rounds": self.rounds}

    def load_state(self, state: dict[str, object]) -> None:
        start = state["start"]
        assert isinstance(start, torch.Tensor)
        self.start = start.clone()
        self.outer.load_state_dict(state["outer"])  # type: ignore[arg-type]
        self.steps = int(state["steps"])  # type: ignore[call-overload]
        self.rounds = int(state["rounds"])  # type: ignore[call-overload]


def local_options(
    mode: Scheme | Planned, every: int | None, options: LocalSteps | None, outer: OuterFactory | None
) -> LocalSteps | None:
    """The local steps' settings for ``comm="local"`` (``every`` overrides ``options.every``), or None.

    Raises:
        ValueError: local steps' arguments with another ``comm``, or a bad value.
    """
    if mode is not Scheme.LOCAL:
        if every is not None or options is not None or outer is not None:
            raise ValueError(f"every=, local_steps= and outer_optimizer= go with comm='local', not comm={mode.value!r}")
        return None
    if options is not None and not isinstance(options, LocalSteps):
        raise ValueError(f"local_steps must be a shoal LocalSteps, got {type(options).__name__}")
    options = options or LocalSteps()
    if every is not None:
        options = dataclasses.replace(options, every=every)
    if outer is not None and not callable(outer):
        raise ValueError("outer_optimizer must be a callable that builds an optimizer from a list of parameters")
    return options


def check_local(op: ReduceOp, process_set: ProcessSet, compressed: bool, balanced: bool) -> None:
    """What local steps need of the optimizer's other arguments.

    Raises:
        ValueError: an argument local steps cannot honour.
    """
    if op != ReduceOp.Average:
        raise ValueError(f"comm='local' averages the hosts' weights: it needs op=Average, not {op.name}")
    if process_set is not global_process_set:
        raise ValueError("comm='local' runs over the whole job (each host is one worker): leave process_set global")
    if compressed:
        raise ValueError("comm='local' sets every layer's exchange: it takes neither compression= nor comm_overrides=")
    if balanced:
        raise ValueError("comm='local' with a BalancedLoader is not supported yet")


def host_groups(
    local: LocalSteps | None, op: ReduceOp, process_set: ProcessSet, compressed: bool, balanced: bool
) -> HostGroups | None:
    """With local steps: the arguments checked, and the host groups registered (collective); else None."""
    if local is None:
        return None
    check_local(op, process_set, compressed, balanced)
    return HostGroups.register()


def default_outer(options: LocalSteps) -> OuterFactory:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD at momentum 0)."""

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        momentum = options.outer_momentum
        return torch.optim.SGD(params, lr=options.outer_lr, momentum=momentum, nesterov=momentum > 0)

    return build


class Feedback:
    """A lossy codec with error feedback: each round sends the pseudo-gradient plus what rounding left out of the
    earlier rounds, and keeps what it leaves out now, so that the error does not accumulate."""

    def __init__(self, codec: Codec) -> None:
        if not codec.gathered:
            raise ValueError(f"{codec} is not a lossy codec")
        self.codec = codec
        self.residual: torch.Tensor | None = None

    def encode(self, delta: torch.Tensor) -> list[torch.Tensor]:
        """The payload for ``delta`` (float32, flat); the residual becomes what it leaves out."""
        corrected = delta if self.residual is None else delta + self.residual
        if self.codec is Codec.BF16:
            payload = [corrected.to(torch.bfloat16)]
        else:
            payload = list(int8_encode(corrected))
        self.residual = corrected - decode(self.codec, payload, corrected.numel())
        return payload


def decode(codec: Codec, payload: Sequence[torch.Tensor], count: int) -> torch.Tensor:
    """The float32 values a payload of ``codec`` stands for."""
    if codec is Codec.BF16:
        return payload[0].float()
    return int8_decode(payload[0], payload[1], count)


def int8_encode(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (one per entry) and a float32 scale per ``INT8_CHUNK`` entries (the chunk's largest magnitude maps
    to 127)."""
    count = values.numel()
    padded = torch.nn.functional.pad(values, (0, (-count) % INT8_CHUNK)).view(-1, INT8_CHUNK)
    scales = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1)[:count], scales


def int8_decode(codes: torch.Tensor, scales: torch.Tensor, count: int) -> torch.Tensor:
    """The float32 values ``int8_encode`` stands for."""
    padded = torch.nn.functional.pad(codes.float(), (0, (-count) % INT8_CHUNK)).view(-1, INT8_CHUNK)
    return (padded * scales.unsqueeze(1)).view(-1)[:count]
