"""Unequal workers: a busy neighbour on one rank's core, and the BalancedLoader against equal shares and DDP.

Run: ``python -m shoal.bench.unequal`` (it launches ``shoalrun -np --workers`` itself), or under a launcher
(``shoalrun -np 2 python -m shoal.bench.unequal``; ``python -m shoal.bench.netns --hosts 2 -- python -m
shoal.bench.unequal`` for emulated hosts). Each rank pins itself (all its threads) to its own core. The "neighbour" is
a busy process on the last rank's core, started and stopped by that rank.

In one invocation, first without the neighbour and then with it, each for ``--rounds`` alternating rounds:
- ``bound``: every rank trains its equal half of the global batch (the same micro-batches) with no communication at
  all, all at once; the bound is the sum of the ranks' own rates (what a perfectly balanced job with free
  communication could reach);
- ``balanced``: Shoal with ``BalancedLoader`` (shares by measured speed), one pass per micro-batch;
- ``joined``: the same with ``max_pass_size`` = the global batch, so each rank runs its share in one pass;
- ``equal``: the same with equal shares (what every synchronous framework does);
- ``ddp``: torch's DistributedDataParallel with equal shares of the same micro-batches, accumulated under
  ``no_sync()`` (the like-for-like job); ``ddp_one_batch``: DDP with each rank's global/world samples as one batch.
Then one balanced run in which the neighbour starts and stops at seeded steps (``rebalance_steps``: the steps from
each event until the shares reach what that regime settles on), and rank 0 trains the same schedule alone for the
1-process reference (``final_loss`` against ``reference_loss``, on the same held-out samples).

The last line is JSON: ``{"bench": "unequal", "world", "balanced_ips", "equal_ips", "ddp_ips", "bound_ips",
"of_bound", "quiet_of_bound", "rebalance_steps": {"start", "stop"}, "final_loss", "reference_loss", ...}`` where
the *_ips are with the neighbour, ``of_bound`` = balanced_ips / bound_ips with it and ``quiet_of_bound`` the same
without it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import shoal.torch as hvd
from shoal.bench import add_json_flag, emit
from shoal.comm.baselines import wrap_ddp
from shoal.core.balance import MicroBatchSchedule
from shoal.runtime.launch_env import detect_launch

MODELS = {
    "mlp": (1536, [1024, 512]),  # 2.1M parameters: its weights stay near the caches, so micro-batches of 128 run at
    # 85% of the per-sample speed of one batch of 512 on this project's CPUs
    "mlp-10m": (3072, [2048, 1536]),  # shoal.predict.models' MLP (10M): memory-bound, micro-batches cost it more
    "small": (256, [512, 256]),  # a quick one, for a smoke run
}


def build_model(name: str) -> nn.Module:
    """An MLP classifier of the named size (10 classes)."""
    width, hidden = MODELS[name]
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    return nn.Sequential(*layers, nn.Linear(width, 10))


def build_data(name: str, samples: int) -> tuple[TensorDataset, TensorDataset]:
    """A learnable task (labels from a fixed random linear teacher), and 512 held-out samples of it."""
    width = MODELS[name][0]
    generator = torch.Generator().manual_seed(99)
    x = torch.randn(samples + 512, width, generator=generator)
    teacher = torch.randn(width, 10, generator=generator)
    y = (x @ teacher).argmax(1)
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


def pin_to_core(core: int) -> None:
    """Pin every thread of this process (the engine's included) to ``core``."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), {core})
        except (ProcessLookupError, OSError):
            pass  # a thread that just ended


def _die_with_parent() -> None:  # pragma: no cover (runs in the child before exec)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the neighbour never outlives this rank


class Neighbour:
    """A busy process on one core, on the rank that owns the core (a no-op on the others)."""

    def __init__(self, core: int, here: bool) -> None:
        self.core = core
        self.here = here
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.here and self.process is None:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "while True: pass"], preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL
            )
            os.sched_setaffinity(self.process.pid, {self.core})

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@contextmanager
def neighbour_on(neighbour: Neighbour) -> Iterator[None]:
    neighbour.start()
    try:
        yield
    finally:
        neighbour.stop()


def _slowest(seconds: float) -> float:
    return float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="bench.unequal.elapsed").item())


class Job:
    """A balanced (or equal-shares) Shoal training job: model, optimizer and loader, trained step by step."""

    def __init__(self, args: argparse.Namespace, data: TensorDataset, balance: bool, joined: bool = False) -> None:
        torch.manual_seed(0)
        self.model = build_model(args.model)
        self.loader = hvd.BalancedLoader(
            data,
            args.global_batch_size,
            args.micro_batch_size,
            shuffle=True,
            seed=args.seed,
            balance=balance,
            max_pass_size=args.global_batch_size if joined else None,
        )
        optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=self.model.named_parameters(), loader=self.loader)
        self.epoch = 0
        self.steps = self._steps()

    def _steps(self) -> Iterator[Any]:
        while True:
            self.loader.set_epoch(self.epoch)
            yield from self.loader
            self.epoch += 1

    def step(self, on_step: Callable[[int], None] | None = None) -> tuple[int, ...]:
        """Train one step; returns its shares."""
        step = next(self.steps)
        self.optimizer.zero_grad()
        for x, y in step:
            nn.functional.cross_entropy(self.model(x), y).backward()
        self.optimizer.step()
        return step.plan.shares

    def timed(self, warmup: int, steps: int) -> float:
        """Samples per second over ``steps`` steps after ``warmup`` (the slowest rank's time)."""
        for _ in range(warmup):
            self.step()
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        return self.loader.global_batch_size * steps / _slowest(time.perf_counter() - start)


def _time_equal_shares(args: argparse.Namespace, data: TensorDataset, model: nn.Module, one_batch: bool) -> tuple[float, int]:
    """Seconds this rank takes for ``args.steps`` steps (after ``args.warmup``) of its equal share of each global
    batch, and the samples it ran in them: its micro-batches accumulated (under DDP's ``no_sync()`` but for the
    last), or ``one_batch``, all its samples as one batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    schedule = MicroBatchSchedule(len(data), args.global_batch_size, args.micro_batch_size, seed=args.seed)
    size, rank = hvd.size(), hvd.rank()
    x, y = data.tensors
    no_sync = getattr(model, "no_sync", None)

    def step(index: int) -> int:
        micro = schedule.micro_batches(0, index % schedule.steps_per_epoch)
        mine = [[i for m in micro for i in m][rank::size]] if one_batch else micro[rank::size]
        optimizer.zero_grad()
        for number, indices in enumerate(mine):
            with no_sync() if no_sync is not None and number < len(mine) - 1 else _nothing():
                nn.functional.cross_entropy(model(x[indices]), y[indices]).backward()
        optimizer.step()
        return sum(len(m) for m in mine)

    for index in range(args.warmup):
        step(index)
    hvd.barrier()
    start = time.perf_counter()
    samples = sum(step(index) for index in range(args.steps))
    return time.perf_counter() - start, samples


def run_bound(args: argparse.Namespace, data: TensorDataset) -> float:
    """Every rank trains its equal half of each global batch, as micro-batches, with no communication, all at once;
    returns the sum of the ranks' own samples per second."""
    torch.manual_seed(0)
    seconds, samples = _time_equal_shares(args, data, build_model(args.model), one_batch=False)
    rate = samples / seconds
    hvd.barrier()
    return float(hvd.allreduce(torch.tensor([rate]), op=hvd.Sum, name="bench.unequal.bound").item())


def run_ddp(args: argparse.Namespace, data: TensorDataset, one_batch: bool) -> float:
    """DDP with equal shares: each rank accumulates its equal half of the step's micro-batches under ``no_sync()``
    and reduces with the last (the like-for-like job), or, ``one_batch``, runs its global/world samples as one
    batch (the usual DDP loop, when memory allows)."""
    torch.manual_seed(0)
    seconds, _ = _time_equal_shares(args, data, wrap_ddp(build_model(args.model)), one_batch)
    return args.global_batch_size * args.steps / _slowest(seconds)


def settle_step(shares: list[tuple[int, ...]], event: int, end: int) -> int | None:
    """Steps from ``event`` until the shares are within one micro-batch (a share's unit) of what the regime settles
    on (its last step's shares), and stay there until ``end``."""
    settled = shares[end - 1]

    def near(current: tuple[int, ...]) -> bool:
        return all(abs(a - b) <= 1 for a, b in zip(current, settled, strict=True))

    for index in range(event, end):
        if all(near(s) for s in shares[index:end]):
            return index - event
    return None


def held_out_loss(model: nn.Module, data: TensorDataset) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(data.tensors[0]), data.tensors[1]))


def run_transition(args: argparse.Namespace, data: TensorDataset, neighbour: Neighbour) -> dict[str, Any]:
    """A balanced job from scratch; the neighbour starts and stops at seeded steps. Its shares, and its loss."""
    rng = np.random.default_rng(args.seed)
    start_at = int(rng.integers(args.transition_steps // 4, args.transition_steps // 3 + 1))
    stop_at = int(rng.integers(2 * args.transition_steps // 3, 3 * args.transition_steps // 4 + 1))
    job = Job(args, data, balance=True)
    shares = []
    try:
        for index in range(args.transition_steps):
            if index == start_at:
                neighbour.start()
            if index == stop_at:
                neighbour.stop()
            shares.append(job.step())
    finally:
        neighbour.stop()
    return {
        "model": job.model,
        "steps": args.transition_steps,
        "start_at": start_at,
        "stop_at": stop_at,
        "shares": shares,
        "start": settle_step(shares, start_at, stop_at),
        "stop": settle_step(shares, stop_at, len(shares)),
    }


def reference_model(args: argparse.Namespace, data: TensorDataset, steps: int) -> nn.Module:
    """One process, no Shoal: the same schedule's global batches, each in one backward pass."""
    torch.manual_seed(0)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    schedule = MicroBatchSchedule(len(data), args.global_batch_size, args.micro_batch_size, seed=args.seed)
    x, y = data.tensors
    done = 0
    epoch = 0
    while done < steps:
        for step in range(schedule.steps_per_epoch):
            if done == steps:
                break
            micro = schedule.micro_batches(epoch, step)
            optimizer.zero_grad()
            # Micro-batch by micro-batch, weighted as the loader's rule weighs them: the same sum in one process.
            for indices in micro:
                loss = nn.functional.cross_entropy(model(x[indices]), y[indices])
                (loss * (len(indices) / sum(len(m) for m in micro))).backward()
            optimizer.step()
            done += 1
        epoch += 1
    return model


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.unequal", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="ranks to launch when not already under a launcher")
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--global-batch-size", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8192, help="training samples (default 8192)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per phase (default 12)")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps before each phase (balancing settles)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per regime; the best of each kept")
    parser.add_argument("--transition-steps", type=int, default=40, help="steps of the run the neighbour enters and leaves")
    parser.add_argument("--seed", type=int, default=0, help="data order and the neighbour's times")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the launched job")
    add_json_flag(parser)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every phase, on every rank; rank 0 returns the result."""
    torch.set_num_threads(1)
    hvd.init()
    cores = sorted(os.sched_getaffinity(0))
    core = cores[hvd.rank() % len(cores)]
    pin_to_core(core)
    data, held_out = build_data(args.model, args.samples)
    neighbour = Neighbour(core, here=hvd.rank() == hvd.size() - 1)
    figures: dict[str, dict[str, list[float]]] = {}
    jobs = {
        regime: {
            "balanced": Job(args, data, True),
            "joined": Job(args, data, True, joined=True),
            "equal": Job(args, data, False),
        }
        for regime in ("quiet", "busy")
    }
    for regime in ("quiet", "busy"):
        runs: dict[str, list[float]] = {"bound": [], "balanced": [], "joined": [], "equal": [], "ddp": [], "ddp_one_batch": []}
        with neighbour_on(neighbour) if regime == "busy" else _nothing():
            for round_number in range(args.rounds):
                runs["bound"].append(run_bound(args, data))
                runs["balanced"].append(jobs[regime]["balanced"].timed(args.warmup, args.steps))
                runs["joined"].append(jobs[regime]["joined"].timed(args.warmup if round_number == 0 else 1, args.steps))
                runs["equal"].append(jobs[regime]["equal"].timed(args.warmup if round_number == 0 else 1, args.steps))
                runs["ddp"].append(run_ddp(args, data, one_batch=False))
                runs["ddp_one_batch"].append(run_ddp(args, data, one_batch=True))
                if hvd.rank() == 0:
                    line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items())
                    shares = jobs[regime]["balanced"].loader.plan
                    print(f"{regime} round {round_number + 1}: {line} samples/s; balanced shares {shares and shares.shares}")
        figures[regime] = runs
    transition = run_transition(args, data, neighbour)
    final_loss = held_out_loss(transition["model"], held_out)
    hvd.barrier()
    if hvd.rank() != 0:
        hvd.barrier()
        return None
    reference_loss = held_out_loss(reference_model(args, data, transition["steps"]), held_out)
    hvd.barrier()
    best = {regime: {k: max(v) for k, v in runs.items()} for regime, runs in figures.items()}
    busy, quiet = best["busy"], best["quiet"]
    return {
        "bench": "unequal",
        "world": hvd.size(),
        "model": args.model,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size,
        "balanced_ips": round(busy["balanced"], 1),
        "equal_ips": round(busy["equal"], 1),
        "ddp_ips": round(busy["ddp"], 1),
        "bound_ips": round(busy["bound"], 1),
        "of_bound": round(busy["balanced"] / busy["bound"], 3),
        "quiet_of_bound": round(quiet["balanced"] / quiet["bound"], 3),
        "vs_equal": round(busy["balanced"] / busy["equal"], 3),
        "vs_ddp": round(busy["balanced"] / busy["ddp"], 3),
        "ddp_one_batch_ips": round(busy["ddp_one_batch"], 1),
        "vs_ddp_one_batch": round(busy["balanced"] / busy["ddp_one_batch"], 3),
        "joined_ips": round(busy["joined"], 1),
        "joined_of_bound": round(busy["joined"] / busy["bound"], 3),
        "joined_vs_ddp_one_batch": round(busy["joined"] / busy["ddp_one_batch"], 3),
        "joined_vs_equal": round(busy["joined"] / busy["equal"], 3),
        "quiet": {k: round(v, 1) for k, v in quiet.items()},
        "quiet_vs_equal": round(quiet["balanced"] / quiet["equal"], 3),
        "rebalance_steps": {"start": transition["start"], "stop": transition["stop"]},
        "neighbour_steps": [transition["start_at"], transition["stop_at"]],
        "transition_shares": [list(s) for s in transition["shares"]],
        "final_loss": round(final_loss, 6),
        "reference_loss": round(reference_loss, 6),
    }


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if detect_launch(os.environ).launcher == "single":  # not under a launcher: launch the ranks
        command = [sys.executable, "-m", "shoal.runner", "-np", str(args.workers), sys.executable, "-m", "shoal.bench.unequal"]
        command += argv if argv is not None else sys.argv[1:]
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        lines = [line.split(":", 1)[1] for line in done.stdout.splitlines() if line.startswith("[0]<stdout>:")]
        if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
            raise SystemExit(f"the unequal-workers job failed ({done.returncode}):\n{done.stderr[-3000:]}")
        print("\n".join(lines[:-1]), flush=True)  # rank 0's progress; the JSON line comes last, from emit
        emit(json.loads(lines[-1]), args.json)
        return
    result = measure(args)
    if result is not None:
        print(
            f"with the neighbour: balanced {result['balanced_ips']}, equal {result['equal_ips']}, ddp {result['ddp_ips']}, "
            f"bound {result['bound_ips']} samples/s (of bound {result['of_bound']}, quiet {result['quiet_of_bound']})"
        )
        emit(result, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
