"""The executor side of ``shoal.spark.run``: one barrier task per rank starts that rank's worker process.

Each task learns every task's executor address from Spark's barrier context, so all tasks agree on the ranks: the
hosts in the order of their lowest partition, each host's tasks in partition order (so a host's ranks are
contiguous and its local ranks share memory). The task then starts ``python -m shoal.runner.task`` in a session of
its own with that rank's identity and the job's address and secret in its environment (never on a command line),
streams its output to the driver when asked, waits for it, and ends its process group whatever happens: the worker
dies with the task (``PR_SET_PDEATHSIG``, and Shoal's launcher watchdog).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

_GRACE_S = 2.0


@dataclass(frozen=True)
class TaskSettings:
    """What every task needs, shipped inside the task's closure (Spark's RPC, not a command line)."""

    addr: str
    port: int
    secret: str
    start_timeout: float
    env: dict[str, str | None]
    stream_output: bool
    executable: str | None


def rank_order(hosts: list[str]) -> list[int]:
    """Partition indices in rank order: hosts by their lowest partition, then partitions within a host."""
    first: dict[str, int] = {}
    for index, host in enumerate(hosts):
        first.setdefault(host, index)
    return sorted(range(len(hosts)), key=lambda index: (first[hosts[index]], index))


def output_key(rank: int, stream: str, sequence: int | None = None) -> str:
    """Chunk ``sequence`` of a rank's stream (None: the chunk count)."""
    return f"out/{rank}/{stream}/" + ("n" if sequence is None else str(sequence))


def _pump(pipe: IO[bytes], store: Any, rank: int, stream: str, echo: IO[bytes]) -> None:
    """Forward a worker's output to the driver in chunks (about every 0.2 s), and to the executor's own log."""
    pending: list[bytes] = []
    last = time.monotonic()
    sequence = 0
    for line in iter(pipe.readline, b""):
        echo.write(line)
        echo.flush()
        pending.append(line)
        if time.monotonic() - last >= 0.2 or len(pending) >= 64:
            store.set(output_key(rank, stream, sequence), b"".join(pending))
            store.add(output_key(rank, stream), 1)
            sequence, pending, last = sequence + 1, [], time.monotonic()
    if pending:
        store.set(output_key(rank, stream, sequence), b"".join(pending))
        store.add(output_key(rank, stream), 1)


def start_pumps(process: subprocess.Popen[bytes], store: Any, label: int) -> list[threading.Thread]:
    """Threads forwarding a worker's piped stdout and stderr to the driver as ``label``'s (and to this executor's
    own log)."""
    assert process.stdout is not None and process.stderr is not None
    pumps = []
    for stream, pipe_end, echo in (
        ("stdout", process.stdout, sys.stdout.buffer),
        ("stderr", process.stderr, sys.stderr.buffer),
    ):
        pump = threading.Thread(target=_pump, args=(pipe_end, store, label, stream, echo), daemon=True)
        pump.start()
        pumps.append(pump)
    return pumps


def run_rank(settings: TaskSettings, _partition: Iterator[Any]) -> Iterator[tuple[int, int]]:
    """The body of each barrier task: start this rank's worker and wait for it; yields ``(rank, exit code)``."""
    from pyspark import BarrierTaskContext

    from shoal.comm.store import connect_job_store
    from shoal.config import LaunchConfig
    from shoal.config.worker import JobAddress
    from shoal.runner.hosts import place_ranks
    from shoal.runner.task import task_prefix
    from shoal.runner.worker_env import child_env, start_worker, worker_env

    context = BarrierTaskContext.get()
    hosts = [info.address.rsplit(":", 1)[0] for info in context.getTaskInfos()]
    order = rank_order(hosts)
    rank = order.index(context.partitionId())
    slot = place_ranks([hosts[index] for index in order])[rank]
    store = connect_job_store(
        settings.addr, settings.port, settings.secret, settings.start_timeout, task_prefix(settings.secret)
    )
    store.set(f"host/{rank}", slot.hostname)
    address = JobAddress(settings.addr, settings.port, settings.secret)
    variables = worker_env(address, LaunchConfig(start_timeout=settings.start_timeout).worker_env(), slot)
    env = child_env({**settings.env, **variables}, int(context.cpus()))  # the user's variables, then Shoal's
    argv = [settings.executable or sys.executable, "-m", "shoal.runner.task"]
    process = start_worker(argv, env, stream=settings.stream_output)
    store.add("started", 1)
    pumps = start_pumps(process, store, rank) if settings.stream_output else []
    try:
        code = process.wait()
        for pump in pumps:
            pump.join(timeout=5)
    finally:
        _end_group(process)
    if code != 0:
        raise RuntimeError(f"shoal.spark.run: rank {rank} on {slot.hostname} exited with code {code}")
    yield rank, code


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker's process group, then SIGKILL what is left (the group may outlive its leader)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
