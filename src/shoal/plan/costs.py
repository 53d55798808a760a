"""What each scheme of the table costs for one layer: the layer as the table sees it, the context every cost needs,
and one cost function per row (``shoal.plan.schemes`` binds them to the rows).

Costs are predicted from the calibrated lines (``Calibration``): the wire, and the local work of casts, matmuls,
orthogonalisation and selection, minus the backward work a scheme spares.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from shoal.plan.calibration import Calibration
from shoal.plan.far import RoundPlan
from shoal.plan.outer_wire import exchange_parts


@dataclass(frozen=True)
class LayerShape:
    """What the table needs to know of one layer (a module owning trainable parameters), framework-neutral."""

    nbytes: int
    """All its gradients' bytes."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Each trainable parameter's shape."""
    itemsize: int = 4
    linear: tuple[int, int, int] | None = None
    """(K, M, N) of a fully-connected layer that ran forward and holds no tied weight: rows per step, outputs,
    inputs (what SFB needs)."""
    spares_local: bool = False
    """SFB on it spares backward the local weight gradient (an ``nn.Linear`` with a trainable bias)."""


Factors = Literal["float32", "bfloat16"]
"""PowerSGD's factors on the wire."""
FACTOR_BYTES: dict[Factors, int] = {"float32": 4, "bfloat16": 2}
"""Bytes per entry of PowerSGD's factors on the wire, by ``LossyOptions.factors``."""


@dataclass(frozen=True)
class LossyOptions:
    """The bounds on the lossy schemes, per optimizer."""

    rank: int | None = None
    """PowerSGD's rank for every layer; None: chosen per layer, up to ``max_rank``."""
    max_rank: int = 4
    min_rank: int = 2
    """The lowest rank a per-layer choice takes (if ``max_rank`` allows): rank 1 converges noticeably slower (Vogels
    et al. 2019 match SGD's accuracy from rank 2; the measurement is in docs/communication.md)."""
    ratio: float = 0.01
    """Top-k's share of each gradient's entries sent."""
    min_rate: float = 2.0
    """A gradient is compressed only where it shrinks at least this much (else it joins the plain allreduce)."""
    factors: Factors = "float32"
    """PowerSGD's P and Q on the wire: ``"float32"`` (as torch's hook) or ``"bfloat16"`` (half the bytes; each rank's
    error feedback keeps the rounding of its own share)."""

    def __post_init__(self) -> None:
        if self.factors not in FACTOR_BYTES:
            raise ValueError(f"factors must be one of {sorted(FACTOR_BYTES)}, got {self.factors!r}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"the PowerSGD rank must be >= 1, got {self.rank}")
        if self.max_rank < 1 or self.min_rank < 1:
            raise ValueError(f"max_rank and min_rank must be >= 1, got {self.max_rank} and {self.min_rank}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"the top-k ratio must be in (0, 1], got {self.ratio}")
        if self.min_rate < 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {self.min_rate}")


@dataclass(frozen=True)
class CostContext:
    """What every row's cost needs besides the layer."""

    calibration: Calibration
    workers: int
    servers: int | None = None
    """S for the parameter server's prediction (None: it is neither predicted nor chosen unless forced)."""
    lossy: LossyOptions = LossyOptions()
    rounds: RoundPlan | None = None
    """Local steps' H and codec, where they are weighed (``auto-far``, ``comm="local"``)."""


@dataclass(frozen=True)
class Estimate:
    """A scheme's predicted seconds for one layer's step: on the wire (collectives) and local work (casts, matmuls,
    orthogonalisation, selection), minus the backward work it spares."""

    wire_s: float
    local_s: float = 0.0
    rank: int | None = None
    """The rank PowerSGD would use."""

    @property
    def seconds(self) -> float:
        return self.wire_s + self.local_s


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """A gradient's matrix view for low rank: (first dimension, the rest), e.g. a convolution's out × in·kh·kw."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    return rows, math.prod(shape) // rows if rows else 0


def powersgd_rank_fits(view: tuple[int, int], rank: int, min_rate: float) -> bool:
    """Whether rank ``rank`` (at most the matrix's smaller side: full rank) shrinks an n×m gradient at least
    ``min_rate`` times: n·m ≥ min_rate·r·(n+m)."""
    rows, columns = view
    rank = min(rank, rows, columns)
    return rank >= 1 and rows * columns >= min_rate * rank * (rows + columns)


def topk_count(elements: int, ratio: float) -> int:
    """k for a gradient of ``elements`` entries."""
    return max(1, math.ceil(ratio * elements))


def topk_fits(elements: int, ratio: float, min_rate: float) -> bool:
    """Whether top-k (k values and k indices) shrinks the gradient at least ``min_rate`` times."""
    return elements >= min_rate * 2 * topk_count(elements, ratio)


def _elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# ----- costs, one function per row -----


def allreduce_cost(ctx: CostContext, layer: LayerShape) -> Estimate:
    return Estimate(ctx.calibration.seconds("allreduce", layer.nbytes))


def cast_cost(line: str) -> Callable[[CostContext, LayerShape], Estimate]:
    def cost(ctx: CostContext, layer: LayerShape) -> Estimate:
        return Estimate(ctx.calibration.seconds(line, layer.nbytes))  # the line includes the two casts

    return cost


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


def sfb_cost(ctx: CostContext, layer: LayerShape) -> Estimate:
    # Two allgathers (inputs and output gradients), then one matmul rebuilds the summed gradient; backward no longer
    # computes the local one.
    assert layer.linear is not None
    flops = ctx.calibration.flops_per_s
    rebuild = sfb_rebuild_flops(ctx.workers, layer.linear) / flops
    spared = sfb_spared_flops(layer.linear) / flops if layer.spares_local else 0.0
    return Estimate(sum(sfb_allgather_seconds(ctx.calibration, ctx.workers, layer.linear, layer.itemsize)), rebuild - spared)


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


def ps_cost(ctx: CostContext, layer: LayerShape) -> Estimate:
    assert ctx.servers
    return Estimate(predict_ps(ctx.calibration, ctx.workers, ctx.servers, layer.nbytes))


def _rest_seconds(calibration: Calibration, nbytes: int) -> float:
    """The gradients a compressed scheme leaves to the plain allreduce: fused into the buckets, they add their bytes
    (the bucket's latency is paid anyway)."""
    return calibration.lines["allreduce"][1] * nbytes


LOW_RANK_PROBED = (1, 4)
"""The ranks at which calibration times PowerSGD's local work (``Calibration.local``: ``powersgd@1``, ``powersgd@4``)."""


def powersgd_local_seconds(calibration: Calibration, entries: int, rank: int) -> float:
    """PowerSGD's local work on one rank for a gradient of ``entries`` at ``rank``: the calibrated pipeline at the
    nearest probed rank not below it (memory-bound: it passes over the entries several times; above rank 1 the
    products leave the matrix-vector path, and ranks 2 to 8 measure alike), plus the products' extra floating-point
    work above the highest probed rank."""
    probed = min((r for r in LOW_RANK_PROBED if r >= rank), default=LOW_RANK_PROBED[-1])
    extra = 6.0 * entries * max(rank - probed, 0) / calibration.flops_per_s
    return calibration.local_seconds(f"powersgd@{probed}", entries) + extra


FACTORED_PROBE = (32, 4)
"""The rows K and rank at which calibration times PowerSGD from a linear layer's factors (``powersgd-factored``)."""


def factored_local_seconds(calibration: Calibration, linear: tuple[int, int, int], rank: int) -> float:
    """PowerSGD's local work from an ``nn.Linear``'s factors (K, M, N): the calibrated pipeline (it passes over the
    M·N residual about five times), corrected for K and r other than the probe's (one M·N product of rank K + r),
    minus the local weight gradient backward no longer computes (2·K·M·N flops, as for SFB)."""
    rows, outputs, inputs = linear
    entries = outputs * inputs
    probe_rows, probe_rank = FACTORED_PROBE
    extra = 2.0 * entries * (rows + rank - probe_rows - probe_rank) / calibration.flops_per_s
    return calibration.local_seconds("powersgd-factored", entries) + extra - sfb_spared_flops(linear) / calibration.flops_per_s


def powersgd_cost(ctx: CostContext, layer: LayerShape, rank: int) -> Estimate:
    """PowerSGD at ``rank`` for every gradient of the layer that it shrinks enough (the rest allreduced): per n×m
    matrix, an allreduce of P (n·r) and of Q (m·r) in the options' factor dtype, and the local work
    (``powersgd_local_seconds``)."""
    calibration, min_rate = ctx.calibration, ctx.lossy.min_rate
    wire = local = 0.0
    rest = 0
    for shape in layer.shapes:
        view = matrix_view(shape)
        if view is None or not powersgd_rank_fits(view, rank, min_rate):
            rest += _elements(shape) * layer.itemsize
            continue
        rows, columns = view
        used = min(rank, rows, columns)
        entry = FACTOR_BYTES[ctx.lossy.factors]
        wire += calibration.seconds("allreduce", rows * used * entry) + calibration.seconds("allreduce", columns * used * entry)
        if layer.linear is not None and layer.spares_local and view == layer.linear[1:]:
            local += factored_local_seconds(calibration, layer.linear, used)
        else:
            local += powersgd_local_seconds(calibration, rows * columns, used)
    return Estimate(wire + _rest_seconds(calibration, rest), local, rank)


POWERSGD_RANKS = (1, 2, 4, 8, 16, 32, 64)
"""The ranks ``auto-lossy`` chooses from (up to ``LossyOptions.max_rank``)."""
RANK_SLACK = 1.25
"""Per layer, the highest rank whose predicted time is within this factor of the cheapest rank's: where latency
dominates, a higher rank (a better approximation) costs almost nothing."""


def _powersgd_ranks(ctx: CostContext, layer: LayerShape) -> list[int]:
    """The ranks to weigh for a layer: the fixed one, else those up to ``max_rank`` that compress some gradient."""
    options = ctx.lossy
    floor = min(options.min_rank, options.max_rank)
    chosen = [r for r in POWERSGD_RANKS if floor <= r <= options.max_rank]
    candidates = [options.rank] if options.rank is not None else chosen
    views = [v for v in map(matrix_view, layer.shapes) if v is not None]
    return [r for r in candidates if any(powersgd_rank_fits(view, r, options.min_rate) for view in views)]


def powersgd_serves(ctx: CostContext, layer: LayerShape) -> bool:
    return bool(_powersgd_ranks(ctx, layer))


def powersgd_best(ctx: CostContext, layer: LayerShape) -> Estimate:
    estimates = [powersgd_cost(ctx, layer, rank) for rank in _powersgd_ranks(ctx, layer)]
    cheapest = min(e.seconds for e in estimates)
    # A factored layer's estimate can be below zero (backward's spared work outweighs the rest): slack on |cheapest|.
    within = cheapest + (RANK_SLACK - 1) * abs(cheapest)
    return max((e for e in estimates if e.seconds <= within), key=lambda e: e.rank or 0)


def topk_cost(ctx: CostContext, layer: LayerShape) -> Estimate:
    """Top-k of every gradient it shrinks enough (the rest allreduced): one allgather of P·2k numbers (values and
    indices), and the local work (the calibrated ``topk`` line: residual, selection and scatter, in entries)."""
    calibration, ratio, min_rate = ctx.calibration, ctx.lossy.ratio, ctx.lossy.min_rate
    wire = local = 0.0
    rest = 0
    for shape in layer.shapes:
        elements = _elements(shape)
        if not topk_fits(elements, ratio, min_rate):
            rest += elements * layer.itemsize
            continue
        k = topk_count(elements, ratio)
        wire += calibration.seconds("allgather", ctx.workers * 2 * k * 4)
        local += calibration.local_seconds("topk", elements)
    return Estimate(wire + _rest_seconds(calibration, rest), local)


def topk_serves(ctx: CostContext, layer: LayerShape) -> bool:
    return any(topk_fits(_elements(shape), ctx.lossy.ratio, ctx.lossy.min_rate) for shape in layer.shapes)


def local_serves(ctx: CostContext, layer: LayerShape) -> bool:
    return ctx.rounds is not None


def local_cost(ctx: CostContext, layer: LayerShape) -> Estimate:
    """Local steps for one layer, per inner step: its share of the outer exchange (its entries in the codec, across
    the hosts) spread over the round's H steps: the codec's local work, and the wire where the round does not hide
    it (the whole model's exposed share of the wire, ``RoundPlan``). The in-host exchange is the plain allreduce's,
    among fewer ranks."""
    rounds = ctx.rounds
    assert rounds is not None
    entries = layer.nbytes // max(layer.itemsize, 1)
    wire, local = exchange_parts(ctx.calibration, rounds.hosts, entries, rounds.codec)
    exposed = rounds.exposed_s / rounds.wire_s if rounds.wire_s > 0 else float(not rounds.overlap)
    return Estimate(wire * exposed / rounds.every, local / rounds.every)
