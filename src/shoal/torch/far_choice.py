"""``comm="auto-far"``'s switch from the synchronous plan to local steps, and the collective plan of H both share."""

from __future__ import annotations

import sys
from typing import Any

import torch

from shoal.core.rules import ReduceOp
from shoal.plan.far import LocalSteps, RoundPlan, plan_rounds, prefer_local
from shoal.runtime import context
from shoal.torch import functions
from shoal.torch.host_groups import HostGroups

WEIGH_STEPS = 8
"""``auto-far`` weighs local steps after this many synchronous steps (its plan is made after the first)."""


def slowest_plan(
    hosts: int, sizes: list[int], times: list[float], options: LocalSteps, name: str, fragments: int = 1
) -> RoundPlan:
    """H and the codec from the job's calibration and the slowest rank's median of ``times`` (its inner steps), for
    parameters of ``sizes`` entries. Collective: every rank plans alike."""
    from shoal.torch.layer_comm.calibrate import job_calibration

    ordered = sorted(times or [0.0])
    mine = torch.tensor([ordered[len(ordered) // 2]], dtype=torch.float64)
    slowest = float(functions.allreduce(mine, name=name, op=ReduceOp.Max)[0])
    return plan_rounds(job_calibration(), hosts, sum(sizes), slowest, options, fragments, sizes)


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

    def decide(self, sizes: list[int], options: LocalSteps, computed: list[float], fragments: int) -> RoundPlan | None:
        """Local steps planned from the measured compute (``computed``: this rank's steps, less their waits) against
        the synchronous plan's step (that compute plus its predicted exchange); switch to them where they win.
        Collective: every rank decides alike, from the slowest rank's compute. Returns the rounds, or None."""
        rounds = slowest_plan(self.groups.hosts, sizes, computed, options, "shoal.outer.compute", fragments)
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
