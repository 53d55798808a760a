"""Benchmarks, each runnable under the launcher (``shoalrun -np 2 python -m shoal.bench.allreduce``).

Every benchmark measures Shoal against raw torch.distributed in the same run and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any

from shoal.predict.output import add_json_flag, emit

__all__ = ["add_json_flag", "add_phase_flags", "emit", "rank0_result"]


def add_phase_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of benchmarks that launch ``shoal.bench.train`` jobs: ``--steps``, ``--warmup``, ``--rounds`` (the
    best phase kept) and ``--timeout`` per launched job."""
    parser.add_argument("--steps", type=int, default=20, help="timed steps per training phase (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each phase (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="training phases per launched job, the best kept (default 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launched job (default 900)")


def rank0_result(command: list[str], timeout: float, what: str) -> dict[str, Any]:
    """Run a launched benchmark job (shoalrun or ``shoal.bench.netns``) and return rank 0's JSON result line; a
    failure, or no result line, ends the calling benchmark with ``what`` and the job's stderr."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    lines = [line.split(":", 1)[1] for line in result.stdout.splitlines() if line.startswith("[0]<stdout>:{")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed ({result.returncode}, {len(lines)} result lines):\n{result.stderr[-3000:]}")
    parsed: dict[str, Any] = json.loads(lines[-1])
    return parsed
