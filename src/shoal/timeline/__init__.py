"""Reading Shoal timelines (Chrome-trace JSON written by ``SHOAL_TIMELINE``): phases per tensor, a summary, a plot.

Open a timeline itself in Perfetto (https://ui.perfetto.dev) or chrome://tracing; ``python -m shoal.timeline
summary FILE`` and ``python -m shoal.timeline plot FILE -o OUT.png`` condense it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import median
from typing import Any

from shoal.engine.timeline import load_timeline


@dataclass(frozen=True)
class Phase:
    """One closed phase of one tensor on one rank (microseconds from the rank's timeline start)."""

    rank: int
    tensor: str
    name: str
    start_us: float
    end_us: float

    @property
    def ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3


def load_phases(path: str) -> list[Phase]:
    """Every begin/end pair of a timeline file (complete or cut short by a killed job), in start order."""
    events = load_timeline(path)
    names: dict[tuple[int, int], str] = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[(event["pid"], event["tid"])] = event["args"]["name"]
    open_phases: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    phases = []
    for event in events:
        key = (event.get("pid", 0), event.get("tid", 0), event.get("name", ""))
        if event.get("ph") == "B":
            open_phases[key].append(event["ts"])
        elif event.get("ph") == "E" and open_phases[key]:
            start = open_phases[key].pop()
            tensor = names.get((key[0], key[1]), f"tid {key[1]}")
            phases.append(Phase(key[0], tensor, key[2], start, event["ts"]))
    return sorted(phases, key=lambda p: p.start_us)


def summarize(phases: list[Phase], top: int = 15) -> str:
    """Per tensor: how often it was exchanged, median negotiation wait and transfer (the first exchange waits for
    every rank's start-up), the most time first."""
    by_tensor: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for phase in phases:
        kind = "negotiate" if phase.name.startswith("NEGOTIATE") else "memcpy" if "MEMCPY" in phase.name else "transfer"
        if kind == "transfer" and phase.name.endswith("_ALLREDUCE") and phase.name != "ALLREDUCE":
            kind = "wire"  # the path inside an allreduce (SHM_/GLOO_/NCCL_ALLREDUCE)
        by_tensor[phase.tensor][kind].append(phase.ms)
    rows = []
    for tensor, kinds in by_tensor.items():
        exchanges = max(len(kinds.get("negotiate", [])), len(kinds.get("transfer", [])))
        total = sum(sum(values) for kind, values in kinds.items() if kind in ("negotiate", "transfer"))
        rows.append((total, tensor, exchanges, kinds))
    rows.sort(reverse=True)

    def avg(values: list[float] | None) -> str:
        return f"{median(values):9.3f}" if values else "        -"

    lines = [f"{len(by_tensor)} tensors, {len(phases)} phases; median ms per exchange, the {min(top, len(rows))} "
             "with the most time first:",
             f"{'tensor':40s} {'exch':>5s} {'negotiate':>9s} {'transfer':>9s} {'wire':>9s} {'memcpy':>9s}"]  # fmt: skip
    for _, tensor, exchanges, kinds in rows[:top]:
        lines.append(f"{tensor[:40]:40s} {exchanges:5d} {avg(kinds.get('negotiate'))} {avg(kinds.get('transfer'))} "
                     f"{avg(kinds.get('wire'))} {avg(kinds.get('memcpy'))}")  # fmt: skip
    negotiate = sum(p.ms for p in phases if p.name.startswith("NEGOTIATE"))
    transfer = sum(p.ms for p in phases if not p.name.startswith("NEGOTIATE") and "MEMCPY" not in p.name
                   and not (p.name.endswith("_ALLREDUCE") and p.name != "ALLREDUCE"))  # fmt: skip
    lines.append(f"total: negotiation (waiting for every rank) {negotiate:.1f} ms, collectives {transfer:.1f} ms")
    return "\n".join(lines)


def plot(phases: list[Phase], out_path: str, tensors: int = 20) -> str:
    """A PNG of the first ``tensors`` tensors' phases over time (one row each); needs matplotlib."""
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("plotting a timeline needs matplotlib: pip install 'shoal[plot]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = list(dict.fromkeys(p.tensor for p in phases))[:tensors]
    row = {tensor: index for index, tensor in enumerate(order)}
    colors: dict[str, Any] = {}
    palette = plt.get_cmap("tab10")
    figure, axes = plt.subplots(figsize=(10, 0.35 * len(order) + 1.5))
    for phase in phases:
        if phase.tensor not in row:
            continue
        color = colors.setdefault(phase.name, palette(len(colors) % 10))
        axes.barh(row[phase.tensor], phase.ms, left=phase.start_us / 1e3, color=color, height=0.8)
    axes.set_yticks(range(len(order)), [t[:30] for t in order], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("ms since the timeline started")
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in colors.items()]
    axes.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.set_title("Shoal timeline: phases per tensor")
    figure.tight_layout()
    figure.savefig(out_path, dpi=110)
    plt.close(figure)
    return out_path
