"""What the planner decided, for people: the last plan of this job, its one-line summaries, and ``plan_report()``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shoal.core import basics
from shoal.plan.calibration import Calibration
from shoal.plan.far import RoundPlan
from shoal.plan.planner import LayerPlan, format_plan
from shoal.runtime import context
from shoal.torch.layer_comm.lossy import LossyState, LowRank, TopK
from shoal.torch.layer_comm.schemes import LayerComm


@dataclass
class LastPlan:
    """The most recent plan made by any DistributedOptimizer in this job (kept in the process context)."""

    plans: list[LayerPlan]
    workers: int
    refits: int
    """How many times drift made it recalibrate."""
    calibration: Calibration
    rounds: RoundPlan | None = None
    """Local steps' H and codec, where ``auto-far`` chose them."""
    note: Callable[[], str | None] | None = None
    """What the plan is not doing yet, asked at each report (the compressed layers' warm-up)."""


def last_plan() -> LastPlan | None:
    """The most recent ``comm="auto"`` plan of this job (its ``plans`` fill in measured times as training runs)."""
    plan: LastPlan | None = context.current().part("torch.last_plan")
    return plan


def report_rounds(rounds: RoundPlan) -> None:
    """Local steps were planned again: the last plan, where it reports local steps, shows the rounds now in force."""
    plan = last_plan() if basics.is_initialized() else None
    if plan is not None and plan.rounds is not None:
        plan.rounds = rounds


def describe_choices(plans: list[LayerPlan]) -> str:
    """``allreduce: 3, sfb: 2`` for a plan."""
    counts: dict[str, int] = {}
    for plan in plans:
        counts[plan.choice.value] = counts.get(plan.choice.value, 0) + 1
    return ", ".join(f"{scheme}: {count}" for scheme, count in sorted(counts.items()))


def describe_calibration(calibration: Calibration) -> str:
    """What the plan rests on: the measured allreduce line and the matmul rate."""
    latency, per_byte = calibration.lines["allreduce"]
    bandwidth = 1 / per_byte / 1e9 if per_byte else float("inf")
    return f"allreduce {latency * 1e3:.3f} ms + {bandwidth:.2f} GB/s, matmul {calibration.flops_per_s / 1e9:.1f} GFLOP/s"


def warmup_note(layers: Callable[[], list[LayerComm]], lossy: LossyState, cast: bool) -> str | None:
    """While compressed layers are in their warm-up: how many, what they send meanwhile, and until which step.
    ``layers``: the router's carriers now; ``cast``: the warm-up sends bfloat16 (``auto-lossy``)."""
    waiting = [c for c in layers() if isinstance(c, (LowRank, TopK)) and not c.active]
    if not waiting:
        return None
    sent = "in bfloat16" if cast else "uncompressed"
    return (
        f"warm-up: {len(waiting)} compressed layers still send their gradients {sent} through the buckets, until "
        f"step {max(c.setting.warmup for c in waiting)} (now {lossy.steps}; warmup_steps= or total_steps= set it)"
    )


def plan_report(print_table: bool | None = None) -> str:
    """The last plan of ``comm="auto"``: per layer, shape, bytes, K, predicted ms per scheme, choice, measured ms.

    Args:
        print_table: print the table too; by default only rank 0 prints (every rank holds the same plan).

    Returns:
        The table, on every rank.
    """
    plan = last_plan() if basics.is_initialized() else None
    if plan is None:
        text = "no plan yet: use DistributedOptimizer(..., model=model, comm='auto') and take one step"
    else:
        text = format_plan(plan.plans, plan.workers, plan.calibration)
        if plan.rounds is not None:
            text += "\n" + plan.rounds.describe()
        note = plan.note() if plan.note is not None else None
        if note:
            text += "\n" + note
    if print_table or (print_table is None and (not basics.is_initialized() or basics.rank() == 0)):
        print(text)
    return text
