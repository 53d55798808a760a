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

from shoal.bench.on_ray import add_training_arguments, compared, shoalrun_phase, train, training_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Shoal on Spark (shoal.spark.run) against shoalrun: start-up and throughput.")
    add_training_arguments(parser)
    parser.add_argument("--master", default=None, help="Spark master (default: local[WORKERS])")
    args = parser.parse_args(argv)
    shoalrun = shoalrun_phase(args)

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
        on_spark: dict[str, Any] = shoal.spark.run(train, args=training_args(args, asked_at), num_proc=args.workers, verbose=0)[
            0
        ]
    finally:
        session.stop()
    result = {**compared("spark", args, shoalrun, on_spark), "spark_session_start_s": round(session_start_s, 2)}
    print(
        f"{args.model}, {args.workers} workers: shoalrun {result['shoalrun_ips']} img/s "
        f"(start {result['shoalrun_start_s']} s), shoal.spark.run {result['spark_ips']} img/s "
        f"(start {result['spark_start_s']} s, Spark session {result['spark_session_start_s']} s)",
        flush=True,
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
