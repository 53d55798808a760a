"""Measuring the job's α–β lines: timed probes through Shoal's own collectives, one round per job.

Each probe runs the exchange the engine really uses (so the shared-memory and hierarchical paths are what gets
measured) at a few sizes, and ``plan.calibration.fit_line`` fits ``t = latency + bytes / bandwidth``. Rank 0's
fit is broadcast so every rank plans with the same numbers. A probe round takes well under a second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from shoal.config import worker_setting
from shoal.core import session as handles
from shoal.core.objects import broadcast_object
from shoal.core.process_sets import ProcessSet, add_process_set, remove_process_set
from shoal.plan.calibration import (
    Calibration,
    calibration_from_json,
    calibration_to_json,
    fit_line,
    median_seconds,
    timed_calls,
)
from shoal.plan.costs import LOW_RANK_PROBED
from shoal.runtime import context
from shoal.torch import functions
from shoal.torch.layer_comm.lossy import factored_probe, low_rank_probe, top_k_probe

_PROBE_BYTES = (4096, 32768, 262144, 2 * 1024 * 1024, 8 * 1024 * 1024, 32 * 1024 * 1024)
"""Message sizes probed, smallest first; large ones leave the caches, as real gradients do. 32 KiB is there for slow
links: at 10 Mbit/s it is already bandwidth-bound, and the first step of local steps spent 2.4 s on the 256 KiB probes
(0.56 s with 32 KiB as the last size probed)."""
_PROBE_BUDGET_S = 0.05
"""Once an allreduce probe takes this long, larger sizes are skipped (slow links are linear well before that); a size
predicted to take over twice this long is not probed at all."""

_PART = "torch.calibration"
"""The process context's part holding this job's calibration: one probe round per ``init()``."""


Probes = dict[str, tuple[Callable[[], object], float]]
"""Per exchange, a probe and the bytes its line is fitted against."""


Lines = dict[str, tuple[float, float]]
"""Per exchange, a fitted (latency, seconds per byte)."""


def _probe_lines(probes_at: Callable[[int, int], Probes], repeats: int, tag: str) -> tuple[Lines, dict[str, float]]:
    """Time each exchange at growing sizes and fit its line; every rank stops at the same size, after the first one
    whose slowest probe passed the budget (collective: every rank calls it with the same exchanges).

    Also returns each exchange's CPU share: this process's CPU seconds over wall seconds, summed over its probes (so
    the large sizes weigh most).
    """
    samples: dict[str, tuple[list[float], list[float]]] = {}
    busy: dict[str, list[float]] = {}
    slowest_by_size: list[float] = []
    for index, nbytes in enumerate(_PROBE_BYTES):
        probes = probes_at(index, nbytes)
        if index >= 2 and _scout_seconds(probes, f"{tag}.scout.{index}") > 2 * _PROBE_BUDGET_S:
            break
        slowest = 0.0
        for exchange, (probe, fitted_bytes) in probes.items():
            elapsed, wall, cpu = timed_calls(probe, repeats)
            slowest = max(slowest, elapsed)
            sizes, seconds = samples.setdefault(exchange, ([], []))
            sizes.append(fitted_bytes)
            seconds.append(elapsed)
            totals = busy.setdefault(exchange, [0.0, 0.0])
            totals[0] += wall
            totals[1] += cpu
        agreed = float(functions.allreduce(torch.tensor([slowest]), op=functions.Max, name=f"{tag}.max.{index}"))
        slowest_by_size.append(agreed)
        following = _PROBE_BYTES[index + 1] if index + 1 < len(_PROBE_BYTES) else None
        if agreed > _PROBE_BUDGET_S or (following is not None and index > 0 and too_slow(slowest_by_size, following)):
            break
    lines = {exchange: fit_line(*points) for exchange, points in samples.items()}
    return lines, {exchange: round(cpu / wall, 3) for exchange, (wall, cpu) in busy.items() if wall > 0}


def _scout_seconds(probes: Probes, name: str) -> float:
    """One call of the first exchange's probe, the slowest rank's seconds (collective). A line through small sizes
    cannot see a rate limit's burst: at 10 Mbit/s 4 and 32 KiB took 5.3 and 16.0 ms, the line predicted 91 ms for
    256 KiB, and each of its probes took 222 ms (2.9 s of planning for the four exchanges' calls, against 0.5 s)."""
    probe, _ = next(iter(probes.values()))
    started = time.perf_counter()
    probe()
    mine = torch.tensor([time.perf_counter() - started])
    return float(functions.allreduce(mine, op=functions.Max, name=name))


def too_slow(slowest: list[float], following: int) -> bool:
    """Whether the next probe size, ``following`` bytes, is predicted to take over twice the budget, from the line
    fitted to the slowest times of the sizes probed so far (``slowest[i]`` for ``_PROBE_BYTES[i]``): on a 100 Mbit/s
    link the 2 MiB probes alone took 2.5 s of the first step, and 256 KiB is already bandwidth-bound there.

    A line, not the last time scaled by the bytes: a time that latency dominates does not grow with them. Scaled, a
    32 KiB probe on loopback that took 13 ms (a cycle's round trip to the other host, on a loaded machine) stopped
    the probing there, and a line through two latency-bound points gave loopback 0.00 GB/s, slower than the 1 Gbit/s
    link beside it. Where the line lets a size through, one call of it scouts first (``_scout_seconds``)."""
    latency, per_byte = fit_line([float(size) for size in _PROBE_BYTES[: len(slowest)]], slowest)
    return latency + per_byte * following > 2 * _PROBE_BUDGET_S


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

    lines, cpu_share = _probe_lines(probes_at, repeats, "shoal.cal")
    left, right = torch.randn(256, 256), torch.randn(256, 256)
    matmul_s = median_seconds(lambda: left @ right, repeats)
    topology = context.current().topology
    hosts = len(set(topology.host_of_rank))
    flops = 2 * 256**3 / max(matmul_s, 1e-9)
    local = Calibration(lines, flops, _measure_links(repeats), (topology.size, hosts), cpu_share, measure_local_work(repeats))
    result: Calibration = broadcast_object(local, root_rank=0, name="shoal.cal.result")
    return result


def measure_local_work(repeats: int = 3) -> dict[str, tuple[float, float]]:
    """The compressed schemes' local work on this rank, as lines (``Calibration.local``), timed on their own kernels
    (``lossy.low_rank_probe`` at ranks 1 and 4, ``lossy.factored_probe`` with 32 rows at rank 4,
    ``lossy.top_k_probe`` at 1%) while every rank probes at once, as every
    rank trains at once."""
    shapes = ((64, 64), (512, 512), (1024, 4096))  # the largest leaves the caches, as real gradients do
    entries = [float(rows * columns) for rows, columns in shapes]
    lines = {}
    for rank in LOW_RANK_PROBED:  # rank 1's products are matrix-vector ones, a path of their own
        seconds = [median_seconds(low_rank_probe(rows, columns, rank), repeats) for rows, columns in shapes]
        lines[f"powersgd@{rank}"] = fit_line(entries, seconds)
    seconds = [median_seconds(factored_probe(rows, columns), repeats) for rows, columns in shapes]
    lines["powersgd-factored"] = fit_line(entries, seconds)
    elements = (4096, 65536, 1024 * 1024)
    lines["topk"] = fit_line([float(count) for count in elements], [median_seconds(top_k_probe(n), repeats) for n in elements])
    return lines


def _measure_links(repeats: int) -> dict[str, tuple[float, float]]:
    """Fit an allreduce line per link class when the topology has both (collective: every rank calls it)."""
    topology = context.current().topology
    if topology.local_size == 1 or topology.cross_size == 1 or not topology.is_homogeneous:
        return {}
    hosts = list(dict.fromkeys(topology.host_of_rank))
    local_sets = [[r for r in range(topology.size) if topology.host_of_rank[r] == host] for host in hosts]
    cross_sets = [
        [r for r in range(topology.size) if topology.local_rank_of_rank[r] == index] for index in range(topology.local_size)
    ]
    registered = [add_process_set(ranks) for ranks in local_sets + cross_sets]  # every rank, in the same order
    mine = {
        "intra-host": registered[hosts.index(topology.host_of_rank[topology.rank])],
        "inter-host": registered[len(local_sets) + topology.local_rank],
    }
    links = {}
    try:
        for link, process_set in mine.items():

            def probes_at(index: int, nbytes: int, link: str = link, process_set: ProcessSet = process_set) -> Probes:
                tensor = torch.ones(nbytes // 4)
                name = f"shoal.cal.{link}.{index}"
                return {
                    link: (lambda: functions.allreduce_(tensor, op=functions.Sum, name=name, process_set=process_set), nbytes)
                }

            links.update(_probe_lines(probes_at, repeats, f"shoal.cal.{link}")[0])
    finally:
        for process_set in registered:
            remove_process_set(process_set)
    return links


def _cast_allreduce(tensor: torch.Tensor, wire: torch.dtype, name: str) -> None:
    sent = tensor.to(wire)
    functions.allreduce_(sent, op=functions.Sum, name=name)
    tensor.copy_(sent)


def job_calibration() -> Calibration:
    """The job's calibration: from the ``CALIBRATION_FILE`` knob's file when it exists, else measured once per job.

    With a file path that does not exist yet, rank 0 writes the measured calibration there, so later jobs on the
    same network can skip the probes (or a user can edit it to override the measurement). Collective: every rank
    must call it.
    """
    ctx = context.current()
    cached: Calibration | None = ctx.part(_PART)
    if cached is not None:
        return cached
    path = worker_setting("calibration_file")
    if path:
        loaded = None
        if ctx.topology.rank == 0 and os.path.exists(path):
            with open(path) as handle:
                loaded = calibration_from_json(handle.read(), path)
        result: Calibration | None = broadcast_object(loaded, root_rank=0, name="shoal.cal.file")
        if result is not None:
            ctx.set_part(_PART, result)
            return result
    measured = measure()
    keep_calibration(measured)
    return measured


def keep_calibration(calibration: Calibration) -> None:
    """Make ``calibration`` the job's (and rank 0 writes it to the ``CALIBRATION_FILE`` knob's file when that is set)."""
    ctx = context.current()
    ctx.set_part(_PART, calibration)
    path = worker_setting("calibration_file")
    if path and ctx.topology.rank == 0:
        with open(path, "w") as handle:
            handle.write(calibration_to_json(calibration))
