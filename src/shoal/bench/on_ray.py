"""Shoal on Ray against shoalrun, same workers, one invocation: start-up time and training throughput.

``python -m shoal.bench.on_ray --workers 2 --model mlp`` starts a local Ray cluster (or joins ``--address``), then
runs the same training function (the benchmark model under ``DistributedOptimizer``, ``--rounds`` timed rounds,
the best kept) under ``shoalrun -np N`` and under ``shoal.ray.RayExecutor(num_workers=N)``. Start-up is the wall
time from asking for the job (launching shoalrun; ``executor.start()``) until every rank has finished
``hvd.init()``; starting the Ray cluster itself is reported apart (``ray_cluster_start_s``). The last line is JSON:
``{"bench": "on_ray", "shoalrun_ips", "ray_ips", "ratio", "shoalrun_start_s", "ray_start_s", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

SHOALRUN = [sys.executable, "-m", "shoal.runner"]


def train(model: str, batch_size: int, steps: int, warmup: int, rounds: int, asked_at: float) -> dict[str, float]:
    """On every rank: join the job, then the best of ``rounds`` timed training rounds (images/s over all ranks)."""
    import torch

    import shoal.torch as hvd
    from shoal.bench.train import _batches, run_shoal

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hvd.init()
    hvd.barrier()
    ready = hvd.allreduce(torch.tensor([time.time()], dtype=torch.float64), op=hvd.Max, name="bench.on_ray.ready").item()
    settings = argparse.Namespace(
        model=model, batch_size=batch_size, steps=steps, warmup=warmup, comm="allreduce", set_to_none=True
    )
    batches = _batches(model, batch_size, 8)
    best = max(run_shoal(settings, batches) for _ in range(rounds))
    return {"ips": best, "start_s": ready - asked_at, "world": float(hvd.size())}


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the training both launchers run (``on_ray`` and ``on_spark`` share them)."""
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", choices=["cnn", "mlp", "transformer"], default="mlp")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each round (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per launcher; the best is kept (default 2)")


def training_args(args: argparse.Namespace, asked_at: float) -> tuple[Any, ...]:
    """``train``'s arguments from the parsed flags."""
    return (args.model, args.batch_size, args.steps, args.warmup, args.rounds, asked_at)


def shoalrun_phase(args: argparse.Namespace) -> dict[str, Any]:
    """The same training under ``shoalrun -np N``: rank 0's ``{"ips", "start_s", "world"}``."""
    from shoal.bench import rank0_result

    flags = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    flags += ["--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    asked_at = time.time()
    command = [*SHOALRUN, "-np", str(args.workers), sys.executable, "-m", "shoal.bench.on_ray", "--worker", *flags]
    return rank0_result([*command, "--asked-at", repr(asked_at)], timeout=600, what="the shoalrun phase")


def compared(name: str, args: argparse.Namespace, shoalrun: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The JSON result's common fields: ``{name}_ips``, ``ratio`` (other ÷ shoalrun) and both start-up times."""
    return {
        "bench": f"on_{name}",
        "model": args.model,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "shoalrun_ips": round(shoalrun["ips"], 1),
        f"{name}_ips": round(other["ips"], 1),
        "ratio": round(other["ips"] / shoalrun["ips"], 3),
        "shoalrun_start_s": round(shoalrun["start_s"], 2),
        f"{name}_start_s": round(other["start_s"], 2),
    }


def _worker_main(args: argparse.Namespace) -> None:
    import shoal.torch as hvd

    result = train(args.model, args.batch_size, args.steps, args.warmup, args.rounds, args.asked_at)
    if hvd.rank() == 0:
        print(json.dumps(result), flush=True)
    hvd.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Shoal on Ray (RayExecutor) against shoalrun: start-up and throughput.")
    add_training_arguments(parser)
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: start a local one)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--asked-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main(args)
        return

    import ray

    from shoal.ray import RayExecutor

    shoalrun = shoalrun_phase(args)

    started = time.perf_counter()
    ray.init(address=args.address, num_cpus=None if args.address else args.workers, include_dashboard=False)
    cluster_start_s = time.perf_counter() - started
    executor = RayExecutor(num_workers=args.workers, cpus_per_worker=1)
    asked_at = time.time()
    executor.start()
    try:
        on_ray: dict[str, Any] = executor.run(train, args=training_args(args, asked_at))[0]
    finally:
        executor.shutdown()
        ray.shutdown()
    result = {
        **compared("ray", args, shoalrun, on_ray),
        "ray_cluster_start_s": None if args.address else round(cluster_start_s, 2),
    }
    print(
        f"{args.model}, {args.workers} workers: shoalrun {result['shoalrun_ips']} img/s "
        f"(start {result['shoalrun_start_s']} s), "
        f"RayExecutor {result['ray_ips']} img/s (start {result['ray_start_s']} s, cluster {result['ray_cluster_start_s']} s)",
        flush=True,
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
