"""Far-apart hosts: one worker alone, synchronous ``auto-lossy``, and local steps as the planner chose them, one after
another in one invocation, on the same task and the same number of samples.

Run under emulated hosts: ``python -m shoal.bench.netns --hosts 2 --rate 100mbit -- python -m shoal.bench.far``.

- **solo**: every rank trains alone at once (each emulated host has its own core), with no communication: one
  worker's batch and learning rate. Its rate times the hosts is the bound (``bound_ips``).
- **sync**: ``DistributedOptimizer(comm="auto-lossy")``, each rank one worker's batch, the learning rate times the
  hosts.
- **far**: ``DistributedOptimizer(comm="local")``, each host one worker's batch and learning rate; H and the codec
  are the planner's (or ``--every``/``--codec``).

Each trains ``--samples`` samples in all (over every host), scoring the held-out loss every ``--eval-every`` samples
with the clock stopped. The target is the held-out loss sync reaches at the end, plus 1%; a run's time to target is
its training seconds until it first scores at or below it. Bytes are the emulated hosts' interfaces' transmitted
bytes (``/sys/class/net/*/statistics/tx_bytes``, loopback aside), summed over the ranks. The last line is JSON:
``{"bench": "far", "hosts", "rate", "task", "far_ips", "sync_ips", "solo_ips", "bound_ips", "of_bound",
"far_bytes_per_sample", "sync_bytes_per_sample", "allreduce_bytes_per_sample", "far_time_to_target_s",
"sync_time_to_target_s", "solo_time_to_target_s", "far_eval_loss", "sync_eval_loss", "solo_eval_loss", "target",
"far_accuracy", "sync_accuracy", "plan"}``.

Task: ``digits``, the MLP of ``shoal.bench.accuracy`` on scikit-learn's digits (read without scikit-learn).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import shoal.torch as hvd
from shoal.bench import add_json_flag, emit
from shoal.bench.accuracy import build_model
from shoal.bench.digits import load_digits_tensors
from shoal.plan.far import DEFAULT_BUDGET
from shoal.torch.optimizer import rounds_of

MODES = ("solo", "sync", "far")


def sent_bytes() -> int:
    """Bytes this network namespace's interfaces have transmitted (loopback aside)."""
    total = 0
    for name in os.listdir("/sys/class/net"):
        if name == "lo":
            continue
        try:
            with open(f"/sys/class/net/{name}/statistics/tx_bytes") as handle:
                total += int(handle.read())
        except OSError:
            continue
    return total


@dataclass
class Run:
    """One mode's outcome on this rank."""

    seconds: float = 0.0
    samples: int = 0
    """Samples trained on every host together."""
    curve: list[tuple[int, float, float, float]] = field(default_factory=list)
    """(samples, training seconds, held-out loss, held-out accuracy) at each score."""
    sent: int = 0
    plan: dict[str, Any] | None = None


def evaluate(model: nn.Module, dataset: TensorDataset) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        logits = model(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    model.train()
    return loss, accuracy


def train(mode: str, args: argparse.Namespace) -> Run:
    """Train one mode on every rank; the same model, data order and budget of samples."""
    train_set, test_set = load_digits_tensors()
    alone = mode == "solo"
    replicas, index = (1, 0) if alone else (hvd.size(), hvd.rank())
    sampler: DistributedSampler[Any] = DistributedSampler(train_set, num_replicas=replicas, rank=index, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = build_model("mlp", args.width)
    workers = 1 if alone else hvd.size()
    lr = args.lr * (workers if mode == "sync" else 1)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if mode == "sync":
        optimizer = hvd.DistributedOptimizer(optimizer, model=model, comm="auto-lossy")
    elif mode == "far":
        options = hvd.LocalSteps(every=args.every, codec=args.codec, budget=args.budget)
        optimizer = hvd.DistributedOptimizer(optimizer, model=model, comm="local", local_steps=options)
    loss_fn = nn.CrossEntropyLoss()
    run = Run()
    per_step = args.batch_size * workers
    steps = args.samples // per_step
    eval_every = max(1, args.eval_every // per_step)
    hvd.barrier()
    before = sent_bytes()
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        epoch += 1
        start = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            step += 1
            if step % eval_every == 0 or step == steps:
                if step == steps and mode == "far":
                    optimizer.outer_step()  # the hosts meet on the last samples
                run.seconds += time.perf_counter() - start
                run.curve.append((step * per_step, round(run.seconds, 3), *evaluate(model, test_set)))
                start = time.perf_counter()
            if step == steps:
                break
        if step < steps:
            run.seconds += time.perf_counter() - start
    run.samples = steps * per_step
    if not alone:
        hvd.barrier()
    run.sent = sent_bytes() - before
    outer = rounds_of(optimizer)
    if outer is not None and outer.plan is not None:
        run.plan = {
            **outer.plan.as_dict(),
            "rounds": outer.rounds,
            "fragments": 1,
            "planning_s": round(outer.planning_s, 3),
            "round_ends_s": round(outer.exchange_s, 3),
            "replans": [list(change) for change in outer.replans],
        }
    return run


def time_to(run: Run, target: float) -> float | None:
    return next((seconds for _, seconds, loss, _ in run.curve if loss <= target), None)


def summed(value: float, name: str) -> float:
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Sum, name=f"far.sum.{name}")[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.far", description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["digits"], default="digits")
    parser.add_argument("--samples", type=int, default=20 * 1437, help="samples per mode, over every host (default 20 epochs)")
    parser.add_argument("--eval-every", type=int, default=1437, help="score the held-out set every this many samples")
    parser.add_argument("--batch-size", type=int, default=32, help="one worker's batch (default 32)")
    parser.add_argument("--lr", type=float, default=0.02, help="one worker's learning rate (sync: times the hosts)")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden width (default 1024: 1.1M parameters)")
    parser.add_argument("--every", type=int, default=None, help="force H (default: the planner's)")
    parser.add_argument("--codec", choices=["fp32", "bf16", "int8"], default=None, help="force the codec")
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET, help="the share of a round its exchange's local work may add"
    )
    parser.add_argument("--rate", default="", help="the emulated link's rate, for the record (e.g. 100mbit)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    runs = {mode: train(mode, args) for mode in MODES}
    hosts = hvd.size()
    sent = {mode: summed(run.sent, mode) for mode, run in runs.items()}
    if hvd.rank() != 0:
        hvd.shutdown()
        return
    solo, sync, far = runs["solo"], runs["sync"], runs["far"]
    target = round(sync.curve[-1][2] * 1.01, 5)
    ips = {mode: run.samples / run.seconds for mode, run in runs.items()}
    entries = sum(p.numel() for p in build_model("mlp", args.width).parameters())
    for mode, run in runs.items():
        print(f"{mode:>5}: {ips[mode]:8.0f} samples/s, " + ", ".join(f"{s}:{loss:.3f}" for s, _, loss, _ in run.curve))
    result: dict[str, Any] = {
        "bench": "far",
        "hosts": hosts,
        "rate": args.rate,
        "task": args.task,
        "samples": args.samples,
        "far_ips": round(ips["far"], 1),
        "sync_ips": round(ips["sync"], 1),
        "solo_ips": round(ips["solo"], 1),
        "bound_ips": round(hosts * ips["solo"], 1),
        "of_bound": round(ips["far"] / (hosts * ips["solo"]), 3),
        "far_bytes_per_sample": round(sent["far"] / far.samples, 1),
        "sync_bytes_per_sample": round(sent["sync"] / sync.samples, 1),
        "allreduce_bytes_per_sample": round(2 * (hosts - 1) * 4 * entries / (args.batch_size * hosts), 1),
        "far_time_to_target_s": time_to(far, target),
        "sync_time_to_target_s": time_to(sync, target),
        "solo_time_to_target_s": time_to(solo, target),
        "far_eval_loss": round(far.curve[-1][2], 5),
        "sync_eval_loss": round(sync.curve[-1][2], 5),
        "solo_eval_loss": round(solo.curve[-1][2], 5),
        "target": target,
        "far_accuracy": round(far.curve[-1][3], 4),
        "sync_accuracy": round(sync.curve[-1][3], 4),
        "plan": far.plan,
    }
    emit(result, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
