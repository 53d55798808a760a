"""Compare the plan's predictions with what training measures, and say when to recalibrate.

The engine records how long each collective ran (a fused batch's time shared by bytes). After every step the
monitor sums each layer's exchanges, keeps a short running median per layer (shown as "measured ms" in the plan
report), and computes the step's median relative error over the layers, from those running medians and each
layer's prediction as executed (a layer fused with others shares one latency). When that error stays above the
threshold for ``steps`` consecutive steps, ``drifted()`` says so; the optimizer then agrees with the other ranks (one
tiny allreduce every ``steps`` steps), recalibrates from what training measured (``refit``: least squares of each
exchange's α and β on the layers' times, or scaling by their median measured/expected ratio; probing again at idle
would miss what training sees, e.g. collectives competing with backprop for the cores) and re-plans at the step
boundary. A back-off doubles the wait after each recalibration, so a network the α-β model cannot capture is not
refitted forever.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shoal.plan.calibration import Calibration
from shoal.plan.planner import LayerPlan, expected_ms

_EXCHANGE_OF = {"allreduce": "allreduce", "fp16": "fp16", "bf16": "bf16", "sfb": "allgather"}
"""Which calibrated line a scheme's exchange runs on."""


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

    def __post_init__(self) -> None:
        if self.threshold <= 0:
            raise ValueError(f"drift threshold must be > 0, got {self.threshold}")
        if self.steps < 1 or self.window < 1 or self.first_backoff_steps < 0:
            raise ValueError("drift steps and window must be >= 1 and the back-off >= 0")


Execution = tuple[float, int, int]
"""The engine's record of one request: (its share of its batch's seconds, its elements, the batch's elements)."""


class DriftMonitor:
    """Tracks measured against expected exchange time per layer, for one plan and calibration."""

    __slots__ = ("_backoff", "_history", "_names", "_next_allowed", "_over", "_step", "calibration", "config", "plans",
                 "recalibrations", "terms")  # fmt: skip

    def __init__(self, plans: list[LayerPlan], names_by_layer: dict[str, list[str]], calibration: Calibration,
                 config: DriftConfig | None = None) -> None:  # fmt: skip
        """Monitor ``plans``; ``names_by_layer`` lists, per layer, the engine request names of its exchange."""
        self.config = config or DriftConfig()
        self._step = 0
        self._over = 0
        self._backoff = self.config.first_backoff_steps
        self._next_allowed = 0
        self.recalibrations = 0
        self._start(plans, names_by_layer, calibration)

    def _start(self, plans: list[LayerPlan], names_by_layer: dict[str, list[str]], calibration: Calibration) -> None:
        self.plans = [p for p in plans if names_by_layer.get(p.name)]
        self._names = names_by_layer
        self.calibration = calibration
        self._history: dict[str, deque[float]] = {p.name: deque(maxlen=self.config.window) for p in self.plans}
        self.terms: dict[str, tuple[float, float]] = {}
        """Per layer, how its time depends on the line as executed: (share of latencies, bytes), so that
        ``time = latency * terms[0] + per_byte * terms[1]``; what ``refit`` fits the lines to."""

    def replan(self, plans: list[LayerPlan], names_by_layer: dict[str, list[str]], calibration: Calibration) -> None:
        """Start over on a new plan after a recalibration (the back-off carries on, doubled)."""
        self._start(plans, names_by_layer, calibration)
        self._over = 0
        self._next_allowed = self._step + self._backoff
        self._backoff *= 2
        self.recalibrations += 1

    def _expected_seconds(self, plan: LayerPlan, parts: list[Execution]) -> float:
        """The plan's prediction for the layer as the engine executed it this step."""
        exchange = _EXCHANGE_OF.get(plan.choice)
        if exchange is None or plan.choice == "sfb":  # SFB's allgathers and rebuild are predicted as one
            return plan.predicted_ms[plan.choice] / 1e3
        # Fused with other layers, the collective's latency is shared: predict the batch, keep this layer's part.
        itemsize = plan.nbytes / max(sum(own for _, own, _ in parts), 1)
        self.terms[plan.name] = (
            sum(own / batch for _, own, batch in parts if batch),
            itemsize * sum(own for _, own, _ in parts),
        )
        return sum(self.calibration.seconds(exchange, batch * itemsize) * own / batch for _, own, batch in parts if batch)

    def record_step(self, execution_of: Callable[[str], Execution | None],
                    extra_seconds: dict[str, float] | None = None) -> float | None:  # fmt: skip
        """Take this step's measurements; returns the step's median relative error (None if nothing was measured).

        Args:
            execution_of: the engine's record of a request name (None when it has not run).
            extra_seconds: per layer, local work that belongs to its exchange (the SFB rebuild matmul).
        """
        self._step += 1
        errors = []
        for plan in self.plans:
            records = [execution_of(name) for name in self._names[plan.name]]
            parts = [record for record in records if record is not None]
            if len(parts) < len(records) or plan.choice not in plan.predicted_ms:
                continue
            measured = sum(seconds for seconds, _, _ in parts) + (extra_seconds or {}).get(plan.name, 0.0)
            history = self._history[plan.name]
            history.append(measured)
            typical = statistics.median(history)  # one noisy step should neither start nor break a drift
            plan.measured_ms = typical * 1e3
            expected = self._expected_seconds(plan, parts)
            plan.expected_ms = expected * 1e3
            if typical > 0:
                errors.append(abs(expected - typical) / typical)
        if not errors:
            return None
        error = statistics.median(errors)
        self._over = self._over + 1 if error > self.config.threshold else 0
        return error

    def check_due(self) -> bool:
        """True on the steps where the ranks compare their drift verdicts (the same steps on every rank)."""
        return self._step % self.config.steps == 0

    def drifted(self) -> bool:
        """This rank's verdict: the last ``steps`` steps all drifted, and the back-off has passed."""
        return self._over >= self.config.steps and self._step >= self._next_allowed


def refit(calibration: Calibration, plans: list[LayerPlan], terms: dict[str, tuple[float, float]]) -> Calibration:
    """Fit each exchange's α–β line to what training measured, layer by layer.

    With two or more layers of different sizes on an exchange, α and β are refitted by least squares on relative
    error (``measured ≈ α·share_of_latencies + β·bytes``, from ``terms``); otherwise, and for SFB's allgather (whose
    layers also carry a rebuild), the line is scaled by the median measured/expected ratio. Exchanges no layer used
    are scaled by the median ratio over all layers; the matmul rate is kept.
    """
    ratios: dict[str, list[float]] = {}
    points: dict[str, list[tuple[float, float, float]]] = {}
    for plan in plans:
        exchange = _EXCHANGE_OF.get(plan.choice)
        if exchange is None or not plan.measured_ms or plan.choice not in plan.predicted_ms:
            continue
        expected = expected_ms(plan)
        if not expected:
            continue
        ratios.setdefault(exchange, []).append(plan.measured_ms / expected)
        if plan.choice != "sfb" and plan.name in terms:
            points.setdefault(exchange, []).append((*terms[plan.name], plan.measured_ms / 1e3))
    if not ratios:
        return calibration
    overall = statistics.median(r for values in ratios.values() for r in values)
    lines = {}
    for exchange, (latency, per_byte) in calibration.lines.items():
        fitted = _least_squares(points.get(exchange, []))
        if fitted is not None:
            lines[exchange] = fitted
        else:
            factor = statistics.median(ratios[exchange]) if exchange in ratios else overall
            lines[exchange] = (latency * factor, per_byte * factor)
    return Calibration(lines, calibration.flops_per_s, calibration.links)


def _least_squares(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(α, β) minimising Σ((t − α·a − β·b)/t)² over (a, b, t); None when under-determined or not both ≥ 0."""
    if len(points) < 2:
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
