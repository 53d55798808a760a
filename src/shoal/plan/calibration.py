"""α–β calibration: fit the cost of the collectives the engine actually uses, on the real process group.

Each probe is timed through Shoal's own collectives (so the shared-memory and hierarchical paths are what gets
measured), at a few sizes, and a line ``t = latency + bytes / bandwidth`` is fitted by least squares. Rank 0's fit
is broadcast so every rank plans with the same numbers. A probe round takes well under a second.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.config import env_str
from shoal.torch import functions, handles
from shoal.torch.objects import broadcast_object
from shoal.torch.process_sets import ProcessSet

_PROBE_BYTES = (4096, 262144, 2 * 1024 * 1024, 8 * 1024 * 1024, 32 * 1024 * 1024)
"""Message sizes probed, smallest first; large ones leave the caches, as real gradients do."""
_PROBE_BUDGET_S = 0.05
"""Once an allreduce probe takes this long, larger sizes are skipped (slow links are linear well before that)."""


@dataclass(frozen=True)
class Calibration:
    """Fitted lines ``seconds = latency + bytes * per_byte`` for each exchange, plus the local matmul rate."""

    lines: dict[str, tuple[float, float]]
    """By exchange: ``allreduce``, ``fp16`` and ``bf16`` (cast, allreduce of half the bytes, cast back; bytes are
    the fp32 gradient's) and ``allgather`` (bytes of the gathered output)."""
    flops_per_s: float
    """Sustained float32 matrix-multiply rate of one rank."""
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per link class, when the job has both: ``intra-host`` (allreduce among one host's ranks) and ``inter-host``
    (allreduce among one rank per host), over gloo; (latency, seconds per byte). Empty on a single host or with one
    rank per host, where the end-to-end lines above already are the only link class."""

    def seconds(self, exchange: str, nbytes: float) -> float:
        """Predicted time of ``exchange`` for ``nbytes``."""
        latency, per_byte = self.lines[exchange]
        return latency + per_byte * nbytes

    @classmethod
    def uniform(cls, latency_s: float, s_per_byte: float, flops_per_s: float) -> Calibration:
        """The same line for every exchange, with half-precision ones moving half the bytes (for tests, what-ifs)."""
        half = (latency_s, s_per_byte / 2)
        return cls({"allreduce": (latency_s, s_per_byte), "fp16": half, "bf16": half,
                    "allgather": (latency_s, s_per_byte)}, flops_per_s)  # fmt: skip


def _fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """α from the smallest probe (latency-bound), β by least squares of the rest through (0, α).

    A plain least-squares line over sizes spanning four orders of magnitude leaves the intercept to the largest
    probes' noise; pinning it to the smallest message is the usual α–β practice.
    """
    smallest = min(range(len(sizes)), key=sizes.__getitem__)
    latency = seconds[smallest]
    pairs = [(x, y - latency) for i, (x, y) in enumerate(zip(sizes, seconds, strict=True)) if i != smallest]
    denominator = sum(x * x for x, _ in pairs)
    per_byte = sum(x * y for x, y in pairs) / denominator if denominator else 0.0
    return latency, max(per_byte, 0.0)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, after one untimed warm-up call (and response cache fill)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


Probes = dict[str, tuple[Callable[[], object], float]]
"""Per exchange, a probe and the bytes its line is fitted against."""


def _probe_lines(probes_at: Callable[[int, int], Probes], repeats: int, tag: str) -> dict[str, tuple[float, float]]:
    """Time each exchange at growing sizes and fit its line; every rank stops at the same size, after the first one
    whose slowest probe passed the budget (collective: every rank calls it with the same exchanges)."""
    samples: dict[str, tuple[list[float], list[float]]] = {}
    for index, nbytes in enumerate(_PROBE_BYTES):
        slowest = 0.0
        for exchange, (probe, fitted_bytes) in probes_at(index, nbytes).items():
            elapsed = median_seconds(probe, repeats)
            slowest = max(slowest, elapsed)
            sizes, seconds = samples.setdefault(exchange, ([], []))
            sizes.append(fitted_bytes)
            seconds.append(elapsed)
        agreed = functions.allreduce(torch.tensor([slowest]), op=functions.Max, name=f"{tag}.max.{index}")
        if float(agreed) > _PROBE_BUDGET_S:
            break
    return {exchange: _fit(*points) for exchange, points in samples.items()}


def measure(repeats: int = 3) -> Calibration:
    """Probe this job's exchanges and matmul speed; every rank must call it (collective)."""
    size = handles.engine().size

    def probes_at(index: int, nbytes: int) -> Probes:
        tensor = torch.ones(nbytes // 4)
        piece = torch.ones(max(nbytes // 4 // size, 1))
        return {
            "allreduce": (lambda: functions.allreduce_(tensor, op=functions.Sum, name=f"shoal.cal.ar.{index}"), nbytes),
            "fp16": (lambda: _cast_allreduce(tensor, torch.float16, f"shoal.cal.fp16.{index}"), nbytes),
            "bf16": (lambda: _cast_allreduce(tensor, torch.bfloat16, f"shoal.cal.bf16.{index}"), nbytes),
            "allgather": (lambda: functions.allgather(piece, name=f"shoal.cal.ag.{index}"), piece.numel() * 4 * size),
        }

    lines = _probe_lines(probes_at, repeats, "shoal.cal")
    left, right = torch.randn(256, 256), torch.randn(256, 256)
    matmul_s = median_seconds(lambda: left @ right, repeats)
    local = Calibration(lines, 2 * 256**3 / max(matmul_s, 1e-9), _measure_links(repeats))
    result: Calibration = broadcast_object(local, root_rank=0, name="shoal.cal.result")
    return result


def _measure_links(repeats: int) -> dict[str, tuple[float, float]]:
    """Fit an allreduce line per link class when the topology has both (collective: every rank calls it)."""
    from shoal.runtime import context
    from shoal.torch.process_sets import add_process_set, remove_process_set

    topology = context.current().topology
    if topology.local_size == 1 or topology.cross_size == 1 or not topology.is_homogeneous:
        return {}
    hosts = list(dict.fromkeys(topology.host_of_rank))
    local_sets = [[r for r in range(topology.size) if topology.host_of_rank[r] == host] for host in hosts]
    cross_sets = [[r for r in range(topology.size) if topology.local_rank_of_rank[r] == index]
                  for index in range(topology.local_size)]  # fmt: skip
    registered = [add_process_set(ranks) for ranks in local_sets + cross_sets]  # every rank, in the same order
    mine = {"intra-host": registered[hosts.index(topology.host_of_rank[topology.rank])],
            "inter-host": registered[len(local_sets) + topology.local_rank]}  # fmt: skip
    links = {}
    try:
        for link, process_set in mine.items():

            def probes_at(index: int, nbytes: int, link: str = link, process_set: ProcessSet = process_set) -> Probes:
                tensor = torch.ones(nbytes // 4)
                name = f"shoal.cal.{link}.{index}"
                return {link: (lambda: functions.allreduce_(tensor, op=functions.Sum, name=name,
                                                            process_set=process_set), nbytes)}  # fmt: skip

            links.update(_probe_lines(probes_at, repeats, f"shoal.cal.{link}"))
    finally:
        for process_set in registered:
            remove_process_set(process_set)
    return links


def _cast_allreduce(tensor: torch.Tensor, wire: torch.dtype, name: str) -> None:
    sent = tensor.to(wire)
    functions.allreduce_(sent, op=functions.Sum, name=name)
    tensor.copy_(sent)


_cache: dict[tuple[int, int], Calibration] = {}
"""Calibrations measured in this process, by (init generation, world size): one probe round per job."""


def calibration_to_json(calibration: Calibration) -> str:
    """Serialise a calibration (for ``SHOAL_CALIBRATION_FILE``)."""
    lines = {name: list(line) for name, line in calibration.lines.items()}
    links = {name: list(line) for name, line in calibration.links.items()}
    return json.dumps({"lines": lines, "flops_per_s": calibration.flops_per_s, "links": links}, indent=1, sort_keys=True)


def calibration_from_json(text: str, origin: str) -> Calibration:
    """Parse what ``calibration_to_json`` wrote; a clear ValueError names ``origin`` otherwise."""
    try:
        raw = json.loads(text)
        lines = {str(name): (float(line[0]), float(line[1])) for name, line in raw["lines"].items()}
        links = {str(name): (float(line[0]), float(line[1])) for name, line in raw.get("links", {}).items()}
        result = Calibration(lines, float(raw["flops_per_s"]), links)
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise ValueError(f"{origin} is not a Shoal calibration file: {error!r}") from None
    missing = {"allreduce", "fp16", "bf16", "allgather"} - set(lines)
    if missing:
        raise ValueError(f"{origin} lacks the exchanges {sorted(missing)}")
    return result


def job_calibration() -> Calibration:
    """The job's calibration: from ``SHOAL_CALIBRATION_FILE`` when that file exists, else measured once per job.

    With a file path that does not exist yet, rank 0 writes the measured calibration there, so later jobs on the
    same network can skip the probes (or a user can edit it to override the measurement). Collective: every rank
    must call it.
    """
    from shoal.runtime import context

    ctx = context.current()
    key = (ctx.generation, ctx.topology.size)
    if key in _cache:
        return _cache[key]
    path = env_str("CALIBRATION_FILE")
    if path:
        loaded = None
        if ctx.topology.rank == 0 and os.path.exists(path):
            with open(path) as handle:
                loaded = calibration_from_json(handle.read(), path)
        result: Calibration | None = broadcast_object(loaded, root_rank=0, name="shoal.cal.file")
        if result is not None:
            _cache[key] = result
            return result
    measured = measure()
    keep_calibration(measured)
    return measured


def keep_calibration(calibration: Calibration) -> None:
    """Make ``calibration`` the job's (and rank 0 writes it to ``SHOAL_CALIBRATION_FILE`` when that is set)."""
    from shoal.runtime import context

    ctx = context.current()
    _cache[(ctx.generation, ctx.topology.size)] = calibration
    path = env_str("CALIBRATION_FILE")
    if path and ctx.topology.rank == 0:
        with open(path, "w") as handle:
            handle.write(calibration_to_json(calibration))
