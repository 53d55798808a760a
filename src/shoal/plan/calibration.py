"""α–β calibration: fit the cost of the collectives the engine actually uses, on the real process group.

Each probe is timed through Shoal's own collectives (so the shared-memory and hierarchical paths are what gets
measured), at a few sizes, and a line ``t = latency + bytes / bandwidth`` is fitted by least squares. Rank 0's fit
is broadcast so every rank plans with the same numbers. A probe round takes well under a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shoal.torch import functions, handles
from shoal.torch.objects import broadcast_object

_PROBE_BYTES = (4096, 262144, 2 * 1024 * 1024)


@dataclass(frozen=True)
class Calibration:
    """Fitted costs, in seconds. ``*_latency_s`` is α-like; ``*_s_per_byte`` is β-like (per byte of the message)."""

    allreduce_latency_s: float
    allreduce_s_per_byte: float
    """Per byte of the tensor being allreduced (the ring's 2(P-1)/P factor is folded in by the fit)."""
    allgather_latency_s: float
    allgather_s_per_byte: float
    """Per byte of the gathered output (all ranks' pieces together)."""
    copy_s_per_byte: float
    """A local memory pass (a dtype cast or a copy), per byte written."""
    flops_per_s: float
    """Sustained float32 matrix-multiply rate of one rank."""

    def allreduce_s(self, nbytes: float) -> float:
        """Predicted time to allreduce ``nbytes``."""
        return self.allreduce_latency_s + self.allreduce_s_per_byte * nbytes

    def allgather_s(self, output_bytes: float) -> float:
        """Predicted time to allgather pieces totalling ``output_bytes``."""
        return self.allgather_latency_s + self.allgather_s_per_byte * output_bytes


def _fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares line through (size, seconds), clamped to non-negative coefficients."""
    count = len(sizes)
    mean_x, mean_y = sum(sizes) / count, sum(seconds) / count
    var = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / var if var else 0.0
    slope = max(slope, 0.0)
    return max(mean_y - slope * mean_x, 0.0), slope


def _median_time(fn: object, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]


def measure(repeats: int = 5) -> Calibration:
    """Probe this job's collectives, local copies and matmul speed; every rank must call it (collective)."""
    sizes, allreduce_times, gather_sizes, gather_times = [], [], [], []
    size = handles.engine().size
    for index, nbytes in enumerate(_PROBE_BYTES):
        tensor = torch.ones(nbytes // 4)
        functions.allreduce_(tensor, op=functions.Sum, name=f"shoal.calibrate.ar.{index}")  # warm-up, caches it
        elapsed = _median_time(
            lambda t=tensor, i=index: functions.allreduce_(t, op=functions.Sum, name=f"shoal.calibrate.ar.{i}"), repeats
        )
        sizes.append(float(nbytes))
        allreduce_times.append(elapsed)
        piece = torch.ones(max(nbytes // 4 // size, 1))
        functions.allgather(piece, name=f"shoal.calibrate.ag.{index}")
        elapsed = _median_time(lambda p=piece, i=index: functions.allgather(p, name=f"shoal.calibrate.ag.{i}"), repeats)
        gather_sizes.append(float(piece.numel() * 4 * size))
        gather_times.append(elapsed)
    source = torch.ones(4 * 1024 * 1024 // 4)
    copy_s = _median_time(lambda: source.to(torch.float16), repeats) / source.numel() / 2
    left, right = torch.randn(256, 256), torch.randn(256, 256)
    matmul_s = _median_time(lambda: left @ right, repeats)
    alpha_ar, beta_ar = _fit(sizes, allreduce_times)
    alpha_ag, beta_ag = _fit(gather_sizes, gather_times)
    local = Calibration(alpha_ar, beta_ar, alpha_ag, beta_ag, copy_s, 2 * 256**3 / max(matmul_s, 1e-9))
    agreed: Calibration = broadcast_object(local, root_rank=0, name="shoal.calibrate.result")
    return agreed
