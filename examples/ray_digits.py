"""Train the digits CNN (examples/digits.py) on a Ray cluster with ``shoal.ray.RayExecutor``.

Run: ``python examples/ray_digits.py --num-workers 2`` (starts a local Ray cluster), or ``--address auto`` to use
a running one (``ray start --head``). The executor places one actor per rank, the driver hosts the authenticated
rendezvous, and every actor runs ``digits.train``; Ray prefixes the workers' output with their rank. Ends with one
JSON line: {"example": "ray_digits", "world": .., "test_accuracy": .., "start_s": ..}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import ray

from shoal.ray import RayExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the digits CNN on Ray with Shoal's RayExecutor.")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: start a local one)")
    parser.add_argument("--checkpoint", default="checkpoints/digits.pt", help="where rank 0 saves the model")
    args = parser.parse_args()

    # The workers import digits.py from this directory: Ray ships it to them as the job's working directory.
    ray.init(address=args.address, runtime_env={"working_dir": HERE, "excludes": ["__pycache__"]})
    from digits import train  # the same training function as `shoalrun -np 2 python examples/digits.py`

    started = time.perf_counter()
    executor = RayExecutor(
        RayExecutor.create_settings(timeout_s=60), num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker
    )
    executor.start()
    start_s = time.perf_counter() - started
    try:
        results = executor.run(train, kwargs={"epochs": args.epochs, "checkpoint": os.path.abspath(args.checkpoint)})
    finally:
        executor.shutdown()
    summary = {**results[0], "example": "ray_digits", "start_s": round(start_s, 2)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
