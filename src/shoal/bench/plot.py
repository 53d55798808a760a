"""Draw benchmark results: ``python -m shoal.bench.plot RESULT.json [...] -o DIR`` (needs matplotlib:
``pip install 'shoal[plot]'``).

Each file is a benchmark's ``--json`` output; one PNG per file, named after it:

- allreduce: bus bandwidth against message size for Shoal's engine, raw torch.distributed and the bare shared-memory
  path, with the same run's single-thread memcpy rate as the ceiling;
- train: images per second of Shoal, DDP, autotuned Shoal when measured, and the no-communication bound (every
  rank training at once with no communication; older results: world × one process alone);
- rendezvous: init() time with torch's open store and Shoal's authenticated one, per world size.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("shoal.bench.plot needs matplotlib: pip install 'shoal[plot]' (or matplotlib)") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _busbw(nbytes: float, ms: float, world: int) -> float:
    return 2 * (world - 1) / world * nbytes / (ms / 1e3) / 1e9 if world > 1 and ms > 0 else 0.0


def plot_allreduce(result: dict[str, Any], axes: Any) -> None:
    rows = result["rows"]
    world = int(result["world"])
    sizes = [row["bytes"] for row in rows]
    axes.plot(sizes, [row["busbw_GBps"] for row in rows], "o-", label="Shoal (engine)")
    axes.plot(sizes, [_busbw(row["bytes"], row["raw_ms"], world) for row in rows], "s--", label="raw torch.distributed")
    if all("hier_busbw_GBps" in row for row in rows):
        axes.plot(sizes, [row["hier_busbw_GBps"] for row in rows], "^:", label="shared-memory path (bare)")
    # Measured on 64 MiB, out of cache: sizes that stay in cache can beat it.
    axes.axhline(result["memcpy_GBps"], color="grey", linestyle="-.", label="memcpy of 64 MiB, one thread (same run)")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(f"allreduce, {world} ranks")
    axes.legend()


def plot_train(result: dict[str, Any], axes: Any) -> None:
    world = int(result["world"])
    bars = [("Shoal", result["shoal_ips"], "tab:blue")]
    if "autotuned_ips" in result:
        bars.append(("Shoal autotuned", result["autotuned_ips"], "tab:cyan"))
    if "ddp_ips" in result:
        bars.append(("DDP", result["ddp_ips"], "tab:orange"))
    if "bound_ips" in result:
        bars.append(("no-communication bound\n(all ranks, no exchange)", result["bound_ips"], "tab:grey"))
    elif "solo_ips" in result:
        bars.append((f"no-communication bound\n({world} × one process)", world * result["solo_ips"], "tab:grey"))
    labels, values, colors = zip(*bars, strict=True)
    axes.bar(labels, values, color=colors)
    for index, value in enumerate(values):
        axes.text(index, value, f"{value:.0f}", ha="center", va="bottom")
    axes.set_ylabel("images per second (all workers)")
    axes.set_title(f"training throughput: {result['model']}, {world} workers, comm={result.get('comm', 'allreduce')}")


def plot_rendezvous(result: dict[str, Any], axes: Any) -> None:
    rows = result["rows"]
    positions = range(len(rows))
    axes.bar([p - 0.2 for p in positions], [r["open_ms"] for r in rows], width=0.4, label="torch TCPStore (open)")
    axes.bar([p + 0.2 for p in positions], [r["auth_ms"] for r in rows], width=0.4, label="Shoal store (authenticated)")
    axes.set_xticks(list(positions), [f"{r['world']} ranks" for r in rows])
    axes.set_ylabel("first init() (ms, slowest rank)")
    axes.set_title("rendezvous time")
    axes.legend()


_PLOTTERS = {"allreduce": plot_allreduce, "train": plot_train, "rendezvous": plot_rendezvous}


def plot_file(path: str, out_dir: str) -> str:
    """Draw one result file; returns the PNG's path."""
    with open(path) as source:
        result = json.load(source)
    plotter = _PLOTTERS.get(result.get("bench"))
    if plotter is None:
        raise SystemExit(f"{path}: no plot for bench {result.get('bench')!r} (known: {', '.join(_PLOTTERS)})")
    plt = _matplotlib()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    plotter(result, axes)
    figure.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + ".png")
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.plot", description="Draw benchmark --json results.")
    parser.add_argument("files", nargs="+", help="result files written by a benchmark's --json PATH")
    parser.add_argument("-o", "--out-dir", default=".", help="directory for the PNGs (default: here)")
    args = parser.parse_args(argv)
    for path in args.files:
        print(plot_file(path, args.out_dir))


if __name__ == "__main__":
    main()
