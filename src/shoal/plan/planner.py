"""The per-layer communication planner: predict each scheme's time with the calibrated model, pick the cheapest.

What each scheme can serve and costs is its row of the table (``shoal.plan.schemes``); this module asks every row
for every layer of a model, picks among the schemes ``allowed`` (``auto``: the lossless ones, fp16/bf16 only by a
clear margin; ``auto-lossy``: PowerSGD and top-k too; ``ps`` only when dedicated servers are configured), and keeps
a plan's rows for the report and the drift monitor. Every rank plans from the same calibration (rank 0's) and the
same row counts (the maximum over ranks), so every rank reaches the same plan.

The package imports no framework: a layer reaches it as a ``ModelLayer``, plain numbers that a front end reads off
its framework's model (``shoal.torch.layer_comm.layers`` for torch).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.plan.calibration import Calibration
from shoal.plan.costs import (
    CostContext,
    LayerShape,
    LossyOptions,
    predict_ps,
    sfb_allgather_seconds,
    sfb_rebuild_flops,
    sfb_spared_flops,
)
from shoal.plan.schemes import AUTO_SCHEMES, DEFAULT_RANK, SCHEMES, Compressed, Scheme, estimates, scheme_of

__all__ = [
    "LOSSY_MARGIN",
    "LayerPlan",
    "ModelLayer",
    "forced_scheme",
    "format_plan",
    "keep_measured",
    "median_error",
    "pick",
    "plan_layers",
    "predict",
    "predict_ps",
    "refuse_tied_sfb",
    "sfb_allgather_seconds",
    "sfb_rebuild_flops",
    "sfb_spared_flops",
]


@dataclass(frozen=True)
class ModelLayer:
    """One layer of a model (a module that owns trainable parameters directly), as the planner needs it."""

    name: str
    kind: str
    """Its type's name (``Linear``, ``Conv2d``...), for the report."""
    weight_shape: tuple[int, ...]
    """Its weight's shape, for the report (empty without a weight)."""
    shape: LayerShape
    """What the scheme table's rows weigh: bytes, parameter shapes, (K, M, N) where SFB can serve it."""
    rows: int | None = None
    """K, rows per step, of a fully-connected layer that ran forward."""
    tied: bool = False
    """Another module holds the same weight: SFB is refused even where forced."""
    handle: object = None
    """The framework's module, matched against ``comm_overrides`` keys that are types."""


@dataclass
class LayerPlan:
    """One layer's row of the plan."""

    name: str
    kind: str
    shape: tuple[int, ...]
    nbytes: int
    rows: int | None
    """K: rows per step (fully-connected layers), when known."""
    predicted_ms: dict[Scheme, float] = field(default_factory=dict)
    choice: Scheme = Scheme.ALLREDUCE
    forced: bool = False
    measured_ms: float | None = None
    rebuild_flops: float | None = None
    """For a fully-connected layer: the floating-point operations of SFB's gradient rebuild (2·P·K·M·N)."""
    spared_flops: float = 0.0
    """What SFB spares backward: autograd's local weight gradient (2·K·M·N), skipped where the layer has a trainable
    bias (``shoal.torch.layer_comm.sfb``); SFB's prediction is its allgathers plus the rebuild minus this."""
    rank: int | None = None
    """PowerSGD's rank for this layer, when that is the choice."""
    expected_ms: float | None = None
    """The chosen scheme's prediction as executed: a layer fused with others into one collective shares that
    collective's α and pays for its own bytes; what ``measured_ms`` is compared with (None before training)."""

    def __post_init__(self) -> None:
        self.choice = Scheme.parse(self.choice, f"the plan of '{self.name}'")


def predict(
    calibration: Calibration,
    workers: int,
    nbytes: int,
    linear: tuple[int, int, int] | None,
    itemsize: int = 4,
    servers: int | None = None,
    spares_local: bool = False,
    shapes: tuple[tuple[int, ...], ...] = (),
    lossy: LossyOptions | None = None,
) -> dict[Scheme, float]:
    """Predicted seconds for each eligible scheme for one layer's gradient of ``nbytes`` (the table's ``cost``).

    Args:
        calibration: the fitted costs.
        workers: P.
        nbytes: the layer's gradient bytes (weight and bias).
        linear: (K, M, N) for a fully-connected layer (rows per step, outputs, inputs), else None.
        itemsize: bytes per element of the factors.
        servers: S, the parameter servers to predict ``ps`` for (None: no ``ps`` prediction).
        spares_local: SFB spares backward the layer's local weight gradient (it has a trainable bias).
        shapes: the layer's parameter shapes (the compressed schemes need them; none: they are not predicted).
        lossy: the compressed schemes' bounds.
    """
    ctx = CostContext(calibration, workers, servers, lossy or LossyOptions())
    layer = LayerShape(nbytes, shapes, itemsize, linear, spares_local)
    return {scheme: estimate.seconds for scheme, estimate in estimates(ctx, layer).items()}


LOSSY_MARGIN = 0.9
"""``auto`` takes fp16 or bf16 only where predicted at most this share of the best lossless scheme's time: rounding
the gradient must buy a real saving, not one within the probes' noise (their latencies differ by tenths of a
millisecond run to run)."""


def pick(predictions: dict[Scheme, float], allowed: tuple[Scheme, ...] = AUTO_SCHEMES) -> Scheme:
    """``auto``'s choice among ``allowed``: the cheapest lossless scheme unless a lossy one beats it by the margin."""
    eligible = {k: v for k, v in predictions.items() if k in allowed}
    lossless = {k: v for k, v in eligible.items() if not k.lossy}
    best = min(eligible, key=lambda k: (eligible[k], SCHEMES.index(k)))
    if best.lossy and lossless:
        fallback = min(lossless, key=lambda k: (lossless[k], SCHEMES.index(k)))
        if eligible[best] > LOSSY_MARGIN * lossless[fallback]:
            return fallback
    return best


def refuse_tied_sfb(name: str) -> None:
    """Warn that a layer forced to ``sfb`` is allreduced instead because its weight is tied to another module's."""
    warnings.warn(
        f"sfb is refused for '{name}': another module holds the same weight (tied weights), and a gradient rebuilt "
        "from this layer's factors would drop the other module's share; its gradients are allreduced instead",
        UserWarning,
        stacklevel=3,
    )


def forced_setting(name: str, module: object, overrides: dict[object, object]) -> object | None:
    """What ``overrides`` says for a module, by its name first, then by its type (any framework's module: a key
    that is a type matches its instances): a scheme's name, or a ``Compressed`` with its settings."""
    if name in overrides:
        return overrides[name]
    for key, value in overrides.items():
        if isinstance(key, type) and isinstance(module, key):
            return value
    return None


def forced_scheme(name: str, module: object, overrides: dict[object, object]) -> Scheme | None:
    """The scheme ``overrides`` forces on a module, by its name first, then by its type."""
    value = forced_setting(name, module, overrides)
    return None if value is None else scheme_of(value, "comm_overrides")


def plan_layers(
    layers: Sequence[ModelLayer],
    calibration: Calibration,
    workers: int,
    overrides: dict[object, object] | None = None,
    allowed: tuple[Scheme, ...] = AUTO_SCHEMES,
    servers: int | None = None,
    lossy: LossyOptions | None = None,
) -> list[LayerPlan]:
    """Plan every layer: a forced scheme where ``overrides`` names one, else ``auto``'s choice among ``allowed``.

    Args:
        layers: the model's layers (``shoal.torch.layer_comm.layers.model_layers`` for a torch model).
        calibration: the fitted costs (the same on every rank).
        workers: P.
        overrides: scheme forced per layer name or module type, e.g. ``{"fc1": "sfb", nn.Embedding: "allreduce"}``.
        allowed: schemes ``auto`` may choose from.
        servers: S for the ``ps`` prediction (None: ``ps`` is neither predicted nor chosen unless forced).
        lossy: the compressed schemes' bounds (a layer's override may carry its own).
    """
    overrides = overrides or {}
    for value in overrides.values():
        scheme_of(value, "comm_overrides")
    plans = []
    for layer in layers:
        name, linear = layer.name, layer.shape.linear
        setting = forced_setting(name, layer.handle, overrides)
        options = setting.options if isinstance(setting, Compressed) else lossy or LossyOptions()
        ctx = CostContext(calibration, workers, servers, options)
        estimated = estimates(ctx, layer.shape)
        predictions = {scheme: estimate.seconds for scheme, estimate in estimated.items()}
        plan = LayerPlan(
            name, layer.kind, layer.weight_shape, layer.shape.nbytes, layer.rows, {k: v * 1e3 for k, v in predictions.items()}
        )
        if linear is not None:
            plan.rebuild_flops = sfb_rebuild_flops(workers, linear)
            plan.spared_flops = sfb_spared_flops(linear) if layer.shape.spares_local else 0.0
        forced = forced_scheme(name, layer.handle, overrides)
        if forced is not None and forced.row.needs_linear and layer.tied:
            refuse_tied_sfb(name)
            forced = None
        if forced is not None:
            if forced.row.needs_linear and linear is None:
                raise ValueError(f"comm_overrides forces {forced} on '{name}', but it is not an nn.Linear that ran forward")
            plan.choice, plan.forced = forced, True
        else:
            plan.choice = pick(predictions, allowed)
        if plan.choice.row.ranked:
            chosen = estimated.get(plan.choice)
            plan.rank = options.rank or (chosen.rank if chosen is not None else None) or DEFAULT_RANK
        plans.append(plan)
    return plans


def keep_measured(plans: list[LayerPlan], previous: list[LayerPlan]) -> list[str]:
    """After a re-plan: keep each layer's current scheme unless the new choice is predicted cheaper than what the
    current one measured in training. The current scheme's cost is known, an alternative's only predicted; a refit
    from a step's measurements can misjudge the alternatives (one 1 Gbit/s MLP run re-planned fp16 for two layers
    whose SFB measured four times cheaper than fp16 ran when forced). Returns the layers kept."""
    before = {p.name: p for p in previous}
    kept = []
    for plan in plans:
        old = before.get(plan.name)
        if plan.forced or old is None or old.choice == plan.choice or not old.measured_ms:
            continue
        if old.choice not in plan.predicted_ms or plan.predicted_ms[plan.choice] < old.measured_ms:
            continue
        plan.choice = old.choice
        kept.append(plan.name)
    return kept


def expected_ms(plan: LayerPlan) -> float:
    """What ``measured_ms`` is compared with: the prediction as executed once known, else the plan's prediction."""
    return plan.expected_ms if plan.expected_ms is not None else plan.predicted_ms[plan.choice]


def median_error(plans: list[LayerPlan]) -> float | None:
    """Median over layers of |expected - measured| / measured for the chosen scheme (None before measurements)."""
    errors = sorted(
        abs(expected_ms(p) - p.measured_ms) / p.measured_ms for p in plans if p.measured_ms and p.choice in p.predicted_ms
    )
    return errors[len(errors) // 2] if errors else None


def format_plan(plans: list[LayerPlan], workers: int, calibration: Calibration | None = None) -> str:
    """The plan as a table: layer, shape, bytes, K, predicted ms per scheme, choice, measured ms."""
    header = f"{'layer':<24} {'shape':<16} {'bytes':>11} {'K':>6} " + " ".join(f"{s.value + ' ms':>10}" for s in SCHEMES)
    lines = [f"plan for {workers} workers", header + f" {'choice':>10} {'expected':>9} {'measured':>9}"]
    for plan in plans:
        cells = " ".join(f"{plan.predicted_ms[s]:>10.3f}" if s in plan.predicted_ms else f"{'-':>10}" for s in SCHEMES)
        measured = f"{plan.measured_ms:>9.3f}" if plan.measured_ms is not None else f"{'-':>9}"
        measured = (f"{plan.expected_ms:>9.3f} " if plan.expected_ms is not None else f"{'-':>9} ") + measured
        choice = plan.choice.value + (f"@{plan.rank}" if plan.rank else "") + ("*" if plan.forced else "")
        lines.append(
            f"{plan.name or '(model)':<24} {'x'.join(map(str, plan.shape)):<16} {plan.nbytes:>11} "
            f"{plan.rows if plan.rows is not None else '-':>6} {cells} {choice:>10} {measured}"
        )
    error = median_error(plans)
    if error is not None:
        count = sum(1 for p in plans if p.measured_ms and p.choice in p.predicted_ms)
        lines.append(f"median |predicted - measured| / measured over {count} layers: {100 * error:.0f}%")
    for link, (latency, per_byte) in (calibration.links if calibration is not None else {}).items():
        rate = f"{1e-9 / per_byte:.2f} GB/s" if per_byte > 0 else "unbounded"
        lines.append(f"{link} link (gloo allreduce): latency {latency * 1e3:.3f} ms, {rate}")
    forced = "* forced by comm_overrides. " if any(plan.forced for plan in plans) else ""
    lines.append(
        f"{forced}expected: the choice's prediction as executed (fused layers share one latency); measured: the "
        "fastest rank's time in training; both running medians, '-' for ps and compressed layers (mostly local work, "
        "not measured); auto chooses ps only with dedicated servers (shoalrun --num-servers)"
    )
    return "\n".join(lines)
