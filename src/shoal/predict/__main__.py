"""``python -m shoal.predict``: throughput, efficiency, plan and bottleneck at each worker count (docs/predict.md).

Example: ``python -m shoal.predict --model mlp --workers 2,4,8,16 --link 10gbit --plot scaling.png``. The last line
printed is a JSON object: ``{"predict": model, "comm": ..., "rows": [{"workers", "step_ms", "samples_per_s",
"efficiency", "compute_ms", "exposed_comm_ms", "schemes", "best_comm", "best_efficiency", "advice"}, ...]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from shoal.plan.calibration import calibration_from_json
from shoal.plan.simulate import LINK_RATES, Line, Links
from shoal.predict import ALTERNATIVES, Row, scaling
from shoal.predict.output import add_json_flag, emit
from shoal.predict.profile import flop_profile, measure_profile


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers takes comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--workers needs worker counts >= 1, got {text!r}")
    return counts


OPTIMIZER_STATE = {"sgd": 0.0, "momentum": 1.0, "adam": 2.0}
"""``--optimizer``: optimizer state values per parameter element (plain SGD, SGD with momentum, Adam or AdamW)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shoal.predict",
        description="Predict training throughput at N workers from a one-worker profile and a network model.",
    )
    parser.add_argument("--model", required=True, help="cnn, mlp, transformer, or package.module:factory")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    parser.add_argument("--workers", type=_counts, default=[1, 2, 4, 8, 16, 32, 64], help="e.g. 2,4,8,...,256")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each host (default 1)")
    parser.add_argument("--link", choices=sorted(LINK_RATES), help="the link between hosts (a preset)")
    parser.add_argument(
        "--calibration", metavar="FILE", help="a calibration measured on the real cluster (python -m shoal.predict.calibrate)"
    )
    parser.add_argument("--comm", choices=ALTERNATIVES, default="allreduce", help="what the job will use (default allreduce)")
    parser.add_argument("--bucket-bytes", type=int, default=2 * 1024 * 1024, help="DistributedOptimizer's bucket size")
    parser.add_argument(
        "--link-latency-us", type=float, help="override the --link preset's per-message latency (e.g. 5 for RoCE)"
    )
    parser.add_argument("--intra-gbps", type=float, default=5.0, help="shared-memory allreduce GB/s within a host (default 5)")
    parser.add_argument("--intra-latency-us", type=float, default=30.0, help="its latency in µs (default 30)")
    parser.add_argument(
        "--device-flops", type=float, help="sustained FLOP/s of the device to predict for (compute from a FLOP count)"
    )
    parser.add_argument("--device-bandwidth", type=float, default=1.5e12, help="its memory bytes/s (default 1.5e12)")
    parser.add_argument(
        "--concurrent",
        type=int,
        help="processes profiled at once on this machine (default: --ranks-per-host; use the job's ranks that share it)",
    )
    parser.add_argument(
        "--threads", type=int, help="compute threads of each profiled process (default: cores / --ranks-per-host)"
    )
    parser.add_argument(
        "--cpu-bound",
        choices=["auto", "yes", "no"],
        default="auto",
        help="whether compute takes every core, so only an exchange's wait on the wire (the calibration's CPU share; "
        "none without one) overlaps it (auto: yes when profiled here with threads x ranks per host >= cores; no with "
        "--device-flops)",
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_STATE),
        default="adam",
        help="the optimizer, for the memory per rank: its state per parameter (default adam: two values)",
    )
    parser.add_argument("--steps", type=int, default=10, help="profiled steps (default 10)")
    parser.add_argument("--plot", metavar="PNG", help="draw the scaling curve (needs matplotlib)")
    add_json_flag(parser)
    return parser


def _links(args: argparse.Namespace, flops: float, cast: float) -> Links:
    intra = Line(args.intra_latency_us * 1e-6, 1 / (args.intra_gbps * 1e9))
    if args.calibration:
        with open(args.calibration) as handle:
            calibration = calibration_from_json(handle.read(), args.calibration)
        if calibration.measured_on is None:
            raise SystemExit(
                f"{args.calibration} does not say how many ranks and hosts measured it; write it with "
                "python -m shoal.predict.calibrate"
            )
        links = Links.from_calibration(calibration, *calibration.measured_on)
        if args.link:  # a preset replaces the link between hosts only
            links = Links(
                Links.preset(args.link, intra, cast, flops).inter, links.intra, links.cast_per_byte_s, links.flops_per_s
            )
        if args.device_flops:
            links = dataclasses.replace(links, cast_per_byte_s=cast, flops_per_s=flops)
        return links
    if args.link is None and max(args.workers) > args.ranks_per_host:
        raise SystemExit("give --link or --calibration: the worker counts span more than one host")
    links = Links.preset(args.link or "1gbit", intra, cast, flops)
    if args.link_latency_us is not None and links.inter is not None:
        links = dataclasses.replace(links, inter=Line(args.link_latency_us * 1e-6, links.inter.per_byte_s))
    return links


def plot(rows: list[Row], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("--plot needs matplotlib: pip install 'shoal[plot]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [row.prediction.workers for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(workers, [row.prediction.samples_per_s for row in rows], "o-", label="predicted")
    ideal = rows[0].prediction.samples_per_s / rows[0].prediction.workers / rows[0].prediction.efficiency
    left.plot(workers, [ideal * w for w in workers], "--", color="grey", label="linear (no communication)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("workers")
    left.set_ylabel("samples/s")
    left.legend()
    right.plot(workers, [100 * row.prediction.efficiency for row in rows], "o-", label=rows[0].comm)
    right.plot(workers, [100 * row.best_efficiency for row in rows], "s:", label="best comm setting")
    right.set_xscale("log", base=2)
    right.set_ylim(0, 105)
    right.set_xlabel("workers")
    right.set_ylabel("scaling efficiency (%)")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.ranks_per_host < 1:
        raise SystemExit("--ranks-per-host must be >= 1")
    try:
        cpu_bound = args.cpu_bound == "yes"
        if args.device_flops:
            profile = flop_profile(args.model, args.batch_size, args.device_flops, args.device_bandwidth)
            flops, cast = args.device_flops, 3 / args.device_bandwidth
            where = f"{args.device_flops / 1e12:g} TFLOP/s device (FLOP count)"
        else:
            concurrent = args.concurrent or args.ranks_per_host
            threads = args.threads or max(1, (os.cpu_count() or 1) // args.ranks_per_host)
            profile, flops, cast = measure_profile(
                args.model, args.batch_size, args.steps, concurrent=concurrent, threads=threads
            )
            where = f"profiled here, {concurrent} at once, {threads} threads each"
            if args.cpu_bound == "auto":
                cpu_bound = threads * args.ranks_per_host >= (os.cpu_count() or 1)
        if cpu_bound:
            where += "; CPU-bound: only the wait on the wire overlaps compute"
        links = _links(args, flops, cast)
        state = OPTIMIZER_STATE[args.optimizer]
        rows = scaling(profile, links, args.workers, args.ranks_per_host, args.comm, args.bucket_bytes, cpu_bound, state)
    except ValueError as error:
        raise SystemExit(f"shoal.predict: {error}") from None
    network = args.calibration or f"{args.link or 'one host'}"
    print(
        f"{args.model}, batch {args.batch_size} per worker, {args.ranks_per_host} per host, {network}, comm={args.comm}; "
        f"one worker's step: {profile.compute_s * 1e3:.2f} ms ({where})"
    )
    print(f"{'workers':>7} {'step ms':>9} {'samples/s':>11} {'efficiency':>10} {'exposed ms':>10}  schemes / advice")
    for row in rows:
        data = row.as_dict()
        schemes = ", ".join(f"{k} {v}" for k, v in sorted(data["schemes"].items()))  # type: ignore[attr-defined]
        print(
            f"{data['workers']:>7} {data['step_ms']:>9.2f} {data['samples_per_s']:>11.1f} "
            f"{100 * row.prediction.efficiency:>9.0f}% {data['exposed_comm_ms']:>10.2f}  {schemes}; {row.advice()}"
        )
    print(
        f"memory per rank at a step's peak, MB ({args.optimizer}; parameters, gradients, optimizer state and the "
        "exchange's transients, activations not included), by DistributedOptimizer(shard=...):"
    )
    print(f"{'workers':>7} {'None':>9} {'optimizer':>10} {'gradients':>10}")
    for row in rows:
        memory = {option: peak / 1e6 for option, peak in row.memory.items()}
        print(f"{row.prediction.workers:>7} {memory['none']:>9.1f} {memory['optimizer']:>10.1f} {memory['gradients']:>10.1f}")
    if args.plot:
        plot(rows, args.plot, f"{args.model} on {network}, {args.ranks_per_host} per host, comm={args.comm}")
        print(f"wrote {args.plot}", file=sys.stderr)
    emit(
        {
            "predict": args.model,
            "comm": args.comm,
            "batch_size": args.batch_size,
            "ranks_per_host": args.ranks_per_host,
            "network": network,
            "one_worker_ms": round(profile.compute_s * 1e3, 3),
            "rows": [row.as_dict() for row in rows],
        },
        args.json,
    )


if __name__ == "__main__":
    main()
