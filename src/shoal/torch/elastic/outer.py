"""Local steps in an elastic job: the outer state committed, rolled back and handed to newcomers with the model.

The outer state is what ``OuterRounds`` keeps beside the weights: the round's start weights, the outer optimizer's
state (its momentum), the round's step count, H and the codec, and whether ``auto-far`` chose local steps. A commit
copies it; a rollback puts it back and forgets the exchange in flight (its peers may be gone). After the job
re-forms, every rank registers the hosts' process sets again (collective, before the sync) and the sync makes the
hosts one again:
- rank 0's outer state goes to every rank (the driver keeps rank 0 on a worker that was training);
- the weights become the round's start plus the mean of the progress since it of the hosts that were training (a
  newcomer brings none); where none was (a new job) they are rank 0's;
- a host that left takes its steps not yet in a landed outer update with it: they are counted as lost, on
  ``rounds_of(optimizer).lost_steps`` and in a warning.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from shoal.core.basics import rank
from shoal.core.rules import ReduceOp
from shoal.log import get_logger
from shoal.plan.far import RoundPlan
from shoal.torch.host_groups import HostGroups
from shoal.torch.local_steps import OuterRounds

_log = get_logger()


@dataclass
class OuterState:
    """A copy of an ``OuterRounds``' state (never the exchange in flight)."""

    start: torch.Tensor
    outer: dict[str, Any]
    steps: int
    sent: int
    """The fragments sent in the round."""
    inner: int
    synced: list[int]
    rounds: int
    plan: RoundPlan | None
    phase: str
    """``"weighing"`` (``auto-far`` still to choose), ``"local"`` or ``"synchronous"`` (it kept the plan)."""
    unsynced: int
    """The host's inner steps not yet in a landed outer update."""
    hosts: int
    """The hosts of the job it was taken in."""
    lost_steps: int
    trained: bool
    """The rounds had taken steps (a newcomer's have not)."""


def snapshot(rounds: OuterRounds) -> OuterState:
    """``rounds``' state now, copied."""
    phase = "weighing" if rounds.weigh is not None else ("synchronous" if rounds.disabled else "local")
    return OuterState(
        rounds.start.clone(),
        copy.deepcopy(rounds.outer.state_dict()),
        rounds.steps,
        rounds.sent,
        rounds.inner,
        list(rounds.synced),
        rounds.rounds,
        rounds.plan,
        phase,
        rounds.unsynced(),
        rounds.groups.hosts,
        rounds.lost_steps,
        rounds.rounds > 0 or rounds.unsynced() > 0,
    )


class ElasticOuter:
    """The outer state of one optimizer's local steps, as its ``TorchState`` commits, restores and syncs it."""

    def __init__(self, rounds: OuterRounds, exchange: Any) -> None:
        self.rounds = rounds
        self.exchange = exchange
        self.saved = snapshot(rounds)
        self.hosts_before = rounds.groups.hosts
        """The hosts of the job before the last re-form (what a departure is counted against)."""
        self.carried = 0
        """The unsynced steps of an exchange in flight that a rollback or re-form forgot."""
        self._incoming: OuterState | None = None
        self._mean: torch.Tensor | None = None

    def save(self) -> None:
        self.saved = snapshot(self.rounds)

    def restore(self) -> None:
        """Back to the commit; the exchange in flight is forgotten (its inner steps stay in the weights)."""
        self.carried = self.saved.unsynced
        _put_back(self.rounds, self.saved)

    def regroup(self) -> None:
        """After the job re-formed: the hosts' process sets registered again (collective, every rank in the same
        order, before the sync) and the exchange moved onto this host's new set where it was on the old one. The
        exchange in flight belonged to the old job: it is forgotten."""
        rounds = self.rounds
        if rounds.in_flight:
            self.carried = rounds.unsynced()
            rounds.in_flight = {}
        old, groups = rounds.groups, HostGroups.register()
        self.hosts_before, rounds.groups = old.hosts, groups
        rounds.link.regroup(groups)
        rounds.times.last = None  # the re-form is not an inner step
        if rounds.weigh is not None:
            rounds.weigh.groups = groups
        if self.exchange.process_set is old.inner:
            self.exchange.point_at(groups.inner)
            self.exchange.router.facts.process_set = groups.inner

    def prepare(self) -> None:
        """The sync's first half, before the model's broadcast from rank 0 (collective): rank 0's outer state, and
        the mean progress since its round's start of the hosts that were training (a host's first rank speaks for
        it); the steps of hosts that left are counted as lost."""
        from shoal.core.objects import broadcast_object
        from shoal.torch import functions

        rounds = self.rounds
        mine = snapshot(rounds)
        mine.hosts, mine.unsynced = self.hosts_before, max(mine.unsynced, self.carried)
        state: OuterState = broadcast_object(mine, 0, name="elastic.sync.outer")
        speaks = rounds.groups.leader and mine.trained and state.start.shape == rounds.start.shape
        progress = rounds.cut.flat() - state.start if speaks else torch.zeros_like(state.start)
        summed = torch.cat([progress, torch.ones(1) * speaks])
        total = functions.allreduce(summed, name="elastic.sync.outer.progress", op=ReduceOp.Sum)
        hosts = round(float(total[-1]))
        self._mean = total[:-1] / hosts if hosts else None
        gone = max(0, state.hosts - hosts) if state.hosts > 1 else 0
        lost = gone * state.unsynced
        state.lost_steps += lost
        if lost and rank() == 0:
            _log.warning(
                "local steps: %d host(s) left the job with %d inner steps each not yet in an outer update: %d inner steps lost",
                gone,
                state.unsynced,
                lost,
            )
        self._incoming = state

    @torch.no_grad()
    def apply(self) -> None:
        """The sync's second half, after the model's broadcast: the merged weights (where hosts were training) and
        rank 0's outer state."""
        rounds, state = self.rounds, self._incoming
        assert state is not None
        if self._mean is not None:
            for param, value in zip(rounds.params, rounds.cut.views(state.start + self._mean), strict=True):
                param.copy_(value.to(param.dtype))
        _put_back(rounds, state)
        if state.hosts == 1 or self._mean is None:  # no round was running: the next one starts from here
            rounds.restart()
        if rounds.plan is not None:
            rounds.plan = dataclasses.replace(rounds.plan, hosts=rounds.groups.hosts)
        self.hosts_before, self.carried, self._incoming, self._mean = rounds.groups.hosts, 0, None, None


def _put_back(rounds: OuterRounds, state: OuterState) -> None:
    rounds.start = state.start.clone()
    rounds.outer.load_state_dict(copy.deepcopy(state.outer))
    rounds.in_flight = {}
    rounds.adopt(state.plan)
    rounds.steps, rounds.sent, rounds.rounds = state.steps, state.sent, state.rounds
    rounds.inner, rounds.synced, rounds.lost_steps = state.inner, list(state.synced), state.lost_steps
    _set_phase(rounds, state.phase)


def _set_phase(rounds: OuterRounds, phase: str) -> None:
    """``auto-far``'s choice as ``phase`` says: a newcomer still weighing takes the job's."""
    if phase == "weighing" or rounds.weigh is None:
        return
    weigh, rounds.weigh = rounds.weigh, None
    if phase == "synchronous":
        rounds.disabled = True
    elif rounds.plan is not None:
        weigh.go_local(rounds.plan)
