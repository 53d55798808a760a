"""Compare the plan's predictions with what training measures, and say when to recalibrate.

Per layer, the monitor keeps running medians of its measured exchange time (the MIN over ranks: the rank that
entered last did not also wait for its peers) and of its prediction as executed. When their median relative error
stays above a threshold for some steps, ``drifted()`` says so on every rank alike, and ``refit`` fits the lines to
the measurements. docs/communication.md describes the policy and its numbers.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shoal.plan.calibration import Calibration
from shoal.plan.planner import LayerPlan, expected_ms


@dataclass
class DriftConfig:
    """When measured exchange times count as drifting from the predictions."""

    threshold: float = 0.25
    """Median relative error |predicted - measured| / measured above which a step counts as drifting."""
    steps: int = 5
    """Consecutive drifting steps before recalibrating; also how often the ranks compare notes."""
    first_backoff_steps: int = 50
    """Steps to wait after a recalibration before another; doubles each time."""
    window: int = 9
    """Steps in each layer's running median of measured time."""
    warmup_steps: int = 5
    """Steps after each plan (the first, and every re-plan) whose times are not counted: a plan's first exchanges
    pay one-off costs (new request names negotiated, buffers allocated, caches cold)."""

    def __post_init__(self) -> None:
        if self.threshold <= 0:
            raise ValueError(f"drift threshold must be > 0, got {self.threshold}")
        if self.steps < 1 or self.window < 1 or self.first_backoff_steps < 0 or self.warmup_steps < 0:
            raise ValueError("drift steps and window must be >= 1, the back-off and warm-up >= 0")


Execution = tuple[float, int, int]
"""The engine's record of one request: (its share of its batch's seconds, its elements, the batch's elements)."""


class DriftMonitor:
    """Tracks measured against expected exchange time per layer, for one plan and calibration."""

    __slots__ = (
        "_backoff",
        "_history",
        "_names",
        "_next_allowed",
        "_over",
        "_pending",
        "_plan_step",
        "_planned_s",
        "_step",
        "calibration",
        "config",
        "plans",
        "rebuilds",
        "recalibrations",
        "terms",
    )

    def __init__(
        self,
        plans: list[LayerPlan],
        names_by_layer: dict[str, list[str]],
        calibration: Calibration,
        config: DriftConfig | None = None,
    ) -> None:
        """Monitor ``plans``; ``names_by_layer`` lists, per layer, the engine request names of its exchange."""
        self.config = config or DriftConfig()
        self._step = 0
        self._over = 0
        self._backoff = self.config.first_backoff_steps
        self._next_allowed = 0
        self.recalibrations = 0
        self._start(plans, names_by_layer, calibration)

    def _start(self, plans: list[LayerPlan], names_by_layer: dict[str, list[str]], calibration: Calibration) -> None:
        self._plan_step = self._step
        self.plans = [p for p in plans if names_by_layer.get(p.name)]
        self._planned_s = sum(p.predicted_ms[p.choice] for p in plans if p.choice in p.predicted_ms) / 1e3
        """What the whole plan predicts, measured layers or not (compressed layers are not: their time is mostly
        local work); the measured layers' predictions must carry ``MIN_EVIDENCE`` of it."""
        self._names = names_by_layer
        self.calibration = calibration
        window = self.config.window
        self._history: dict[str, deque[tuple[float, ...]]] = {p.name: deque(maxlen=window) for p in self.plans}
        """Per layer, recent steps' (measured seconds, expected seconds as executed, share of latencies, this rank's
        seconds of local work such as SFB's rebuild)."""
        self.rebuilds: dict[str, float] = {}
        """Per SFB layer, the running median of this rank's rebuild seconds; ``refit`` fits the matmul rate to it."""
        self._pending: list[dict[str, tuple[float, ...]]] = []
        """Steps recorded since the last ``agree``: per layer, (this rank's seconds, expected seconds, share, local
        work seconds)."""
        self.terms: dict[str, tuple[float, float]] = {}
        """Per layer, how its time depends on the line as executed: (share of latencies, bytes), so that
        ``time = latency * terms[0] + per_byte * terms[1]``; what ``refit`` fits the lines to (the share is the
        running median, over the same steps as the measured time)."""

    def replan(self, plans: list[LayerPlan], names_by_layer: dict[str, list[str]], calibration: Calibration) -> None:
        """Start over on a new plan after a recalibration (the back-off carries on, doubled)."""
        self._start(plans, names_by_layer, calibration)
        self._over = 0
        self._next_allowed = self._step + self._backoff
        self._backoff *= 2
        self.recalibrations += 1

    def _expected_seconds(self, plan: LayerPlan, parts: list[Execution]) -> tuple[float, float]:
        """The plan's prediction for the layer as the engine executed it this step, and its share of latencies."""
        exchange = plan.choice.exchange
        if plan.choice.row.rebuilds:  # its allgathers and rebuild, predicted as one (the spared backward work added
            # back: the measurement cannot see it)
            return plan.predicted_ms[plan.choice] / 1e3 + plan.spared_flops / self.calibration.flops_per_s, 1.0
        if exchange is None:
            return plan.predicted_ms[plan.choice] / 1e3, 1.0
        # Fused with other layers, the collective's latency is shared: predict the batch, keep this layer's part.
        itemsize = plan.nbytes / max(sum(own for _, own, _ in parts), 1)
        share = sum(own / batch for _, own, batch in parts if batch)
        expected = sum(self.calibration.seconds(exchange, batch * itemsize) * own / batch for _, own, batch in parts if batch)
        return expected, share

    def record_step(
        self, execution_of: Callable[[str], Execution | None], extra_seconds: dict[str, float] | None = None
    ) -> None:
        """Take this rank's measurements of a step; they count once ``agree`` has the ranks' agreed values.

        Args:
            execution_of: the engine's record of a request name (None when it has not run).
            extra_seconds: per layer, local work that belongs to its exchange (the SFB rebuild matmul).
        """
        self._step += 1
        if self._step - self._plan_step <= self.config.warmup_steps:
            return
        row: dict[str, tuple[float, ...]] = {}
        for plan in self.plans:
            records = [execution_of(name) for name in self._names[plan.name]]
            parts = [record for record in records if record is not None]
            if len(parts) < len(records) or plan.choice not in plan.predicted_ms:
                continue
            extra = (extra_seconds or {}).get(plan.name, 0.0)
            row[plan.name] = (sum(seconds for seconds, _, _ in parts) + extra, *self._expected_seconds(plan, parts), extra)
        self._pending.append(row)

    def pending(self) -> list[float]:
        """This rank's measured seconds for the steps recorded since the last ``agree``, step by step and layer by
        layer in plan order (``inf`` where a layer was not measured): what the ranks reduce with MIN."""
        return [row[p.name][0] if p.name in row else math.inf for row in self._pending for p in self.plans]

    def agree(self, agreed: Sequence[float]) -> float | None:
        """Count the pending steps with the ranks' agreed times; returns the last step's median relative error.

        ``agreed`` is ``pending()`` reduced with MIN over the ranks: each collective's time on the rank that entered
        it last, which did not wait for the others. The other ranks' times also include waiting for their peers to
        arrive (one rank's backprop running late), which is not the exchange's cost and no model of it predicts.
        Every rank passes the same values, so every rank reaches the same verdict.
        """
        if len(agreed) != len(self._pending) * len(self.plans):
            raise ValueError(f"agree() needs {len(self._pending) * len(self.plans)} values, got {len(agreed)}")
        error = None
        for index, row in enumerate(self._pending):
            step_error = self._count(row, agreed[index * len(self.plans) : (index + 1) * len(self.plans)])
            error = step_error if step_error is not None else error
        self._pending = []
        return error

    def _count(self, row: dict[str, tuple[float, ...]], agreed: Sequence[float]) -> float | None:
        """Add one step's agreed times to the running medians; returns its median relative error (None, and no count
        for or against drift, when the measured layers carry under ``MIN_EVIDENCE`` of the plan's predicted time)."""
        errors = []
        covered = 0.0
        for plan, measured in zip(self.plans, agreed, strict=True):
            if plan.name not in row or not math.isfinite(measured):
                continue
            history = self._history[plan.name]
            history.append((measured, *row[plan.name][1:]))
            # Running medians over the same steps: one noisy step should neither start nor break a drift, and a
            # layer fused on some steps and alone on others is compared with its prediction over the same mix.
            typical, expected, share, extra = (statistics.median(column) for column in zip(*history, strict=True))
            plan.measured_ms = typical * 1e3
            plan.expected_ms = expected * 1e3
            if plan.choice.row.rebuilds:
                self.rebuilds[plan.name] = extra
            elif plan.choice.exchange is not None:
                self.terms[plan.name] = (share, float(plan.nbytes))
            if typical > 0:
                errors.append(abs(expected - typical) / typical)
                covered += plan.predicted_ms[plan.choice] / 1e3
        if not errors or covered < MIN_EVIDENCE * self._planned_s:
            return None
        error = statistics.median(errors)
        self._over = self._over + 1 if error > self.config.threshold else 0
        return error

    def check_due(self) -> bool:
        """True on the steps where the ranks agree on their measurements (the same steps on every rank; never in a
        plan's warm-up, so there is always a step to agree on)."""
        return self._step % self.config.steps == 0 and self._step - self._plan_step > self.config.warmup_steps

    def drifted(self) -> bool:
        """The verdict, alike on every rank that agreed the same times: the last ``steps`` steps all drifted, and the
        back-off has passed."""
        return self._over >= self.config.steps and self._step >= self._next_allowed


def refit(
    calibration: Calibration,
    plans: list[LayerPlan],
    terms: dict[str, tuple[float, float]],
    rebuilds: dict[str, float] | None = None,
) -> Calibration:
    """Fit each exchange's α–β line, and the matmul rate, to what training measured, layer by layer.

    With layers whose bytes per latency span at least ``SEPARABLE_SPAN`` on an exchange, its α and β are refitted by
    least squares on relative error (``measured ≈ α·share_of_latencies + β·bytes``, from ``terms``). Every other
    exchange, measured or not, takes the changes of the fitted exchange with the most layers, α by its α's ratio and
    β by its β's (one overall factor would not do: training inflates latency more than bandwidth); with no exchange
    fitted, every line is scaled by the median measured/expected ratio over all measured layers. A layer's ratio
    compares its measured time with its line at the same running medians of its latency share and bytes (``terms``).
    A ratio from one or two layers on an exchange is not evidence about that exchange: it mixes the network with where
    in backprop the layer's exchange ran and what competed with it (the cores, the link), which an exchange measured
    elsewhere in the step does not share; scaling each such exchange by its own few ratios made a 1 Gbit/s MLP's plan
    flip from SFB (3× cheaper, as forced runs confirmed) to bf16 on a steady network. For SFB layers, ``rebuilds``
    (their measured rebuild seconds) sets the matmul rate (the median of rebuild flops per second), and only the rest
    of their time, the allgathers, counts towards the ratios.
    """
    ratios: dict[str, list[float]] = {}
    points: dict[str, list[tuple[float, float, float]]] = {}
    rebuilds = rebuilds or {}
    rates = [
        plan.rebuild_flops / rebuilds[plan.name]
        for plan in plans
        if plan.choice.row.rebuilds and plan.rebuild_flops and rebuilds.get(plan.name, 0.0) > 0
    ]
    flops_per_s = statistics.median(rates) if rates else calibration.flops_per_s
    for plan in plans:
        exchange = plan.choice.exchange
        if exchange is None or not plan.measured_ms or plan.choice not in plan.predicted_ms:
            continue
        measured, expected = plan.measured_ms / 1e3, expected_ms(plan) / 1e3
        if plan.choice.row.rebuilds and plan.rebuild_flops and plan.name in rebuilds:
            measured -= rebuilds[plan.name]  # what the allgathers took
            expected -= plan.rebuild_flops / calibration.flops_per_s  # what the plan gave them
        elif not plan.choice.row.rebuilds and plan.name in terms:  # the line at the same medians as the measurement
            share, nbytes = terms[plan.name]
            latency, per_byte = calibration.lines[exchange]
            expected = latency * share + per_byte * nbytes
        if measured <= 0 or expected <= 0:
            continue
        ratios.setdefault(exchange, []).append(measured / expected)
        if not plan.choice.row.rebuilds and plan.name in terms:
            points.setdefault(exchange, []).append((*terms[plan.name], measured))
    if not ratios:
        return calibration.with_lines(calibration.lines, flops_per_s)
    fitted_lines = {exchange: line for exchange in ratios if (line := _least_squares(points.get(exchange, []))) is not None}
    if fitted_lines:  # the line whose layers' sizes pinned both α and β down best carries its changes to the rest
        reference = max(fitted_lines, key=lambda exchange: len(points[exchange]))
        (old_latency, old_per_byte), (new_latency, new_per_byte) = calibration.lines[reference], fitted_lines[reference]
        pooled = statistics.median(ratios[reference])
        latency_factor = new_latency / old_latency if old_latency > 0 else pooled
        per_byte_factor = new_per_byte / old_per_byte if old_per_byte > 0 else pooled
    else:  # no line separable: one factor, the median over every measured layer, whatever its exchange
        latency_factor = per_byte_factor = statistics.median(ratio for values in ratios.values() for ratio in values)
    lines = {
        exchange: fitted_lines.get(exchange, (latency * latency_factor, per_byte * per_byte_factor))
        for exchange, (latency, per_byte) in calibration.lines.items()
    }
    return calibration.with_lines(lines, flops_per_s)


MIN_EVIDENCE = 0.25
"""The measured layers must carry this share of the plan's predicted time for a step to count for or against drift.
A 1 Gbit/s MLP planned as PowerSGD for its two large layers (unmeasured) and allreduce for a 61 KB one was re-planned
from that one layer alone: its 10 ms, queued behind the PowerSGD traffic, scaled every line tenfold, the plan fell
to bf16 and the run to 0.12 of the bound."""

SEPARABLE_SPAN = 4.0
"""Bytes per latency must differ this much (largest over smallest) among a line's layers for least squares to tell α
from β: the one-host MLP's two layers (25 and 12.6 MB, a factor of 2) once fitted β to almost nothing, which left
every line latency-only and made fp16 (its probed α 0.07 ms below allreduce's) the choice for all layers."""


def _least_squares(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(α, β) minimising Σ((t − α·a − β·b)/t)² over (a, b, t); None when under-determined, when the layers' bytes
    per latency span less than ``SEPARABLE_SPAN``, or when not both ≥ 0."""
    if len(points) < 2:
        return None
    spans = [b / a for a, b, _ in points if a > 0]
    if len(spans) < 2 or min(spans) <= 0 or max(spans) / min(spans) < SEPARABLE_SPAN:
        return None
    weights = [1 / t**2 for _, _, t in points]
    saa = sum(w * a * a for w, (a, _, _) in zip(weights, points, strict=True))
    sab = sum(w * a * b for w, (a, b, _) in zip(weights, points, strict=True))
    sbb = sum(w * b * b for w, (_, b, _) in zip(weights, points, strict=True))
    sat = sum(w * a * t for w, (a, _, t) in zip(weights, points, strict=True))
    sbt = sum(w * b * t for w, (_, b, t) in zip(weights, points, strict=True))
    determinant = saa * sbb - sab * sab
    if determinant <= 1e-12 * saa * sbb:  # every layer has the same bytes per latency: α and β cannot be told apart
        return None
    latency = (sat * sbb - sbt * sab) / determinant
    per_byte = (saa * sbt - sab * sat) / determinant
    if latency < 0 or per_byte < 0:
        return None
    return latency, per_byte
