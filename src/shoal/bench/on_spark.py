"""Shoal on Spark against shoalrun, same workers, one invocation: start-up time and training throughput.

``python -m shoal.bench.on_spark --workers 2 --model mlp`` runs the same training function as
``shoal.bench.on_ray`` (the benchmark model under ``DistributedOptimizer``, ``--rounds`` timed rounds, the best kept)
under ``shoalrun -np N`` and under ``shoal.spark.run(num_proc=N)`` on a local Spark (``local[N]``, or ``--master``).
Start-up is the wall time from asking for the job (launching shoalrun; calling ``shoal.spark.run``) until every
rank has finished ``hvd.init()``; starting the Spark session itself is reported apart (``spark_session_start_s``).
The last line is JSON: ``{"bench": "on_spark", "shoalrun_ips", "spark_ips", "ratio", "shoalrun_start_s",
"spark_start_s", "spark_session_start_s", ...}``. Needs ``pip install 'shoal[spark]'`` and Java.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from shoal.bench.on_ray import SHOALRUN, train


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Shoal on Spark (shoal.spark.run) against shoalrun: start-up and throughput.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", choices=["cnn", "mlp", "transformer"], default="mlp")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each round (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per launcher; the best is kept (default 2)")
    parser.add_argument("--master", default=None, help="Spark master (default: local[WORKERS])")
    args = parser.parse_args(argv)

    from shoal.bench import rank0_result

    flags = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    flags += ["--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    asked_at = time.time()
    command = [*SHOALRUN, "-np", str(args.workers), sys.executable, "-m", "shoal.bench.on_ray", "--worker", *flags]
    shoalrun = rank0_result([*command, "--asked-at", repr(asked_at)], timeout=600, what="the shoalrun phase")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # local executors run this interpreter, which has Shoal
    from pyspark.sql import SparkSession

    import shoal.spark

    started = time.perf_counter()
    session = (
        SparkSession.builder.master(args.master or f"local[{args.workers}]")
        .appName("shoal.bench.on_spark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    session_start_s = time.perf_counter() - started
    try:
        asked_at = time.time()
        on_spark: dict[str, Any] = shoal.spark.run(
            train,
            args=(args.model, args.batch_size, args.steps, args.warmup, args.rounds, asked_at),
            num_proc=args.workers,
            verbose=0,
        )[0]
    finally:
        session.stop()
    result = {
        "bench": "on_spark",
        "model": args.model,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "shoalrun_ips": round(shoalrun["ips"], 1),
        "spark_ips": round(on_spark["ips"], 1),
        "ratio": round(on_spark["ips"] / shoalrun["ips"], 3),
        "shoalrun_start_s": round(shoalrun["start_s"], 2),
        "spark_start_s": round(on_spark["start_s"], 2),
        "spark_session_start_s": round(session_start_s, 2),
    }
    print(
        f"{args.model}, {args.workers} workers: shoalrun {result['shoalrun_ips']} img/s "
        f"(start {result['shoalrun_start_s']} s), shoal.spark.run {result['spark_ips']} img/s "
        f"(start {result['spark_start_s']} s, Spark session {result['spark_session_start_s']} s)",
        flush=True,
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
