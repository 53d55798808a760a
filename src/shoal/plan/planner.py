"""The per-layer communication planner: predict each scheme's time with the calibrated model, pick the cheapest.

Schemes: ``allreduce`` (plain), ``fp16`` and ``bf16`` (allreduce of half the bytes plus two casts), ``sfb``
(sufficient factor broadcasting, fully-connected layers only: allgather K·(M+N) per rank plus the rebuild matmul)
and ``ps`` (the sharded parameter server: push the gradient, pull the values). ``ps`` is predicted whenever a
server count is given, but ``auto`` may only choose it when dedicated servers are configured (the caller passes
``allowed``). Every rank plans from the same calibration (rank 0's) and the same row counts (the maximum over
ranks), so every rank reaches the same plan.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from torch import nn

from shoal.plan.calibration import Calibration
from shoal.plan.schemes import SCHEMES, Scheme


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
) -> dict[Scheme, float]:
    """Predicted seconds for each eligible scheme for one layer's gradient of ``nbytes``.

    Args:
        calibration: the fitted costs.
        workers: P.
        nbytes: the layer's gradient bytes (weight and bias).
        linear: (K, M, N) for a fully-connected layer (rows per step, outputs, inputs), else None.
        itemsize: bytes per element of the factors.
        servers: S, the parameter servers to predict ``ps`` for (None: no ``ps`` prediction).
        spares_local: SFB spares backward the layer's local weight gradient (it has a trainable bias).
    """
    if workers == 1:
        return {
            scheme: 0.0
            for scheme in SCHEMES
            if (scheme != Scheme.SFB or linear is not None) and (scheme != Scheme.PS or servers)
        }
    predictions = {s: calibration.seconds(s.value, nbytes) for s in (Scheme.ALLREDUCE, Scheme.FP16, Scheme.BF16)}
    if linear is not None:
        rebuild = sfb_rebuild_flops(workers, linear) / calibration.flops_per_s
        spared = sfb_spared_flops(linear) / calibration.flops_per_s if spares_local else 0.0
        # Two allgathers (inputs and output gradients), then one matmul rebuilds the summed gradient; backward no
        # longer computes the local one.
        predictions[Scheme.SFB] = sum(sfb_allgather_seconds(calibration, workers, linear, itemsize)) + rebuild - spared
    if servers:
        predictions[Scheme.PS] = predict_ps(calibration, workers, servers, nbytes)
    return predictions


LOSSY_MARGIN = 0.9
"""``auto`` takes fp16 or bf16 only where predicted at most this share of the best lossless scheme's time: rounding
the gradient must buy a real saving, not one within the probes' noise (their latencies differ by tenths of a
millisecond run to run)."""


def pick(predictions: dict[Scheme, float], allowed: tuple[Scheme, ...] = SCHEMES) -> Scheme:
    """``auto``'s choice among ``allowed``: the cheapest lossless scheme unless a lossy one beats it by the margin."""
    eligible = {k: v for k, v in predictions.items() if k in allowed}
    lossless = {k: v for k, v in eligible.items() if not k.lossy}
    best = min(eligible, key=lambda k: (eligible[k], SCHEMES.index(k)))
    if best.lossy and lossless:
        fallback = min(lossless, key=lambda k: (lossless[k], SCHEMES.index(k)))
        if eligible[best] > LOSSY_MARGIN * lossless[fallback]:
            return fallback
    return best


def sfb_allgather_seconds(
    calibration: Calibration, workers: int, linear: tuple[int, int, int], itemsize: int = 4
) -> tuple[float, float]:
    """SFB's two allgathers for (K, M, N): the inputs' (P·K·N elements) and the output gradients' (P·K·M)."""
    rows, outputs, inputs = linear
    return (
        calibration.seconds("allgather", workers * rows * inputs * itemsize),
        calibration.seconds("allgather", workers * rows * outputs * itemsize),
    )


def sfb_rebuild_flops(workers: int, linear: tuple[int, int, int]) -> float:
    """Floating-point operations of SFB's rebuild for (K, M, N): the (M×PK)·(PK×N) matmul of the gathered factors."""
    rows, outputs, inputs = linear
    return 2.0 * workers * rows * outputs * inputs


def sfb_spared_flops(linear: tuple[int, int, int]) -> float:
    """Floating-point operations of the local weight gradient (K, M, N) that SFB spares backward: 2·K·M·N."""
    rows, outputs, inputs = linear
    return 2.0 * rows * outputs * inputs


def spares_local_gradient(module: nn.Module) -> bool:
    """Whether SFB on ``module`` spares backward its local weight gradient: an ``nn.Linear`` with a trainable bias
    (what ``shoal.torch.layer_comm.sfb`` needs to leave the weight out of autograd's graph)."""
    bias = getattr(module, "bias", None)
    return isinstance(module, nn.Linear) and bias is not None and bias.requires_grad


def tied_modules(model: nn.Module) -> set[str]:
    """The names of the modules that hold a parameter directly which another module also holds (tied weights, e.g.
    an embedding and the output layer of a language model)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    return {
        name
        for name, module in model.named_modules()
        if any(holders[id(param)] > 1 for param in module.parameters(recurse=False))
    }


def refuse_tied_sfb(name: str) -> None:
    """Warn that a layer forced to ``sfb`` is allreduced instead because its weight is tied to another module's."""
    warnings.warn(
        f"sfb is refused for '{name}': another module holds the same weight (tied weights), and a gradient rebuilt "
        "from this layer's factors would drop the other module's share; its gradients are allreduced instead",
        UserWarning,
        stacklevel=3,
    )


def predict_ps(calibration: Calibration, workers: int, servers: int, nbytes: int) -> float:
    """Poseidon's parameter-server cost for one layer: the busiest side's bytes times β, plus α per message.

    Each worker pushes ``nbytes`` and pulls ``nbytes``; with bytes balanced over S servers, each server receives
    P·nbytes/S and sends as much. A link's β and a message's α come from the calibrated ring allreduce, which
    moves 2(P-1)/P·nbytes per rank in 2(P-1) messages: the inter-host link's when the job spans hosts with several
    ranks each (PS traffic crosses hosts and does not use shared memory), else the job's end-to-end line.
    """
    latency, per_byte = calibration.lines["allreduce"]
    ring = workers
    if "inter-host" in calibration.links:
        latency, per_byte = calibration.links["inter-host"]
        ring = 2  # probed among one rank per host: the line of a two-party exchange is the closest stand-in
    link_per_byte = per_byte * ring / (2 * (ring - 1))
    message_latency = latency / (2 * (ring - 1))
    busiest_bytes = max(2 * nbytes, 2 * workers * nbytes / servers)
    messages = 2 * max(1, math.ceil(workers / servers))
    return link_per_byte * busiest_bytes + message_latency * messages


def forced_scheme(name: str, module: nn.Module, overrides: dict[object, str]) -> Scheme | None:
    """The scheme ``overrides`` forces on a module, by its name first, then by its type."""
    if name in overrides:
        return Scheme.parse(overrides[name], "comm_overrides")
    for key, scheme in overrides.items():
        if isinstance(key, type) and isinstance(module, key):
            return Scheme.parse(scheme, "comm_overrides")
    return None


def build_plan(
    model: nn.Module,
    calibration: Calibration,
    workers: int,
    rows: dict[str, int],
    overrides: dict[object, str] | None = None,
    allowed: tuple[Scheme, ...] = SCHEMES,
    servers: int | None = None,
) -> list[LayerPlan]:
    """Plan every module that owns trainable parameters directly.

    Args:
        model: the model.
        calibration: the fitted costs (the same on every rank).
        workers: P.
        rows: K for each ``nn.Linear`` by module name (the maximum over ranks).
        overrides: scheme forced per module name or module type, e.g. ``{"fc1": "sfb", nn.Embedding: "allreduce"}``.
        allowed: schemes ``auto`` may choose from.
        servers: S for the ``ps`` prediction (None: ``ps`` is neither predicted nor chosen unless forced).
    """
    overrides = overrides or {}
    for scheme in overrides.values():
        Scheme.parse(scheme, "comm_overrides")
    plans = []
    tied = tied_modules(model)
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        nbytes = sum(p.numel() * p.element_size() for p in params)
        linear = None
        is_tied = name in tied
        if isinstance(module, nn.Linear) and name in rows and not is_tied:
            linear = (rows[name], module.out_features, module.in_features)
        spares = spares_local_gradient(module)
        predictions = predict(calibration, workers, nbytes, linear, params[0].element_size(), servers, spares)
        plan = LayerPlan(
            name,
            type(module).__name__,
            tuple(module.weight.shape) if hasattr(module, "weight") else (),
            nbytes,
            rows.get(name),
            {k: v * 1e3 for k, v in predictions.items()},
        )
        if linear is not None:
            plan.rebuild_flops = sfb_rebuild_flops(workers, linear)
            plan.spared_flops = sfb_spared_flops(linear) if spares else 0.0
        forced = forced_scheme(name, module, overrides)
        if forced == Scheme.SFB and is_tied:
            refuse_tied_sfb(name)
            forced = None
        if forced is not None:
            if forced == Scheme.SFB and linear is None:
                raise ValueError(f"comm_overrides forces sfb on '{name}', but it is not an nn.Linear that ran forward")
            plan.choice, plan.forced = forced, True
        else:
            plan.choice = pick(predictions, allowed)
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
        choice = plan.choice.value + ("*" if plan.forced else "")
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
    lines.append(
        "* forced by comm_overrides. expected: the choice's prediction as executed (fused layers share one "
        "latency); measured: the fastest rank's time in training (not ps); both running medians; auto "
        "chooses ps only with dedicated servers (shoalrun --num-servers)"
    )
    return "\n".join(lines)
