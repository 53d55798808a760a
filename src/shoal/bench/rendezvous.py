"""Rendezvous benchmark: how long ``init()`` takes with torch's open TCPStore and with Shoal's authenticated store.

Run: ``python -m shoal.bench.rendezvous [--worlds 2,4] [--repeats 3]``. For each world size and each store, it
starts that many local ranks with a torchrun-style environment (rank 0 hosts the store; with the job's ``SECRET`` set
it is Shoal's authenticated store, without it torch's TCPStore), lets every rank import torch first, then starts
``init()`` on all ranks at the same instant. A row reports the slowest rank's first ``init()`` (store, gloo group,
engine) and the median of 5 ``shutdown()``/``init()`` cycles after it, median over repeats. Last line, one JSON:
``{"bench":"rendezvous","rows":[{"world","open_ms","auth_ms","ratio","open_reinit_ms","auth_reinit_ms"}]}``, where
``ratio`` = auth_ms / open_ms (the cost of authentication; 1 means none).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

from shoal.bench import add_json_flag, emit
from shoal.config import PREFIX, env_name
from shoal.testing import free_port


def _worker(start_at: float, reinits: int) -> None:
    import torch

    import shoal.torch as hvd

    torch.set_num_threads(1)
    time.sleep(max(0.0, start_at - time.time()))
    started = time.perf_counter()
    hvd.init()
    hvd.allreduce(torch.ones(1), name="first")
    first_ms = (time.perf_counter() - started) * 1e3
    cycles = []
    for _ in range(reinits):
        hvd.shutdown()
        started = time.perf_counter()
        hvd.init()
        hvd.allreduce(torch.ones(1), name="first")
        cycles.append((time.perf_counter() - started) * 1e3)
    hvd.shutdown()
    print(json.dumps({"first_ms": first_ms, "reinit_ms": statistics.median(cycles) if cycles else None}), flush=True)


def measure(world: int, authenticated: bool, reinits: int, import_grace_s: float = 10.0) -> tuple[float, float | None]:
    """(slowest rank's first init ms, slowest rank's median re-init ms) for one job."""
    port = str(free_port())
    secret = secrets.token_hex(16)
    start_at = time.time() + import_grace_s
    processes = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith((PREFIX, "HOROVOD_", "OMPI_", "PMI_", "SLURM_"))}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        env[env_name("LOG_LEVEL")] = "error"
        if authenticated:
            env[env_name("SECRET")] = secret
        command = [sys.executable, "-m", "shoal.bench.rendezvous", "--worker", str(start_at), "--reinits", str(reinits)]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=180)
        if process.returncode != 0:
            raise RuntimeError(f"a rendezvous worker failed (exit {process.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    reinit = [r["reinit_ms"] for r in results if r["reinit_ms"] is not None]
    return max(r["first_ms"] for r in results), max(reinit) if reinit else None


def main() -> None:
    parser = argparse.ArgumentParser(description="Time init() with torch's open store and Shoal's authenticated one.")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per setting; the median is reported")
    parser.add_argument("--reinits", type=int, default=5, help="shutdown()/init() cycles timed after the first init")
    parser.add_argument("--import-grace", type=float, default=10.0, help="seconds the ranks get to import torch first")
    parser.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    add_json_flag(parser)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.reinits)
        return
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        row: dict[str, float | int | None] = {"world": world}
        first: dict[str, float] = {}
        for label, authenticated in (("open", False), ("auth", True)):
            samples = [measure(world, authenticated, args.reinits, args.import_grace) for _ in range(args.repeats)]
            first[label] = row[f"{label}_ms"] = round(statistics.median(s[0] for s in samples), 1)
            reinits = [s[1] for s in samples if s[1] is not None]
            row[f"{label}_reinit_ms"] = round(statistics.median(reinits), 1) if reinits else None
        row["ratio"] = round(first["auth"] / first["open"], 3)
        print(
            f"world {world}: open store {row['open_ms']} ms (re-init {row['open_reinit_ms']} ms), "
            f"authenticated {row['auth_ms']} ms (re-init {row['auth_reinit_ms']} ms)",
            flush=True,
        )
        rows.append(row)
    emit({"bench": "rendezvous", "rows": rows}, args.json)


if __name__ == "__main__":
    main()
