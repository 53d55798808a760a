"""Does ``comm="auto"`` pick well? Train on emulated hosts with every forced scheme and with auto, round by round.

Run (as root, iproute2): ``python -m shoal.bench.planner --hosts 2 --rate 1gbit --model mlp --runs 5``. Each run
trains the model on ``--hosts`` network namespaces joined by ``--rate`` links (``shoal.bench.netns``) once per
forced scheme (allreduce, fp16, bf16, sfb) and once with ``comm="auto"``, in that order, so auto is compared with
the forced schemes of the same run. A run passes when auto reaches ``--tolerance`` (default 0.95) of the best
forced scheme's throughput; each invocation keeps the best of ``--rounds`` phases, which damps the machine's
run-to-run noise. Prints a table and, last, one JSON line: ``{"bench": "planner", "runs": [{"forced":
{scheme: ips}, "auto_ips", "best", "of_best", "choices"}], "passed": k, "of_runs": n}``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shoal.bench import add_json_flag, add_phase_flags, emit, rank0_result
from shoal.plan.schemes import Scheme

FORCED = (Scheme.ALLREDUCE, Scheme.FP16, Scheme.BF16, Scheme.SFB)


def train_once(args: argparse.Namespace, comm: str) -> dict[str, Any]:
    """One ``shoal.bench.train`` invocation across the emulated hosts; its JSON result."""
    command = [
        sys.executable,
        "-m",
        "shoal.bench.netns",
        "--hosts",
        str(args.hosts),
        "--rate",
        args.rate,
        "--",
        sys.executable,
        "-m",
        "shoal.bench.train",
        "--model",
        args.model,
        "--comm",
        comm,
        "--compare",
        "none",
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    return rank0_result(command, args.timeout, f"shoal.bench.planner: comm={comm}")


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run the rounds, print the table and the JSON line."""
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.planner", description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts, one rank each (default 2)")
    parser.add_argument("--rate", default="1gbit", help="link rate, tc syntax (default 1gbit)")
    parser.add_argument("--model", choices=["cnn", "mlp", "transformer"], default="mlp")
    parser.add_argument("--runs", type=int, default=5, help="rounds of (every forced scheme, then auto); default 5")
    parser.add_argument("--tolerance", type=float, default=0.95, help="auto must reach this share of the best")
    parser.add_argument(
        "--schemes",
        default=",".join(s.value for s in FORCED),
        help="the forced schemes to compare auto with, comma-separated (default: all of them)",
    )
    add_phase_flags(parser)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    known = [s.value for s in FORCED]
    schemes = [name.strip() for name in args.schemes.split(",") if name.strip()]
    if not schemes or any(name not in known for name in schemes):
        parser.error(f"--schemes takes some of {', '.join(known)}, got {args.schemes!r}")
    runs = []
    for run in range(args.runs):
        forced = {name: float(train_once(args, name)["shoal_ips"]) for name in schemes}
        auto = train_once(args, "auto")
        best = max(forced, key=forced.__getitem__)
        of_best = float(auto["shoal_ips"]) / forced[best]
        runs.append(
            {
                "forced": forced,
                "auto_ips": auto["shoal_ips"],
                "best": best,
                "of_best": round(of_best, 3),
                "choices": auto.get("plan_choices", {}),
                "refits": auto.get("plan_refits", 0),
            }
        )
        cells = ", ".join(f"{scheme} {ips:.1f}" for scheme, ips in forced.items())
        print(
            f"run {run + 1}/{args.runs}: {cells}; auto {auto['shoal_ips']:.1f} img/s = {of_best:.1%} of {best} "
            f"(chose {auto.get('plan_choices', {})}, {auto.get('plan_refits', 0)} refits)",
            flush=True,
        )
    passed = sum(1 for r in runs if r["of_best"] >= args.tolerance)
    print(f"auto within {1 - args.tolerance:.0%} of the best forced scheme in {passed} of {len(runs)} runs")
    emit(
        {
            "bench": "planner",
            "model": args.model,
            "hosts": args.hosts,
            "rate": args.rate,
            "runs": runs,
            "passed": passed,
            "of_runs": len(runs),
            "tolerance": args.tolerance,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
