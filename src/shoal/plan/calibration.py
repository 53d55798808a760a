"""α–β calibration data: a fitted line ``seconds = latency + bytes * per_byte`` per exchange, and its file format.

The probes that measure these lines run collectives, so they live beside the collectives
(``shoal.torch.layer_comm.calibrate``); this module is the data and the arithmetic only.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace


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
    measured_on: tuple[int, int] | None = None
    """(ranks, hosts) of the job that measured it, when known: what ``shoal.predict`` needs to carry the lines to
    other worker counts."""
    cpu_share: dict[str, float] = field(default_factory=dict)
    """By exchange, when measured: the process's CPU seconds (all its threads) per wall second of the probes. Near 1
    where a core works through the whole exchange (shared memory, copies); well under 1 where the exchange mostly
    waits on a slow wire. ``shoal.predict`` uses it on CPU-bound workers: only this share of an exchange takes a core
    from compute, the rest of it can overlap backward."""
    local: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Local work of the compressed schemes per gradient, as lines ``seconds = latency + per_unit * entries``:
    ``powersgd@1`` and ``powersgd@4`` (everything PowerSGD does on one rank for an n×m gradient at rank 1 and 4: the
    residual added, both projections, the orthogonalisation, the new residual and the rebuild, in n·m) and ``topk``
    (the residual added, the selection, the new residual and the scatter, in entries). Missing ones take
    ``DEFAULT_LOCAL``."""

    def local_seconds(self, work: str, units: float) -> float:
        """Predicted seconds of local ``work`` (a ``DEFAULT_LOCAL`` key) for ``units``."""
        latency, per_unit = self.local.get(work, DEFAULT_LOCAL[work])
        return latency + per_unit * units

    def cpu_seconds(self, exchange: str, seconds: float) -> float:
        """How much of an exchange of ``seconds`` keeps a core busy (all of it when the share was not measured)."""
        return seconds * self.cpu_share.get(exchange, 1.0)

    def with_lines(self, lines: dict[str, tuple[float, float]], flops_per_s: float) -> Calibration:
        """The same calibration with other lines and matmul rate. Local work (``local``) is computation too: where
        the matmul rate changes (a refit from training, where the ranks' compute competes with it), its lines scale
        by the same factor; the rest is kept."""
        factor = self.flops_per_s / flops_per_s if flops_per_s > 0 else 1.0
        local = {work: (latency * factor, per_unit * factor) for work, (latency, per_unit) in self.local.items()}
        local.update(
            {
                work: (latency * factor, per_unit * factor)
                for work, (latency, per_unit) in DEFAULT_LOCAL.items()
                if work not in local
            }
        )
        return replace(self, lines=lines, flops_per_s=flops_per_s, local=local if factor != 1.0 else dict(self.local))

    def seconds(self, exchange: str, nbytes: float) -> float:
        """Predicted time of ``exchange`` for ``nbytes``."""
        latency, per_byte = self.lines[exchange]
        return latency + per_byte * nbytes

    @classmethod
    def uniform(cls, latency_s: float, s_per_byte: float, flops_per_s: float) -> Calibration:
        """The same line for every exchange, with half-precision ones moving half the bytes (for tests, what-ifs)."""
        half = (latency_s, s_per_byte / 2)
        return cls(
            {"allreduce": (latency_s, s_per_byte), "fp16": half, "bf16": half, "allgather": (latency_s, s_per_byte)},
            flops_per_s,
        )


DEFAULT_LOCAL = {
    "powersgd@1": (30e-6, 2e-9),
    "powersgd@4": (30e-6, 3e-9),
    "powersgd-factored": (30e-6, 2e-9),
    "topk": (30e-6, 2e-8),
    "codec-pass": (0.0, 1e-9),
}
"""Stand-ins for calibrations that did not measure the compressed schemes' local work (files written before):
about what one core of this project's 2-core CI machine measured with both cores training."""


def fit_line(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
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
    return timed_calls(fn, repeats)[0]


def timed_calls(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """``median_seconds``, plus the total wall and process CPU seconds (every thread) of the timed calls."""
    fn()
    samples = []
    cpu_start = time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), sum(samples), time.process_time() - cpu_start


def calibration_to_json(calibration: Calibration) -> str:
    """Serialise a calibration (for the ``CALIBRATION_FILE`` knob, docs/knobs.md)."""
    lines = {name: list(line) for name, line in calibration.lines.items()}
    links = {name: list(line) for name, line in calibration.links.items()}
    raw: dict[str, object] = {"lines": lines, "flops_per_s": calibration.flops_per_s, "links": links}
    if calibration.cpu_share:
        raw["cpu_share"] = dict(calibration.cpu_share)
    if calibration.local:
        raw["local"] = {name: list(line) for name, line in calibration.local.items()}
    if calibration.measured_on is not None:
        raw["measured_on"] = {"ranks": calibration.measured_on[0], "hosts": calibration.measured_on[1]}
    return json.dumps(raw, indent=1, sort_keys=True)


def calibration_from_json(text: str, origin: str) -> Calibration:
    """Parse what ``calibration_to_json`` wrote; a clear ValueError names ``origin`` otherwise."""
    try:
        raw = json.loads(text)
        lines = {str(name): (float(line[0]), float(line[1])) for name, line in raw["lines"].items()}
        links = {str(name): (float(line[0]), float(line[1])) for name, line in raw.get("links", {}).items()}
        measured_on = raw.get("measured_on")
        if measured_on is not None:
            measured_on = (int(measured_on["ranks"]), int(measured_on["hosts"]))
        cpu_share = {str(name): float(share) for name, share in raw.get("cpu_share", {}).items()}
        local = {str(name): (float(line[0]), float(line[1])) for name, line in raw.get("local", {}).items()}
        result = Calibration(lines, float(raw["flops_per_s"]), links, measured_on, cpu_share, local)
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise ValueError(f"{origin} is not a Shoal calibration file: {error!r}") from None
    missing = {"allreduce", "fp16", "bf16", "allgather"} - set(lines)
    if missing:
        raise ValueError(f"{origin} lacks the exchanges {sorted(missing)}")
    return result
