"""The communication schemes a layer's gradient can travel by, as one table: one row per scheme.

Each ``SchemeRow`` says which layers the scheme can serve, what it is predicted to cost from the calibrated lines
(``cost``, from ``shoal.plan.costs``: the wire and the local work, and the rank a low-rank scheme would use), how the
simulator plays its
exchange (``play``), whether it is lossy, and what state it keeps between steps. The planner, the simulator and the
optimizer's router read the rows; a new scheme is a new row (and, in a front end, the class that carries it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.plan.costs import (
    CostContext,
    Estimate,
    LayerShape,
    LossyOptions,
    allreduce_cost,
    cast_cost,
    local_cost,
    local_serves,
    powersgd_best,
    powersgd_serves,
    ps_cost,
    sfb_cost,
    topk_cost,
    topk_serves,
)


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
    LOCAL = "local"
    """Local steps (DiLoCo): gradients reduced inside each host every step; the hosts average the weights' change
    every H steps, and an outer optimizer applies it (``shoal.plan.far``). Whole-model: every layer or none."""

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
    OUTER = "outer"
    """Bucketed inside each host every step; across hosts once per outer round, after the optimizer's step."""

    def __str__(self) -> str:
        return self.value


class Planned(str, enum.Enum):
    """A ``comm=`` that leaves each layer's scheme to the planner (a ``str`` too: ``"auto"`` compares equal)."""

    AUTO = "auto"
    """The lossless schemes; fp16 or bf16 only by a clear margin; ps only with dedicated servers."""
    AUTO_LOSSY = "auto-lossy"
    """``auto``'s schemes and the compressed ones (PowerSGD, top-k)."""
    AUTO_FAR = "auto-far"
    """``auto-lossy`` per layer, or local steps for the whole model where they are predicted faster (far-apart
    hosts); the planner then chooses H and the codec."""

    def __str__(self) -> str:
        return self.value

    @property
    def compresses(self) -> bool:
        """It may choose the compressed schemes (``auto-lossy``, ``auto-far``)."""
        return self is not Planned.AUTO

    @property
    def weighs_outer(self) -> bool:
        """It may choose local steps with outer updates for the whole model (``auto-far``)."""
        return self is Planned.AUTO_FAR

    def allowed(self, servers: bool) -> tuple[Scheme, ...]:
        """The schemes this mode may choose from; ``servers``: dedicated parameter servers are there."""
        lossless = AUTO_SCHEMES if servers else tuple(s for s in AUTO_SCHEMES if not ROWS[s].on_servers)
        return (*lossless, *COMPRESSED) if self.compresses else lossless


def parse_comm(value: object, where: str = "comm") -> Scheme | Planned:
    """A ``comm=`` value: a scheme forced on every layer, or a planner mode; a ValueError lists the choices."""
    for kind in (Planned, Scheme):
        try:
            return kind(value)
        except ValueError:
            continue
    raise ValueError(f"{where} must be one of {', '.join(COMM_CHOICES)}, got {value!r}")


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
    outer: bool = False
    """It changes the optimization itself (steps apart, outer updates), for the whole model at once: never a
    per-layer choice; ``auto-far`` weighs it against the whole synchronous plan (``shoal.plan.far.prefer_local``)."""

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
        SchemeRow(Scheme.ALLREDUCE, _always, allreduce_cost, Play.BUCKET, False, "nothing", "allreduce", carrier=False),
        SchemeRow(Scheme.FP16, _always, cast_cost("fp16"), Play.BUCKET, True, "nothing", "fp16"),
        SchemeRow(Scheme.BF16, _always, cast_cost("bf16"), Play.BUCKET, True, "nothing", "bf16"),
        SchemeRow(
            Scheme.SFB,
            _linear_only,
            sfb_cost,
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
            ps_cost,
            Play.DIRECT,
            False,
            "the servers hold the layer's values and optimizer state",
            None,
            on_servers=True,
        ),
        SchemeRow(
            Scheme.POWERSGD,
            powersgd_serves,
            powersgd_best,
            Play.DIRECT,
            True,
            "per gradient: the error-feedback residual and Q (warm start); the step count (warm-up)",
            "allreduce",
            error_feedback=True,
            ranked=True,
        ),
        SchemeRow(
            Scheme.TOPK,
            topk_serves,
            topk_cost,
            Play.DIRECT,
            True,
            "per gradient: the error-feedback residual; the step count (warm-up)",
            "allgather",
            error_feedback=True,
        ),
        SchemeRow(
            Scheme.LOCAL,
            local_serves,
            local_cost,
            Play.OUTER,
            True,
            "the round's start weights, the outer optimizer's momentum, the codec's residual, the inner steps taken",
            "allreduce",
            carrier=False,
            outer=True,
        ),
    )
}
"""Every scheme's row."""

SCHEMES = tuple(Scheme)
"""Every scheme, in the planner's order of preference on a tie."""
COMPRESSED = tuple(s for s in SCHEMES if ROWS[s].error_feedback)
"""The schemes that compress with error feedback (lossy beyond rounding; ``auto`` never picks them)."""
AUTO_SCHEMES = tuple(s for s in SCHEMES if s not in COMPRESSED and not ROWS[s].outer)
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
    options: LossyOptions = field(default_factory=LossyOptions)
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


def row_of(mode: Scheme | Planned) -> SchemeRow | None:
    """The table's row of a forced ``comm`` (a scheme on every layer), or None for a planner mode."""
    return ROWS[mode] if isinstance(mode, Scheme) else None


def forces_outer(mode: Scheme | Planned) -> bool:
    """``comm`` forces a scheme that changes the optimization for the whole model (local steps, ``outer``)."""
    row = row_of(mode)
    return row is not None and row.outer


def takes_outer(mode: Scheme | Planned) -> bool:
    """``comm`` forces local steps or may choose them (``auto-far``)."""
    return forces_outer(mode) or (isinstance(mode, Planned) and mode.weighs_outer)


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
