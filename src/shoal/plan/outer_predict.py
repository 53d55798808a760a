"""Local steps in the step simulator: ``shoal.plan.simulate`` plays a comm setting whose row is ``outer`` (``local``),
or that weighs it (``auto-far``), through ``simulate_outer``.

A host's ranks take synchronous inner steps: the step is simulated among one host's ranks (its in-host exchange, a
plain allreduce). Across hosts the model's pseudo-gradient is exchanged once per round, in the fragments, codec and
H that ``plan_rounds`` chooses for that inner step, and a step costs the inner step plus the round's exposed wire and
codec work spread over its H steps (``RoundPlan.per_step_s``; CPU-bound, also the part of the wire that keeps a core
busy, as ``simulate`` counts it). ``auto-far`` takes that where ``prefer_local`` says, else ``auto-lossy``'s
per-layer plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from shoal.plan.far import LocalSteps, plan_rounds, prefer_local
from shoal.plan.schemes import Planned, Scheme

if TYPE_CHECKING:
    from shoal.plan.simulate import Links, StepPrediction, StepProfile


def simulate_outer(
    simulate: Callable[..., StepPrediction],
    profile: StepProfile,
    links: Links,
    workers: int,
    ranks_per_host: int,
    weigh: bool,
    bucket_bytes: int,
    cpu_bound: bool,
    options: LocalSteps | None = None,
) -> StepPrediction:
    """One step of local steps at ``workers`` ranks in hosts of ``ranks_per_host`` (``weigh``: ``auto-far``, which
    keeps ``auto-lossy``'s plan where local steps do not pay).
    ``simulate`` is ``shoal.plan.simulate.simulate`` (passed in: that module dispatches here)."""
    options = options or LocalSteps()
    per_host = min(ranks_per_host, workers)
    hosts = math.ceil(workers / per_host)
    inner = simulate(profile, links, per_host, per_host, Scheme.ALLREDUCE.value, bucket_bytes, cpu_bound=cpu_bound)
    calibration = links.calibration(workers, per_host)
    entries = sum(layer.nbytes for layer in profile.layers) // 4
    fragments = min(options.fragments, max(len(profile.layers), 1))  # layers stand for the parameters here
    rounds = plan_rounds(calibration, hosts, entries, inner.step_s, options, fragments) if hosts > 1 else None
    if weigh:
        sync = simulate(profile, links, workers, per_host, Planned.AUTO_LOSSY.value, bucket_bytes, cpu_bound=cpu_bound)
        if rounds is None or not prefer_local(sync.step_s, rounds):
            return sync
    step = rounds.per_step_s if rounds is not None else inner.step_s
    outer_s = rounds.wire_s / rounds.every if rounds is not None else 0.0
    if cpu_bound and rounds is not None:  # the exchange's busy part cannot run beside compute: it adds to the steps
        step += calibration.cpu_seconds("allgather" if rounds.codec.gathered else "allreduce", outer_s)
    samples = workers * profile.batch / step
    return dataclasses.replace(
        inner,
        workers=workers,
        ranks_per_host=per_host,
        step_s=step,
        exposed_comm_s=step - profile.compute_s,
        comm_s=inner.comm_s + outer_s,
        samples_per_s=samples,
        efficiency=samples / (workers * profile.batch / profile.compute_s),
        choices=dict.fromkeys(inner.choices, Scheme.LOCAL),
        calibration=calibration,
    )
