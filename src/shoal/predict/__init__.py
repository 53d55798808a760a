"""Will it scale? Predict throughput at N workers from one worker's profile and the network's α–β lines.

``python -m shoal.predict`` is the command line (docs/predict.md); ``scaling`` is the same as a function, and
``shoal.plan.simulate`` holds the step simulator it applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.plan.memory import ModelMemory, estimates, in_flight
from shoal.plan.schemes import SCHEMES, Planned, forces_outer, parse_comm, takes_outer
from shoal.plan.simulate import Links, StepPrediction, StepProfile, simulate

ALTERNATIVES = (*(s.value for s in SCHEMES if not s.row.on_servers), *(p.value for p in Planned))
"""The comm settings ``--comm`` offers (what ``DistributedOptimizer(comm=...)`` offers without servers)."""
SYNCHRONOUS = tuple(alt for alt in ALTERNATIVES if not takes_outer(parse_comm(alt)))
"""The alternatives the advice ranks: those that keep the optimization synchronous. Local steps (``local``) are
named beside them where they do better, as a change of the optimization (docs/far.md)."""
LOCAL = next(alt for alt in ALTERNATIVES if forces_outer(parse_comm(alt)))


@dataclass
class Row:
    """One worker count's prediction, with the best alternative comm setting."""

    prediction: StepPrediction
    comm: str
    best_comm: str
    best_efficiency: float
    layer_bytes: dict[str, int]
    far_efficiency: float = 0.0
    """Local steps' predicted efficiency (``comm="local"``, with the planner's H and codec)."""
    memory: dict[str, int] = field(default_factory=dict)
    """Each ``shard=`` option's predicted peak bytes per rank (``shoal.plan.memory``; activations not included)."""

    def advice(self) -> str:
        """Where the time goes and what would help, in one sentence."""
        p = self.prediction
        share = p.exposed_comm_s / p.step_s
        if p.workers == 1 or share < 0.1:
            return f"compute-bound ({100 * share:.0f}% of the step waits on communication)"
        layers = "/".join(name or "(model)" for name in p.costliest_layers(self.layer_bytes))
        text = f"communication-bound ({100 * share:.0f}% of the step exposed), most of it in {layers}"
        if self.best_comm != self.comm and self.best_efficiency > p.efficiency + 0.01:
            text += f"; comm={self.best_comm} raises efficiency to {100 * self.best_efficiency:.0f}%"
        if not takes_outer(parse_comm(self.comm)) and self.far_efficiency > max(p.efficiency, self.best_efficiency) + 0.01:
            text += (
                f"; local steps (comm={LOCAL} or auto-far) would reach {100 * self.far_efficiency:.0f}%, with the hosts "
                "meeting every H steps, which changes the optimization (docs/far.md)"
            )
        return text

    def as_dict(self) -> dict[str, object]:
        p = self.prediction
        counts: dict[str, int] = {}
        for scheme in p.choices.values():
            counts[scheme.value] = counts.get(scheme.value, 0) + 1
        return {
            "workers": p.workers,
            "ranks_per_host": p.ranks_per_host,
            "step_ms": round(p.step_s * 1e3, 3),
            "samples_per_s": round(p.samples_per_s, 1),
            "efficiency": round(p.efficiency, 3),
            "compute_ms": round(p.compute_s * 1e3, 3),
            "exposed_comm_ms": round(p.exposed_comm_s * 1e3, 3),
            "schemes": counts,
            "best_comm": self.best_comm,
            "best_efficiency": round(self.best_efficiency, 3),
            "far_efficiency": round(self.far_efficiency, 3),
            "memory_bytes": dict(self.memory),
            "advice": self.advice(),
        }


def scaling(
    profile: StepProfile,
    links: Links,
    workers: list[int],
    ranks_per_host: int = 1,
    comm: str = "allreduce",
    bucket_bytes: int = 2 * 1024 * 1024,
    cpu_bound: bool = False,
    state_per_element: float = 2.0,
) -> list[Row]:
    """Predict ``comm`` at each worker count, and the best of the other comm settings beside it (``cpu_bound``: see
    ``shoal.plan.simulate.simulate``), with each ``shard=`` option's peak memory per rank for an optimizer keeping
    ``state_per_element`` values per parameter element (Adam: 2)."""
    parse_comm(comm)
    layer_bytes = {layer.name: layer.nbytes for layer in profile.layers}
    backward_order = [gradient.nbytes for gradient in sorted(profile.gradients, key=lambda g: g.ready_s)]
    rows = []
    for count in workers:
        if count < 1:
            raise ValueError(f"worker counts must be >= 1, got {count}")
        per_host = min(ranks_per_host, count)
        settings = dict.fromkeys((*ALTERNATIVES, comm))  # comm's own simulation is one of them
        results = {alt: simulate(profile, links, count, per_host, alt, bucket_bytes, cpu_bound=cpu_bound) for alt in settings}
        best = max(SYNCHRONOUS, key=lambda alt: results[alt].efficiency)
        far = results[LOCAL].efficiency
        model = ModelMemory(
            sum(backward_order),
            state_per_element,
            in_flight_bytes=in_flight(backward_order, bucket_bytes),
            adopts_shared=per_host > 1,
        )
        memory = {estimate.option: estimate.peak for estimate in estimates(model, count)}
        rows.append(Row(results[comm], comm, best, results[best].efficiency, layer_bytes, far, memory))
    return rows
