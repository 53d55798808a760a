"""Benchmarks, each runnable under the launcher (``shoalrun -np 2 python -m shoal.bench.allreduce``).

Every benchmark measures Shoal against raw torch.distributed in the same run and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from typing import TYPE_CHECKING, Any

from shoal.predict.output import add_json_flag, emit

if TYPE_CHECKING:
    from shoal.comm.shm import SharedMemoryGroup

__all__ = ["add_json_flag", "add_phase_flags", "barrier_us", "emit", "own_local_group", "rank0_result"]


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


def own_local_group(purpose: str, slot_bytes: int) -> SharedMemoryGroup | None:
    """A shared-memory group of this host's ranks on a segment of its own (the engine's belongs to the engine
    thread); None when this rank shares its host with no other or shared memory is unavailable. Every rank of the
    host calls it together, each ``purpose`` once per job."""
    from shoal.comm.shm import create_local_group, job_token
    from shoal.runtime import context

    ctx = context.current()
    topology = ctx.topology
    if topology.local_size == 1:
        return None
    host = topology.host_of_rank[topology.rank]
    token = job_token(ctx.launch.secret)
    return create_local_group(ctx.store, topology.local_rank, topology.local_size, host, token, slot_bytes, purpose=purpose)


_placement_checks = 0
"""How many ``barrier_us`` calls this process made: each call's segment has its own name (ranks call in step)."""


def barrier_us(calls: int = 2000) -> float | None:
    """The slowest rank's mean round trip of a shared-memory barrier between the host's ranks, in microseconds;
    None when no rank shares a host with another. Every rank of the job calls it together.

    It is how far apart the ranks' cores are: the barrier is one cache line per rank, written by its owner and read
    by the others. On this project's 2-core virtual machine it is about 0.65 us while the two cores share a cache
    and about 1.0 us while they do not, and a 38 MB shared-memory allreduce is then about 2.5 times slower; which
    of the two a run gets is the host's choice. Benchmarks report it so that runs compare like with like.
    """
    import torch

    import shoal.torch as hvd

    global _placement_checks
    _placement_checks += 1
    mine = float("nan")
    local = own_local_group(f"placement.{_placement_checks}", 4096)
    if local is not None:
        try:
            for _ in range(100):
                local.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                local.barrier()
            mine = (time.perf_counter() - start) / calls * 1e6
        finally:
            local.close()
    slowest = float(hvd.allreduce(torch.tensor([mine], dtype=torch.float64), op=hvd.Max, name="bench.barrier_us").item())
    return None if slowest != slowest else round(slowest, 3)
