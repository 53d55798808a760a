"""Reading Shoal timelines (Chrome-trace JSON written under the ``TIMELINE`` knob, docs/knobs.md): merge, summary, plot.

Open a timeline itself in Perfetto (https://ui.perfetto.dev) or chrome://tracing. ``python -m shoal.timeline merge
A.json B.json -o all.json`` puts per-rank files (the ``TIMELINE`` knob set to ``tl-{rank}.json``) on one clock;
``summary FILE...`` condenses one or more files; ``plot FILE -o OUT.png`` draws one rank's rows.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import dataclass
from statistics import median
from typing import Any

from shoal.engine.timeline import COMPUTE_ROW, load_timeline


@dataclass(frozen=True)
class Phase:
    """One closed span of one row on one rank (microseconds on the trace's clock).

    ``tensor`` is the row: a tensor's name, or ``"compute"`` for the optimizer's FORWARD/BACKWARD/SYNCHRONIZE/UPDATE
    spans (``compute`` is True then).
    """

    rank: int
    tensor: str
    name: str
    start_us: float
    end_us: float
    compute: bool = False

    @property
    def ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3

    @property
    def kind(self) -> str:
        """negotiate, transfer (the collective as a whole), wire (its path: SHM_/GLOO_/NCCL_/ADASUM_ALLREDUCE),
        memcpy (fusion buffer copies) or compute."""
        if self.compute:
            return "compute"
        if self.name.startswith("NEGOTIATE"):
            return "negotiate"
        if "MEMCPY" in self.name:
            return "memcpy"
        if self.name.endswith("_ALLREDUCE") and self.name != "ALLREDUCE":
            return "wire"
        return "transfer"


@dataclass(frozen=True)
class Ready:
    """A READY mark: the writing rank saw ``rank``'s request for ``tensor`` in the negotiation cycle at ``ts_us``."""

    tensor: str
    rank: int
    ts_us: float


@dataclass
class Trace:
    """Phases and readiness marks of one or more ranks, on one clock."""

    phases: list[Phase]
    ready: list[Ready]

    @property
    def ranks(self) -> list[int]:
        return sorted({p.rank for p in self.phases})


def _clock_zero(events: list[dict[str, Any]]) -> dict[int, float]:
    """Each rank's ``shoal_clock``: the Unix time (µs) at which its timestamps are zero."""
    return {e["pid"]: e["args"]["unix_us_at_zero"] for e in events if e.get("ph") == "M" and e.get("name") == "shoal_clock"}


def merge_events(paths: list[str]) -> list[dict[str, Any]]:
    """The events of several timeline files on one clock (the earliest rank's zero).

    Raises:
        ValueError: two files hold the same rank, or a file has no clock mark (written before Shoal 0.x marked it)
            while others do.
    """
    per_file = [(path, load_timeline(path)) for path in paths]
    zeros: dict[int, float] = {}
    owner: dict[int, str] = {}
    for path, events in per_file:
        for rank in {e["pid"] for e in events if "pid" in e}:
            if rank in owner:
                raise ValueError(f"rank {rank} appears in both {owner[rank]} and {path}; merge one file per rank")
            owner[rank] = path
        clock = _clock_zero(events)
        missing = {e["pid"] for e in events if "pid" in e} - clock.keys()
        if missing and len(per_file) > 1:
            raise ValueError(f"{path} has no shoal_clock mark for rank(s) {sorted(missing)}; it cannot be aligned")
        zeros.update(clock)
    reference = min(zeros.values(), default=0.0)
    merged: list[dict[str, Any]] = []
    for _, events in per_file:
        for event in events:
            event = dict(event)
            shift = zeros.get(event.get("pid", -1), reference) - reference
            if "ts" in event:
                event["ts"] = event["ts"] + shift
            if event.get("name") == "shoal_clock":
                event["args"] = {"unix_us_at_zero": reference}
            merged.append(event)
    return merged


def write_merged(paths: list[str], out_path: str) -> int:
    """Merge timeline files into one Chrome-trace file; returns the number of events written."""
    events = merge_events(paths)
    with open(out_path, "w") as out:
        out.write("[\n")
        out.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in events))
        out.write("\n]\n")
    return len(events)


def load_trace(paths: str | list[str]) -> Trace:
    """Every span and readiness mark of one or more timeline files (complete or cut short by a killed job)."""
    events = merge_events([paths] if isinstance(paths, str) else list(paths))
    names: dict[tuple[int, int], str] = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[(event["pid"], event["tid"])] = event["args"]["name"]
    open_phases: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    phases: list[Phase] = []
    ready: list[Ready] = []
    for event in events:
        pid, tid, name = event.get("pid", 0), event.get("tid", 0), event.get("name", "")
        row = names.get((pid, tid), f"tid {tid}")
        phase_type = event.get("ph")
        if phase_type == "B":
            open_phases[(pid, tid, name)].append(event["ts"])
        elif phase_type == "E" and open_phases[(pid, tid, name)]:
            phases.append(Phase(pid, row, name, open_phases[(pid, tid, name)].pop(), event["ts"]))
        elif phase_type == "X":
            compute = event.get("cat") == "compute"
            phases.append(Phase(pid, COMPUTE_ROW if compute else row, name, event["ts"], event["ts"] + event["dur"], compute))
        elif phase_type == "i" and event.get("cat") == "ready":
            ready.append(Ready(row, event["args"]["rank"], event["ts"]))
    return Trace(sorted(phases, key=lambda p: p.start_us), ready)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    start, end = interval
    total = 0.0
    for low, high in union[max(0, bisect_left(union, (start, start)) - 1) :]:
        if low >= end:
            break
        total += max(0.0, min(end, high) - max(start, low))
    return total


def hidden_share(trace: Trace) -> dict[int, tuple[float, float]]:
    """Per rank with compute marks: (collective ms in all, the share of it inside BACKWARD spans)."""
    shares = {}
    for rank in trace.ranks:
        backward = _union([(p.start_us, p.end_us) for p in trace.phases if p.rank == rank and p.name == "BACKWARD"])
        if not backward:
            continue
        spans = _union([(p.start_us, p.end_us) for p in trace.phases if p.rank == rank and p.kind == "transfer"])
        total = sum(end - start for start, end in spans)
        if total > 0:
            shares[rank] = (total / 1e3, sum(_overlap(span, backward) for span in spans) / total)
    return shares


def arrivals(trace: Trace) -> dict[str, list[dict[int, float]]]:
    """Per tensor, per exchange: when each rank's request arrived.

    With several ranks' files (merged), that is each rank's NEGOTIATE begin, paired by order; with one rank's file,
    the READY marks of the negotiation (cycle-grained, and only for exchanges not served by the response cache).
    """
    begins: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    ends: dict[str, list[float]] = defaultdict(list)
    for phase in trace.phases:
        if phase.kind == "negotiate":
            begins[phase.tensor][phase.rank].append(phase.start_us)
            if phase.rank == trace.ranks[0]:
                ends[phase.tensor].append(phase.end_us)
    result: dict[str, list[dict[int, float]]] = {}
    for tensor, by_rank in begins.items():
        if len(by_rank) > 1:
            count = min(len(times) for times in by_rank.values())
            result[tensor] = [{rank: times[k] for rank, times in by_rank.items()} for k in range(count)]
    marks: dict[str, list[Ready]] = defaultdict(list)
    for mark in trace.ready:
        marks[mark.tensor].append(mark)
    for tensor, tensor_marks in marks.items():
        if tensor in result or not ends.get(tensor):
            continue
        windows: dict[int, dict[int, float]] = defaultdict(dict)
        for mark in tensor_marks:  # a mark belongs to the first negotiation that ends at or after it
            index = bisect_left(ends[tensor], mark.ts_us)
            if index < len(ends[tensor]):
                windows[index].setdefault(mark.rank, mark.ts_us)
        result[tensor] = [windows[k] for k in sorted(windows) if len(windows[k]) > 1]
    return result


def _last(exchange: dict[int, float]) -> list[int]:
    """The ranks that arrived last; none when every rank arrived at the same time (one negotiation cycle)."""
    latest = max(exchange.values())
    last = [rank for rank, ts in exchange.items() if ts == latest]
    return [] if len(last) == len(exchange) else last


COMPUTE_SPANS = ("FORWARD", "BACKWARD", "SYNCHRONIZE", "UPDATE")
ENGINE_PARTS = (
    ("negotiation", "negotiate"),
    ("collectives", "transfer"),
    ("copies in", "MEMCPY_IN_FUSION_BUFFER"),
    ("reduction", "wire"),
    ("copies out", "MEMCPY_OUT_FUSION_BUFFER"),
)


@dataclass
class StepProfile:
    """Where one rank's optimizer steps spent their time (from the compute row and the engine's spans)."""

    steps: int
    step_ms: float
    """Median from a step's FORWARD start to its UPDATE end."""
    compute_ms: dict[str, float]
    """Median per step of each compute span (FORWARD, BACKWARD, SYNCHRONIZE, UPDATE) and CAST (summed per step)."""
    engine_ms: dict[str, float]
    """Per step, the union of the engine's spans of each part (they overlap compute and each other)."""

    def lines(self, rank: int) -> list[str]:
        compute = ", ".join(f"{name.lower()} {self.compute_ms[name]:.2f}" for name in COMPUTE_SPANS if name in self.compute_ms)
        casts = f", casts {self.compute_ms['CAST']:.2f}" if "CAST" in self.compute_ms else ""
        engine = ", ".join(f"{label} {self.engine_ms[label]:.2f}" for label, _ in ENGINE_PARTS)
        return [
            f"compute on rank {rank}, {self.steps} steps, median ms: {compute}{casts} (step {self.step_ms:.2f})",
            f"engine on rank {rank}, ms per step (unions of spans; they overlap compute): {engine}",
        ]


def step_profile(trace: Trace, rank: int) -> StepProfile | None:
    """The profile of ``rank``'s optimizer steps in ``trace``; None without compute marks."""
    compute = [p for p in trace.phases if p.compute and p.rank == rank]
    forwards = [p for p in compute if p.name == "FORWARD"]
    updates = [p for p in compute if p.name == "UPDATE"]
    if not forwards or not updates:
        return None
    steps = min(len(forwards), len(updates))
    forwards, updates = forwards[-steps:], updates[-steps:]
    step_ms = median((u.end_us - f.start_us) / 1e3 for f, u in zip(forwards, updates, strict=True))
    start, end = forwards[0].start_us, updates[-1].end_us
    compute_ms = {
        name: median(p.ms for p in compute if p.name == name) for name in COMPUTE_SPANS if any(p.name == name for p in compute)
    }
    casts = [p.ms for p in compute if p.name == "CAST" and start <= p.start_us <= end]
    if casts:
        compute_ms["CAST"] = sum(casts) / steps
    engine_ms = {}
    for label, key in ENGINE_PARTS:
        spans = [
            (max(p.start_us, start), min(p.end_us, end))
            for p in trace.phases
            if p.rank == rank and not p.compute and key in (p.kind, p.name) and p.end_us > start and p.start_us < end
        ]
        engine_ms[label] = sum(b - a for a, b in _union(spans)) / 1e3 / steps
    return StepProfile(steps, step_ms, compute_ms, engine_ms)


def summarize(trace: Trace, top: int = 15) -> str:
    """Per tensor: exchanges, median negotiation wait, transfer, wire and copy times, how far apart the ranks
    arrived and which came last; then the ranks that arrive last overall, the compute spans and the share of
    communication hidden under backward."""
    phases = [p for p in trace.phases if not p.compute]
    first_rank = trace.ranks[0] if trace.ranks else 0
    by_tensor: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for phase in phases:
        if phase.rank == first_rank:
            by_tensor[phase.tensor][phase.kind].append(phase.ms)
    arrived = arrivals(trace)
    rows = []
    for tensor, kinds in by_tensor.items():
        exchanges = max(len(kinds.get("negotiate", [])), len(kinds.get("transfer", [])))
        total = sum(sum(values) for kind, values in kinds.items() if kind in ("negotiate", "transfer"))
        rows.append((total, tensor, exchanges, kinds))
    rows.sort(reverse=True)

    def avg(values: list[float] | None) -> str:
        return f"{median(values):9.3f}" if values else "        -"

    ranks_note = f"rank {first_rank}" if len(trace.ranks) <= 1 else f"rank {first_rank} of ranks {trace.ranks}"
    lines = [
        f"{len(by_tensor)} tensors, {len(phases)} phases ({ranks_note}); median ms per exchange, the "
        f"{min(top, len(rows))} with the most time first; spread: how far apart the ranks' requests arrived",
        f"{'tensor':40s} {'exch':>5s} {'negotiate':>9s} {'transfer':>9s} {'wire':>9s} {'memcpy':>9s} "
        f"{'spread':>9s} {'last':>10s}",
    ]
    for _, tensor, exchanges, kinds in rows[:top]:
        seen = arrived.get(tensor, [])
        spread = [(max(e.values()) - min(e.values())) / 1e3 for e in seen]
        counts = Counter(rank for e in seen for rank in _last(e))
        last = f"{counts.most_common(1)[0][0]} ({counts.most_common(1)[0][1] / len(seen):.0%})" if counts else "-"
        lines.append(
            f"{tensor[:40]:40s} {exchanges:5d} {avg(kinds.get('negotiate'))} {avg(kinds.get('transfer'))} "
            f"{avg(kinds.get('wire'))} {avg(kinds.get('memcpy'))} {avg(spread)} {last:>10s}"
        )
    every = [e for seen in arrived.values() for e in seen]
    if every:
        counts = Counter(rank for e in every for rank in _last(e))
        together = sum(1 for e in every if not _last(e))
        ranked = "".join(f"rank {rank} in {count / len(every):.0%}, " for rank, count in counts.most_common())
        lines.append(f"arrived last: {ranked}all together in {together / len(every):.0%} of {len(every)} exchanges")
    profile = step_profile(trace, first_rank)
    if profile is not None:
        lines.extend(profile.lines(first_rank))
    shares = hidden_share(trace)
    if shares:
        lines.append(
            "communication hidden under backward: "
            + ", ".join(f"{share:.0%} of {total:.1f} ms on rank {rank}" for rank, (total, share) in sorted(shares.items()))
        )
    else:
        lines.append("communication hidden under backward: - (no DistributedOptimizer compute marks in this trace)")
    negotiate = sum(p.ms for p in phases if p.kind == "negotiate" and p.rank == first_rank)
    transfer = sum(p.ms for p in phases if p.kind == "transfer" and p.rank == first_rank)
    lines.append(f"total: negotiation (waiting for every rank) {negotiate:.1f} ms, collectives {transfer:.1f} ms")
    return "\n".join(lines)


def plot(trace: Trace, out_path: str, tensors: int = 20, rank: int | None = None, steps: int | None = None) -> str:
    """A PNG of one rank's compute row and first ``tensors`` tensor rows over time; needs matplotlib.

    ``steps`` draws only the last that many optimizer steps (from the FORWARD before them to the last UPDATE).
    """
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("plotting a timeline needs matplotlib: pip install 'shoal[plot]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if rank is None:
        rank = trace.ranks[0] if trace.ranks else 0
    phases = [p for p in trace.phases if p.rank == rank]
    forwards = [p for p in phases if p.name == "FORWARD"]
    if steps and forwards:
        start = forwards[-min(steps, len(forwards))].start_us
        phases = [p for p in phases if p.end_us >= start]
    tensor_rows = [t for t in dict.fromkeys(p.tensor for p in phases if not p.compute)][:tensors]
    order = ([COMPUTE_ROW] if any(p.compute for p in phases) else []) + tensor_rows
    row = {name: index for index, name in enumerate(order)}
    colors: dict[str, Any] = {}
    palette = plt.get_cmap("tab20")
    figure, axes = plt.subplots(figsize=(10, 0.35 * len(order) + 1.5))
    for phase in phases:
        if phase.tensor not in row:
            continue
        color = colors.setdefault(phase.name, palette(len(colors) % 20))
        axes.barh(row[phase.tensor], phase.ms, left=phase.start_us / 1e3, color=color, height=0.8)
    axes.set_yticks(range(len(order)), [t[:30] for t in order], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("ms since the timeline started")
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in colors.items()]
    axes.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.set_title(f"Shoal timeline, rank {rank}: compute spans and phases per tensor")
    figure.tight_layout()
    figure.savefig(out_path, dpi=110)
    plt.close(figure)
    return out_path
