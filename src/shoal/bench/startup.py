"""Start-up benchmark: how long a job of N local torch workers takes to take its first step and end, and the CPU it
spends, with shoalrun forking the workers from a preloaded server (``--preload auto``, the default), with every
worker a new interpreter (``--preload none``), and under torchrun with raw torch.distributed, side by side.

Run: ``python -m shoal.bench.startup [--np 2,4] [--repeats 3]``. Each worker imports torch, joins its job (Shoal's
``init()``, or ``init_process_group("gloo")`` under torchrun), sums one tensor, takes one SGD step (which imports
torch._dynamo) and exits. A row gives each launcher's wall seconds (median over repeats) and CPU seconds of the
whole process tree. Last line, one JSON: ``{"bench":"startup","rows":[{"np","forked_s","fresh_s","torchrun_s",
"forked_cpu_s","fresh_cpu_s","torchrun_cpu_s","speedup"}]}``, where ``speedup`` = fresh_s / forked_s.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shoal.bench import add_json_flag, emit
from shoal.config import env_name

_HVD_WORKER = """
import torch
import shoal.torch as hvd
hvd.init()
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
hvd.allreduce(torch.ones(1), name="first")
model(torch.ones(2, 4)).sum().backward()
optimizer.step()
"""
_TORCH_WORKER = """
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
dist.all_reduce(torch.ones(1))
model(torch.ones(2, 4)).sum().backward()
for p in model.parameters():
    dist.all_reduce(p.grad)
optimizer.step()
dist.destroy_process_group()
"""


def timed(command: list[str], env: dict[str, str], timeout: float) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole tree) of one job, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description="Time a job's start-up with forked and with new-interpreter workers.")
    parser.add_argument("--np", default="2,4", help="comma-separated worker counts (default 2,4)")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per launcher and count; the median is reported")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job (default 300)")
    add_json_flag(parser)
    args = parser.parse_args()
    # Each job starts its own fork server here, as without a preload server: that start is part of what is timed.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", env_name("PRELOAD_SERVER"))}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        shoal_script, torch_script = Path(scratch) / "shoal_worker.py", Path(scratch) / "torch_worker.py"
        shoal_script.write_text(_HVD_WORKER)
        torch_script.write_text(_TORCH_WORKER)
        for count in (int(n) for n in args.np.split(",")):
            shoalrun = [sys.executable, "-m", "shoal.runner", "-np", str(count)]
            launchers = {
                "forked": [*shoalrun, "--preload", "auto", sys.executable, str(shoal_script)],
                "fresh": [*shoalrun, "--preload", "none", sys.executable, str(shoal_script)],
                "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(count), str(torch_script)],
            }
            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in launchers}
            for _ in range(args.repeats):  # the launchers take turns, so that a busy moment touches each alike
                for name, command in launchers.items():
                    samples[name].append(timed(command, env, args.timeout))
            row: dict[str, float | int] = {"np": count}
            for name, runs in samples.items():
                row[f"{name}_s"] = round(statistics.median(wall for wall, _ in runs), 2)
                row[f"{name}_cpu_s"] = round(statistics.median(cpu for _, cpu in runs), 2)
            row["speedup"] = round(row["fresh_s"] / row["forked_s"], 2)
            print(
                f"np {count}: forked {row['forked_s']} s ({row['forked_cpu_s']} s CPU), fresh {row['fresh_s']} s "
                f"({row['fresh_cpu_s']} s CPU), torchrun {row['torchrun_s']} s ({row['torchrun_cpu_s']} s CPU)",
                flush=True,
            )
            rows.append(row)
    emit({"bench": "startup", "rows": rows}, args.json)


if __name__ == "__main__":
    main()
