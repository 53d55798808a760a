"""The communication schemes a layer's gradient can travel by, as one table: one row per scheme.

Each ``SchemeRow`` says which layers the scheme can serve, what it is predicted to cost from the calibrated lines
(``cost``: the wire and the local work, and the rank a low-rank scheme would use), how the simulator plays its
exchange (``play``), whether it is lossy, and what state it keeps between steps. The planner, the simulator and the
optimizer's router read the rows; a new scheme is a new row (and, in a front end, the class that carries it).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from shoal.plan.calibration import Calibration


class Scheme(str, enum.Enum):
    """A per-layer communication method. A ``str`` too, so ``"sfb"`` and ``Scheme.SFB`` compare equal."""

    ALLREDUCE = "allreduce"
    """Plain allreduce of the gradient (fused with others in the optimizer's buckets)."""
    FP16 = "fp16"
    """Cast to float16, allreduce half the bytes, cast back."""
    BF16 = "bf16"
    """Cast to bfloat16, allreduce half the bytes, cast back."""
    SFB = "sfb"
    """Sufficient factor broadcasting (fully-connected layers): allgather K·(M+N) factors, rebuild the gradient."""
    PS = "ps"
    """The sharded parameter server: push the gradient, pull the updated values."""
    POWERSGD = "powersgd"
    """Rank-r PowerSGD of every gradient with a matrix view, with error feedback and warm start."""
    TOPK = "topk"
    """Top-k sparsification with error feedback: allgather each rank's k largest entries and their indices."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def row(self) -> SchemeRow:
        """This scheme's row of the table."""
        return ROWS[self]

    @property
    def exchange(self) -> str | None:
        """The calibrated line (``Calibration.lines`` key) its collective runs on; None for the parameter server."""
        return ROWS[self].line

    @property
    def lossy(self) -> bool:
        """Whether it changes the gradient (half precision on the wire, low rank, sparsification)."""
        return ROWS[self].lossy

    @classmethod
    def parse(cls, value: object, where: str) -> Scheme:
        """``value`` as a scheme; a ValueError names ``where`` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown scheme {value!r} in {where}; choose from {[s.value for s in cls]}") from None


class Play(str, enum.Enum):
    """How a scheme's exchange runs, which the optimizer follows and the simulator plays."""

    BUCKET = "bucket"
    """Fused into the optimizer's allreduce buckets as gradients become ready."""
    FACTORS = "factors"
    """SFB: the inputs at forward, the output gradients when ready, the rebuild at synchronize."""
    DIRECT = "direct"
    """Its own exchange once the layer's gradients are final, its local work at synchronize."""

    def __str__(self) -> str:
        return self.value


class Planned(str, enum.Enum):
    """A ``comm=`` that leaves each layer's scheme to the planner (a ``str`` too: ``"auto"`` compares equal)."""

    AUTO = "auto"
    """The lossless schemes; fp16 or bf16 only by a clear margin; ps only with dedicated servers."""
    AUTO_LOSSY = "auto-lossy"
    """``auto``'s schemes and the compressed ones (PowerSGD, top-k)."""

    def __str__(self) -> str:
        return self.value

    def allowed(self, servers: bool) -> tuple[Scheme, ...]:
        """The schemes this mode may choose from; ``servers``: dedicated parameter servers are there."""
        lossless = AUTO_SCHEMES if servers else tuple(s for s in AUTO_SCHEMES if not ROWS[s].on_servers)
        return (*lossless, *COMPRESSED) if self is Planned.AUTO_LOSSY else lossless


def parse_comm(value: object, where: str = "comm") -> Scheme | Planned:
    """A ``comm=`` value: a scheme forced on every layer, or a planner mode; a ValueError lists the choices."""
    for kind in (Planned, Scheme):
        try:
            return kind(value)
        except ValueError:
            continue
    raise ValueError(f"{where} must be one of {', '.join(COMM_CHOICES)}, got {value!r}")


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


FACTOR_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per entry of PowerSGD's factors on the wire, by ``LossyOptions.factors``."""


@dataclass(frozen=True)
class LossyOptions:
    """The bounds on the lossy schemes, per optimizer."""

    rank: int | None = None
    """PowerSGD's rank for every layer; None: chosen per layer, up to ``max_rank``."""
    max_rank: int = 4
    min_rank: int = 2
    """The lowest rank a per-layer choice takes (if ``max_rank`` allows): rank 1 converges noticeably slower (Vogels
    et al. 2019 match SGD's accuracy from rank 2; on digits at 100 Mbit/s, rank 1 ended 1.4 points short of the
    uncompressed run in 8 epochs where DDP's hook at rank 4 matched it)."""
    ratio: float = 0.01
    """Top-k's share of each gradient's entries sent."""
    min_rate: float = 2.0
    """A gradient is compressed only where it shrinks at least this much (else it joins the plain allreduce)."""
    factors: str = "float32"
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


def _allreduce_cost(ctx: CostContext, layer: LayerShape) -> Estimate:
    return Estimate(ctx.calibration.seconds("allreduce", layer.nbytes))


def _cast_cost(line: str) -> Callable[[CostContext, LayerShape], Estimate]:
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


def _sfb_cost(ctx: CostContext, layer: LayerShape) -> Estimate:
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


def _ps_cost(ctx: CostContext, layer: LayerShape) -> Estimate:
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


def _powersgd_serves(ctx: CostContext, layer: LayerShape) -> bool:
    return bool(_powersgd_ranks(ctx, layer))


def _powersgd_best(ctx: CostContext, layer: LayerShape) -> Estimate:
    estimates = [powersgd_cost(ctx, layer, rank) for rank in _powersgd_ranks(ctx, layer)]
    cheapest = min(e.seconds for e in estimates)
    return max((e for e in estimates if e.seconds <= RANK_SLACK * cheapest), key=lambda e: e.rank or 0)


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


def _topk_serves(ctx: CostContext, layer: LayerShape) -> bool:
    return any(topk_fits(_elements(shape), ctx.lossy.ratio, ctx.lossy.min_rate) for shape in layer.shapes)


@dataclass(frozen=True)
class SchemeRow:
    """One scheme's entry in the table."""

    scheme: Scheme
    serves: Callable[[CostContext, LayerShape], bool]
    """Whether the scheme can carry this layer (in this job: the parameter server only with servers)."""
    cost: Callable[[CostContext, LayerShape], Estimate]
    """Its predicted time for the layer (only asked where it serves)."""
    play: Play
    """How the exchange runs (and the simulator plays it)."""
    lossy: bool
    state: str
    """What it keeps from step to step."""
    line: str | None
    """The calibrated line its collective runs on (None: not an engine collective)."""
    carrier: bool = True
    """A front end wraps the layer in the scheme's own carrier; False: the optimizer's buckets carry its gradients
    as they are (the plain allreduce)."""
    needs_linear: bool = False
    """It serves only fully-connected layers with their (K, M, N), and no tied weight (even where forced)."""
    one_pass: bool = False
    """It needs one backward pass per step: what it captures at forward does not accumulate."""
    on_servers: bool = False
    """The layer's values and optimizer state live on parameter servers, in one session for all such layers."""
    error_feedback: bool = False
    """It compresses with error feedback (lossy beyond rounding; ``auto`` never picks it, ``auto-lossy`` may)."""
    ranked: bool = False
    """It takes a rank per layer (``LayerPlan.rank``)."""

    @property
    def rebuilds(self) -> bool:
        """Its gradient is rebuilt from gathered factors at synchronize: the measured exchange includes the rebuild,
        and backward spares the local weight gradient where the layer allows."""
        return self.play is Play.FACTORS


def _always(ctx: CostContext, layer: LayerShape) -> bool:
    return True


def _linear_only(ctx: CostContext, layer: LayerShape) -> bool:
    return layer.linear is not None


ROWS: dict[Scheme, SchemeRow] = {
    row.scheme: row
    for row in (
        SchemeRow(Scheme.ALLREDUCE, _always, _allreduce_cost, Play.BUCKET, False, "nothing", "allreduce", carrier=False),
        SchemeRow(Scheme.FP16, _always, _cast_cost("fp16"), Play.BUCKET, True, "nothing", "fp16"),
        SchemeRow(Scheme.BF16, _always, _cast_cost("bf16"), Play.BUCKET, True, "nothing", "bf16"),
        SchemeRow(
            Scheme.SFB,
            _linear_only,
            _sfb_cost,
            Play.FACTORS,
            False,
            "nothing",
            "allgather",
            needs_linear=True,
            one_pass=True,
        ),
        SchemeRow(
            Scheme.PS,
            lambda ctx, layer: bool(ctx.servers),
            _ps_cost,
            Play.DIRECT,
            False,
            "the servers hold the layer's values and optimizer state",
            None,
            on_servers=True,
        ),
        SchemeRow(
            Scheme.POWERSGD,
            _powersgd_serves,
            _powersgd_best,
            Play.DIRECT,
            True,
            "per gradient: the error-feedback residual and Q (warm start); the step count (warm-up)",
            "allreduce",
            error_feedback=True,
            ranked=True,
        ),
        SchemeRow(
            Scheme.TOPK,
            _topk_serves,
            topk_cost,
            Play.DIRECT,
            True,
            "per gradient: the error-feedback residual; the step count (warm-up)",
            "allgather",
            error_feedback=True,
        ),
    )
}
"""Every scheme's row."""

SCHEMES = tuple(Scheme)
"""Every scheme, in the planner's order of preference on a tie."""
COMPRESSED = tuple(s for s in SCHEMES if ROWS[s].error_feedback)
"""The schemes that compress with error feedback (lossy beyond rounding; ``auto`` never picks them)."""
AUTO_SCHEMES = tuple(s for s in SCHEMES if s not in COMPRESSED)
"""What ``comm="auto"`` may choose from (fp16/bf16 only by a clear margin; ``ps`` only with dedicated servers)."""
COMM_CHOICES = (*(s.value for s in SCHEMES), *(p.value for p in Planned))
"""Every value ``comm=`` takes: a scheme's name, or a planner mode."""
DEFAULT_RANK = 4
"""PowerSGD's rank where nothing chose one (a forced scheme without a plan)."""
DEFAULT_WARMUP_STEPS = 100
"""Steps without compression when neither the warm-up nor the run's length is given (torch's PowerSGD hook
advises about 10% of the run; its own default is 1,000 steps)."""


@dataclass(frozen=True)
class Compressed:
    """A compressed scheme with its settings: what ``Compression.powersgd(...)`` and ``Compression.topk(...)``
    return (for ``compression=``, or as a value of ``comm_overrides``)."""

    scheme: Scheme
    options: LossyOptions = LossyOptions()
    warmup_steps: int | None = None
    """Synchronized steps sent uncompressed first; None: 10% of ``total_steps`` when given, else
    ``DEFAULT_WARMUP_STEPS``."""
    total_steps: int | None = None
    """The run's length in optimizer steps, when known."""

    def __post_init__(self) -> None:
        if self.scheme not in COMPRESSED:
            raise ValueError(f"{self.scheme} is not a compressed scheme; choose from {[s.value for s in COMPRESSED]}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")

    @property
    def warmup(self) -> int:
        """The steps sent uncompressed before compression starts."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.total_steps is not None:
            return self.total_steps // 10
        return DEFAULT_WARMUP_STEPS


def scheme_of(value: object, where: str) -> Scheme:
    """A scheme's name, a ``Scheme`` or a ``Compressed`` as its scheme; a ValueError names ``where`` otherwise."""
    if isinstance(value, Compressed):
        return value.scheme
    return Scheme.parse(value, where)


def fill_bucket(held: int, nbytes: int, limit: int) -> tuple[int, bool]:
    """The bucket policy of the ``bucket`` schemes, one function for the optimizer and the simulator: a gradient of
    ``nbytes`` that became final joins the bucket holding ``held`` bytes, and the bucket leaves once ``limit`` bytes
    wait (0: every gradient alone). Returns (bytes held now, whether the bucket leaves)."""
    held += nbytes
    return held, held >= limit


def estimates(ctx: CostContext, layer: LayerShape) -> dict[Scheme, Estimate]:
    """Every scheme's estimate for one layer, among the schemes that can serve it (all zero on one worker)."""
    served = [s for s in SCHEMES if ROWS[s].serves(ctx, layer)]
    if ctx.workers == 1:
        return {s: Estimate(0.0) for s in served}
    return {s: ROWS[s].cost(ctx, layer) for s in served}
