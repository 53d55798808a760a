"""A training step at P workers, simulated with the planner's cost model: what ``python -m shoal.predict`` runs.

The inputs are a profile of one worker's step (forward, the moment each gradient becomes ready during backward, the
update) and a network (``Links``: per-message latency and per-byte time of the links between hosts and within one,
the cost of half-precision casts, the matmul rate). For a worker count P with R ranks per host the network gives a
``Calibration`` (ring and hierarchical allreduce, ring allgather), the planner picks each layer's scheme from it as
``comm="auto"`` would, and the step is played out as ``DistributedOptimizer`` and the engine run it:

- gradients of allreduce-family layers go into buckets of ``bucket_bytes`` in the order they become ready, one
  bucket per scheme (plain, fp16, bf16); a full bucket is submitted at once, the rest at the end of backward;
- an SFB layer submits its inputs' allgather at forward (taken as the start of backward) and its output gradients'
  when its gradient is ready, and rebuilds the gradient at ``synchronize``;
  with a trainable bias it spares backward its local weight gradient, so backward ends (and later gradients are
  ready) that much earlier;
  a parameter-server layer pushes and pulls when its gradient is ready;
- the engine runs one collective at a time, in submission order;
- the step ends when backward and every exchange are done, then the SFB rebuilds and the update run.

What it leaves out, on purpose: the engine's negotiation cycle (inside the calibrated latency) and the engine's
fusion of buckets submitted together. Where compute takes every core (``cpu_bound``), only the time an exchange
spends waiting on the wire overlaps backward; its busy time adds to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shoal.plan.calibration import Calibration
from shoal.plan.costs import (
    CostContext,
    Estimate,
    LayerShape,
    LossyOptions,
    sfb_allgather_seconds,
    sfb_rebuild_flops,
    sfb_spared_flops,
)
from shoal.plan.planner import pick
from shoal.plan.schemes import Planned, Play, Scheme, estimates, fill_bucket, forces_outer, parse_comm, takes_outer

LINK_RATES = {"1gbit": 1e9, "10gbit": 1e10, "25gbit": 2.5e10, "100gbit": 1e11}
"""The ``--link`` presets: line rate in bits per second."""
PRESET_LATENCY_S = {"1gbit": 50e-6, "10gbit": 30e-6, "25gbit": 25e-6, "100gbit": 10e-6}
"""Per-message latency assumed for each preset (TCP on Ethernet; the 100 Gbit/s one assumes RDMA)."""
PAYLOAD_EFFICIENCY = 0.94
"""Share of the line rate that carries payload over TCP/IP on Ethernet (headers, framing)."""


@dataclass(frozen=True)
class Line:
    """One link class: ``seconds = messages * latency + bytes * per_byte``."""

    latency_s: float
    per_byte_s: float


@dataclass(frozen=True)
class Links:
    """The network a prediction assumes, per link class, plus the local costs the schemes add."""

    inter: Line | None
    """Between hosts: one message's latency and one host's link time per byte (None: a single host only)."""
    intra: Line
    """Within a host: one allreduce among its ranks (the shared-memory path), as a line in the gradient's bytes."""
    cast_per_byte_s: float
    """fp16/bf16's two casts, per fp32 byte of gradient."""
    flops_per_s: float
    """The matmul rate of SFB's rebuild."""
    intra_allgather: Line | None = None
    """Within a host: one allgather among its ranks, as a line in the gathered bytes (None: the intra line)."""
    cpu_share: dict[str, float] = field(default_factory=dict)
    """By exchange, the share of its time that keeps a core busy, as a calibration measured it (``Calibration.
    cpu_share``; empty: all of it)."""
    local: dict[str, tuple[float, float]] = field(default_factory=dict)
    """The compressed schemes' local work, as a calibration measured it (``Calibration.local``; empty: its
    stand-ins)."""

    @classmethod
    def preset(cls, link: str, intra: Line, cast_per_byte_s: float, flops_per_s: float) -> Links:
        """A ``--link`` preset between hosts; ``intra`` and the local costs as given."""
        if link not in LINK_RATES:
            raise ValueError(f"unknown link {link!r}; choose from {sorted(LINK_RATES)} or give a calibration file")
        per_byte = 8 / (LINK_RATES[link] * PAYLOAD_EFFICIENCY)
        return cls(Line(PRESET_LATENCY_S[link], per_byte), intra, cast_per_byte_s, flops_per_s)

    @classmethod
    def from_calibration(cls, calibration: Calibration, workers: int, hosts: int) -> Links:
        """Undo the ring arithmetic of a calibration measured with ``workers`` ranks on ``hosts`` hosts.

        One rank per host: the allreduce line is a ring over the hosts (2(H−1) messages, 2(H−1)/H of the bytes per
        link), which gives a message's latency and the link's time per byte. Several ranks per host: the
        calibration's ``inter-host`` and ``intra-host`` lines. One host: only the intra-host line is known.
        """
        if workers < 1 or hosts < 1 or workers % hosts:
            raise ValueError(f"a calibration of {workers} workers on {hosts} hosts is not one rank count per host")
        latency, per_byte = calibration.lines["allreduce"]
        half_per_byte = calibration.lines["fp16"][1]
        cast = max(half_per_byte - per_byte / 2, 0.0)
        inter = None
        share = dict(calibration.cpu_share)
        if hosts == 1:
            intra = Line(latency, per_byte)
            gather_latency, gather_per_byte = calibration.lines["allgather"]
            gather = Line(gather_latency, gather_per_byte)
            return cls(None, intra, cast, calibration.flops_per_s, gather, share, dict(calibration.local))
        if workers == hosts:
            inter = Line(latency / (2 * (hosts - 1)), per_byte * hosts / (2 * (hosts - 1)))
            intra = Line(0.0, 0.0)
        else:
            if "inter-host" not in calibration.links or "intra-host" not in calibration.links:
                raise ValueError("a calibration of several ranks per host needs its intra-host and inter-host lines")
            inter_latency, inter_per_byte = calibration.links["inter-host"]
            inter = Line(inter_latency / (2 * (hosts - 1)), inter_per_byte * hosts / (2 * (hosts - 1)))
            intra = Line(*calibration.links["intra-host"])
        return cls(inter, intra, cast, calibration.flops_per_s, cpu_share=share, local=dict(calibration.local))

    def calibration(self, workers: int, ranks_per_host: int) -> Calibration:
        """The lines the planner would measure on ``workers`` ranks, ``ranks_per_host`` on each host.

        Across hosts the allreduce is hierarchical: the ranks of a host reduce through shared memory, then the hosts
        run a ring (2(H−1) messages, 2(H−1)/H of the bytes through each host's link), then the result is shared
        within the host again (inside the intra line). The allgather of T gathered bytes is a ring over all ranks:
        (P−1) messages, and (H−1)/H of T crosses each host's link.
        """
        hosts = math.ceil(workers / ranks_per_host)
        intra = self.intra if ranks_per_host > 1 else Line(0.0, 0.0)
        gather = self.intra_allgather or self.intra
        if hosts == 1:
            allreduce = (intra.latency_s, intra.per_byte_s)
            allgather = (gather.latency_s, gather.per_byte_s) if ranks_per_host > 1 else (0.0, 0.0)
        else:
            if self.inter is None:
                raise ValueError(
                    f"{workers} workers at {ranks_per_host} per host span {hosts} hosts: give the link between hosts "
                    "(--link, or a calibration measured on more than one host)"
                )
            ring = 2 * (hosts - 1)
            allreduce = (
                intra.latency_s + ring * self.inter.latency_s,
                intra.per_byte_s + ring / hosts * self.inter.per_byte_s,
            )
            allgather = ((workers - 1) * self.inter.latency_s, (hosts - 1) / hosts * self.inter.per_byte_s)
        half = (allreduce[0], allreduce[1] / 2 + self.cast_per_byte_s)
        lines = {"allreduce": allreduce, "fp16": half, "bf16": half, "allgather": allgather}
        links = {}
        if hosts > 1 and ranks_per_host > 1:
            assert self.inter is not None
            links = {
                "intra-host": (self.intra.latency_s, self.intra.per_byte_s),
                "inter-host": (2 * self.inter.latency_s, self.inter.per_byte_s),  # a two-party ring: the stand-in
            }
        return Calibration(lines, self.flops_per_s, links, cpu_share=dict(self.cpu_share), local=dict(self.local))


@dataclass(frozen=True)
class Gradient:
    """One parameter's gradient in one worker's step."""

    layer: str
    nbytes: int
    ready_s: float
    """Seconds from the start of backward until the gradient is final."""


@dataclass(frozen=True)
class Layer:
    """A module owning parameters: what the planner needs to know of it."""

    name: str
    kind: str
    nbytes: int
    linear: tuple[int, int, int] | None = None
    """(K, M, N) of a fully-connected layer: rows per step, outputs, inputs."""
    spares_local: bool = False
    """SFB on it spares backward the local weight gradient (for torch:
    ``shoal.torch.layer_comm.layers.spares_local_gradient``)."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Its parameters' shapes (what the compressed schemes need; none: they are not predicted)."""

    def shape(self) -> LayerShape:
        """What the scheme table needs of it."""
        return LayerShape(self.nbytes, self.shapes, 4, self.linear, self.spares_local)


@dataclass
class StepProfile:
    """One worker's step without communication."""

    forward_s: float
    """From the step's start to the start of backward (data, forward, loss)."""
    backward_s: float
    update_s: float
    """The update (profiled in lockstep, with the wait for the slowest worker)."""
    batch: int
    """Samples per worker per step."""
    gradients: list[Gradient]
    layers: list[Layer]

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.update_s


@dataclass
class Exchange:
    """One collective (or parameter-server round) of the simulated step."""

    scheme: Scheme
    layers: tuple[str, ...]
    nbytes: int
    submitted_s: float
    seconds: float
    cpu_s: float = 0.0
    """The part of ``seconds`` that keeps a core busy (``Calibration.cpu_seconds``)."""
    start_s: float = 0.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.seconds


@dataclass
class StepPrediction:
    """What a step costs at one worker count, and where the time goes."""

    workers: int
    ranks_per_host: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    """Time the step waits on communication after backward ends (plus SFB's rebuilds)."""
    comm_s: float
    """Time the engine spends in exchanges, hidden or not."""
    samples_per_s: float
    efficiency: float
    """Throughput over P times one worker's throughput without communication."""
    choices: dict[str, Scheme]
    exchanges: list[Exchange] = field(default_factory=list)
    calibration: Calibration | None = None

    def costliest_layers(self, layer_bytes: dict[str, int], count: int = 2) -> list[str]:
        """The layers whose exchanges take the most engine time (a fused exchange's time shared by bytes)."""
        per_layer: dict[str, float] = {}
        for exchange in self.exchanges:
            total = sum(layer_bytes[layer] for layer in exchange.layers) or 1
            for layer in exchange.layers:
                per_layer[layer] = per_layer.get(layer, 0.0) + exchange.seconds * layer_bytes[layer] / total
        return sorted(per_layer, key=per_layer.__getitem__, reverse=True)[:count]


def choose(predictions: dict[str, dict[Scheme, float]], comm: str = "auto") -> dict[str, Scheme]:
    """Each layer's scheme from its predictions: ``comm`` forced where the layer can take it, else what the
    planner's mode (``auto``, ``auto-lossy``) picks, without dedicated parameter servers."""
    mode = parse_comm(comm)
    if isinstance(mode, Planned):
        allowed = mode.allowed(servers=False)
        return {name: pick(predicted, allowed) for name, predicted in predictions.items()}
    return {name: mode if mode in predicted else Scheme.ALLREDUCE for name, predicted in predictions.items()}


def simulate(
    profile: StepProfile,
    links: Links,
    workers: int,
    ranks_per_host: int = 1,
    comm: str = "auto",
    bucket_bytes: int = 2 * 1024 * 1024,
    servers: int | None = None,
    cpu_bound: bool = False,
    lossy: LossyOptions | None = None,
) -> StepPrediction:
    """Play one training step at ``workers`` ranks (see the module's description).

    ``cpu_bound``: compute takes every core of the host (CPU workers using all of them), so the part of each
    exchange that keeps a core busy (copies, reductions, the kernel's TCP work: the calibration's ``cpu_share``,
    all of it when not measured) cannot run beside compute and adds to backward; only the rest, waiting on a slow
    wire, can overlap it. On this project's 2-core machine with every core computing, the emulated hosts'
    transformer lost more than its whole 1 Gbit/s wire time to communication, and the one-host MLP three times its
    bare shared-memory time (docs/predict.md).
    """
    mode = parse_comm(comm)
    if takes_outer(mode):
        from shoal.plan.outer_predict import simulate_outer  # it plays the inner step with this function

        weigh = not forces_outer(mode)
        return simulate_outer(simulate, profile, links, workers, ranks_per_host, weigh, bucket_bytes, cpu_bound)
    return _play(profile, links, workers, ranks_per_host, comm, bucket_bytes, servers, cpu_bound, lossy)


def _play(
    profile: StepProfile,
    links: Links,
    workers: int,
    ranks_per_host: int,
    comm: str,
    bucket_bytes: int,
    servers: int | None,
    cpu_bound: bool,
    lossy: LossyOptions | None,
) -> StepPrediction:
    """``simulate`` for the synchronous settings: each layer's exchange played against backward."""
    calibration = links.calibration(workers, ranks_per_host)
    layers = {layer.name: layer for layer in profile.layers}
    estimated = _estimates(profile, CostContext(calibration, workers, servers, lossy or LossyOptions()))
    choices = choose({name: {s: e.seconds for s, e in by_scheme.items()} for name, by_scheme in estimated.items()}, comm)
    exchanges: list[Exchange] = []
    rebuild_s = 0.0
    backward_s = profile.backward_s
    if workers > 1:
        open_buckets: dict[Scheme, tuple[list[str], int]] = {}
        last_ready: dict[str, float] = {}
        for gradient in profile.gradients:
            last_ready[gradient.layer] = max(last_ready.get(gradient.layer, 0.0), gradient.ready_s)
        # SFB layers with a trainable bias spare backward their local weight gradient: what comes after is earlier.
        spared = {
            name: sfb_spared_flops(layer.linear) / calibration.flops_per_s
            for name, layer in layers.items()
            if choices[name].row.rebuilds and layer.spares_local and layer.linear is not None and name in last_ready
        }
        backward_s -= sum(spared.values())

        def ready(at: float) -> float:
            return at - sum(seconds for name, seconds in spared.items() if last_ready[name] <= at)

        sent: set[str] = set()
        for gradient in sorted(profile.gradients, key=lambda g: g.ready_s):
            scheme = choices[gradient.layer]
            if scheme.row.play is not Play.BUCKET:
                if gradient.layer in sent or gradient.ready_s < last_ready[gradient.layer]:
                    continue  # the layer's exchange leaves once all its gradients are final
                sent.add(gradient.layer)
                layer = layers[gradient.layer]
                estimate = estimated[layer.name][scheme]
                seconds = estimate.wire_s
                if scheme.row.play is Play.DIRECT:  # compressing and rebuilding: local work at synchronize
                    rebuild_s += estimate.local_s
                else:  # factors (SFB)
                    assert layer.linear is not None
                    rebuild_s += sfb_rebuild_flops(workers, layer.linear) / calibration.flops_per_s  # at synchronize
                    # The inputs' allgather leaves at forward (as backward starts), the output gradients' when ready.
                    early, seconds = sfb_allgather_seconds(calibration, workers, layer.linear)
                    busy = calibration.cpu_seconds("allgather", early)
                    exchanges.append(Exchange(scheme, (layer.name,), layer.nbytes, 0.0, early, busy))
                busy = calibration.cpu_seconds(scheme.exchange or "allreduce", seconds)
                exchanges.append(Exchange(scheme, (layer.name,), layer.nbytes, ready(gradient.ready_s), seconds, busy))
                continue
            names, size = open_buckets.get(scheme, ([], 0))
            names = [*names, gradient.layer]
            size, full = fill_bucket(size, gradient.nbytes, bucket_bytes)
            if full:
                exchanges.append(_bucket(scheme, names, size, ready(gradient.ready_s), calibration))
                open_buckets.pop(scheme, None)
            else:
                open_buckets[scheme] = (names, size)
        for scheme, (names, size) in open_buckets.items():  # flushed at synchronize, when backward is over
            exchanges.append(_bucket(scheme, names, size, backward_s, calibration))
    free = 0.0
    stolen = 0.0  # CPU-bound: core time the exchanges so far took from backward, which delays what it makes next
    for exchange in sorted(exchanges, key=lambda e: e.submitted_s):
        exchange.start_s = max(exchange.submitted_s + stolen, free)
        free = exchange.end_s
        if cpu_bound:
            stolen += exchange.cpu_s
    comm_s = sum(e.seconds for e in exchanges)
    backward_end = max(backward_s + stolen, free)
    step = profile.forward_s + backward_end + rebuild_s + profile.update_s
    samples = workers * profile.batch / step
    return StepPrediction(
        workers=workers,
        ranks_per_host=ranks_per_host,
        step_s=step,
        compute_s=profile.compute_s,
        exposed_comm_s=step - profile.compute_s,
        comm_s=comm_s,
        samples_per_s=samples,
        efficiency=samples / (workers * profile.batch / profile.compute_s),
        choices=choices,
        exchanges=exchanges,
        calibration=calibration,
    )


def _estimates(profile: StepProfile, ctx: CostContext) -> dict[str, dict[Scheme, Estimate]]:
    """Every layer's estimate per scheme (the table's rows)."""
    return {layer.name: estimates(ctx, layer.shape()) for layer in profile.layers}


def _bucket(scheme: Scheme, names: list[str], nbytes: int, submitted_s: float, calibration: Calibration) -> Exchange:
    seconds = calibration.seconds(scheme.value, nbytes)
    busy = calibration.cpu_seconds(scheme.value, seconds)
    return Exchange(scheme, tuple(dict.fromkeys(names)), nbytes, submitted_s, seconds, busy)
