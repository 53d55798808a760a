"""Far-apart hosts: one worker alone, synchronous ``auto-lossy``, and local steps as the planner chose them, one after
another in one invocation, on the same task and the same number of samples.

Run under emulated hosts: ``python -m shoal.bench.netns --hosts 2 --rate 100mbit -- python -m shoal.bench.far``.

- **solo**: every rank trains alone at once (each emulated host has its own core), with no communication: one
  worker's batch and learning rate. The sum of their rates is the bound (``bound_ips``; each rank's is in
  ``solo_ips_per_host``, and ``solo_ips`` is rank 0's): hosts that run at unequal speeds lower ``of_bound``, since a
  round waits for the slowest.
- **sync**: ``DistributedOptimizer(comm="auto-lossy")``, each rank one worker's batch, the learning rate times the
  hosts.
- **far**: ``DistributedOptimizer(comm="local")``, each host one worker's batch and learning rate; H and the codec
  are the planner's (or ``--every``/``--codec``).

Each trains ``--samples`` samples in all (over every host), scoring the held-out loss every ``--eval-every`` samples
with the clock stopped. The target is the held-out loss sync reaches at the end, plus 1%; a run's time to target is
its training seconds until it first scores at or below it. Bytes are the emulated hosts' interfaces' transmitted
bytes (``/proc/net/dev``, loopback aside), summed over the ranks;
``far_round_bytes_per_sample`` counts them from the first outer round's end on (without the start's calibration probes
and broadcast). The last line is JSON: ``{"bench": "far", "hosts", "rate", "task", "far_ips", "sync_ips", "solo_ips",
"solo_ips_per_host", "bound_ips", "of_bound", "far_bytes_per_sample", "far_round_bytes_per_sample", "sync_bytes_per_sample",
"allreduce_bytes_per_sample", "far_time_to_target_s",
"sync_time_to_target_s", "solo_time_to_target_s", "far_eval_loss", "sync_eval_loss", "solo_eval_loss", "target",
"far_accuracy", "sync_accuracy", "of_bound_without_last_meeting", "plan"}``. ``of_bound_without_last_meeting`` leaves
out the hosts' blocking last meeting (``outer_step()``), which a short run does not amortize.

Tasks (``--task``): ``digits``, the MLP of ``shoal.bench.accuracy`` on scikit-learn's digits (read without
scikit-learn); ``chars``, a byte-level transformer language model on the standard library's own source files, split
by file into training and held-out text (``shoal.bench.chars``; its accuracy is reported as null).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import shoal.torch as hvd
from shoal.bench import add_json_flag, chars, emit
from shoal.bench.accuracy import build_model
from shoal.bench.digits import load_digits_tensors
from shoal.plan.far import DEFAULT_BUDGET, LocalSteps
from shoal.plan.outer_wire import Codec
from shoal.torch.optimizer import rounds_of

MODES = ("solo", "sync", "far")

TASKS: dict[str, type[Task]] = {}  # filled below the tasks
DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"samples": 20 * 1437, "eval_every": 1437, "batch_size": 32, "lr": 0.02, "width": 1024},
    "chars": {"samples": 60_000, "eval_every": 6_000, "batch_size": 32, "lr": 0.05, "width": 128},
}
"""Each task's settings where no flag gives one."""


def sent_bytes() -> int:
    """Bytes this process's network namespace's interfaces have transmitted (loopback aside), from ``/proc/net/dev``
    (the namespace the process is in; ``/sys/class/net`` shows the one sysfs was mounted in)."""
    total = 0
    with open("/proc/net/dev") as handle:
        for line in handle.readlines()[2:]:  # two lines of headings
            name, counters = line.split(":", 1)
            if name.strip() != "lo":
                total += int(counters.split()[8])  # received: 8 columns, then transmitted bytes
    return total


@dataclass
class Run:
    """One mode's outcome on this rank."""

    seconds: float = 0.0
    samples: int = 0
    """Samples trained on every host together."""
    curve: list[tuple[int, float, float, float | None]] = field(default_factory=list)
    """(samples, training seconds, held-out loss, held-out accuracy) at each score."""
    sent: int = 0
    rounds_sent: int = 0
    """Bytes sent from the first outer round's end on (local steps): the rounds, without the start's one-off
    calibration probes and broadcast."""
    rounds_samples: int = 0
    """Samples trained over every host from the first outer round's end on."""
    plan: dict[str, Any] | None = None
    round_ends: list[float] = field(default_factory=list)
    """``time.time()`` at each outer round's end (local steps), as the inner steps saw it."""
    final_s: float = 0.0
    """The hosts' last meeting (``outer_step()``), a blocking exchange: part of ``seconds``."""


class Task:
    """What a mode trains: the model, each rank's batches, the loss and the held-out score."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def model(self) -> nn.Module:
        raise NotImplementedError

    def batches(self, replicas: int, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches, one worker's batch each, without end (every mode the same for a rank)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> tuple[float, float | None]:
        """(held-out loss, held-out accuracy where the task has one)."""
        raise NotImplementedError


class Digits(Task):
    """The MLP of ``shoal.bench.accuracy`` on scikit-learn's digits (read without scikit-learn)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.train_set, self.test_set = load_digits_tensors()

    def model(self) -> nn.Module:
        return build_model("mlp", self.args.width)

    def batches(self, replicas: int, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        sampler: DistributedSampler[Any] = DistributedSampler(self.train_set, num_replicas=replicas, rank=index, seed=0)
        loader = DataLoader(self.train_set, batch_size=self.args.batch_size, sampler=sampler, drop_last=True)
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from loader

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> tuple[float, float | None]:
        model.eval()
        with torch.no_grad():
            x, y = self.test_set.tensors
            logits = model(x)
            result = float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())
        model.train()
        return result


class Chars(Task):
    """A byte-level transformer language model on the standard library's own source (``shoal.bench.chars``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.train_stream, held_out = chars.load_corpus()
        self.held_out = chars.eval_windows(held_out, args.context, args.eval_windows)

    def model(self) -> nn.Module:
        return chars.CharModel(d_model=self.args.width, layers=2, heads=4, context=self.args.context)

    def batches(self, replicas: int, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(1000 + index)
        while True:
            yield chars.batch(self.train_stream, self.args.batch_size, self.args.context, generator)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return chars.loss(model, x, y)

    def evaluate(self, model: nn.Module) -> tuple[float, float | None]:
        x, y = self.held_out
        return chars.evaluate(model, x, y), None


def train(mode: str, task: Task, args: argparse.Namespace) -> Run:
    """Train one mode on every rank; the same model, data order and budget of samples."""
    alone = mode == "solo"
    replicas, index = (1, 0) if alone else (hvd.size(), hvd.rank())
    torch.manual_seed(0)
    model = task.model()
    workers = 1 if alone else hvd.size()
    lr = args.lr * (workers if mode == "sync" else 1)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if mode == "sync":
        optimizer = hvd.DistributedOptimizer(optimizer, model=model, comm="auto-lossy")
    elif mode == "far":
        options = hvd.LocalSteps(
            every=args.every,
            codec=args.codec,
            budget=args.budget,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            overlap=not args.no_overlap,
            fragments=args.fragments,
            delay=args.delay,
        )
        optimizer = hvd.DistributedOptimizer(optimizer, model=model, comm="local", local_steps=options)
    run = Run()
    per_step = args.batch_size * workers
    steps = args.samples // per_step
    eval_every = max(1, args.eval_every // per_step)
    batches = task.batches(replicas, index)
    hvd.barrier()
    if hvd.rank() == 0:
        print(f"{mode}: training", flush=True)  # for a test that times a fault from here
    before = sent_bytes()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = next(batches)
        optimizer.zero_grad()
        task.loss(model, x, y).backward()
        optimizer.step()
        outer = rounds_of(optimizer)
        if outer is not None and outer.rounds > len(run.round_ends):
            if not run.round_ends:
                run.rounds_sent, run.rounds_samples = sent_bytes(), (steps - step) * per_step
            run.round_ends.append(round(time.time(), 3))
        if step % eval_every == 0 or step == steps:
            if step == steps and mode == "far":
                met = time.perf_counter()
                optimizer.outer_step()  # the hosts meet on the last samples
                run.final_s = time.perf_counter() - met
            run.seconds += time.perf_counter() - start
            loss, accuracy = task.evaluate(model)
            run.curve.append((step * per_step, round(run.seconds, 3), round(loss, 5), accuracy))
            start = time.perf_counter()
    run.samples = steps * per_step
    if not alone:
        hvd.barrier()
    end = sent_bytes()
    run.sent = end - before
    if run.round_ends:
        run.rounds_sent = end - run.rounds_sent
    outer = rounds_of(optimizer)
    if outer is not None and outer.plan is not None:
        run.plan = {
            **outer.plan.as_dict(),
            "rounds": outer.rounds,
            "planning_s": round(outer.planning_s, 3),
            "round_ends_s": round(outer.times.exchange_s, 3),
            "landing_waits_s": round(outer.times.waited_s, 3),
            "replans": [list(change) for change in outer.replans],
            "final_meeting_s": round(run.final_s, 3),
            "round_ends": run.round_ends,
        }
    return run


TASKS.update(digits=Digits, chars=Chars)


def time_to(run: Run, target: float) -> float | None:
    return next((seconds for _, seconds, loss, _ in run.curve if loss <= target), None)


def summed(value: float, name: str) -> float:
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Sum, name=f"far.sum.{name}")[0])


def looks(runs: dict[str, Run], sent: dict[str, float], round_bytes: float | None, alone: list[float]) -> dict[str, Any]:
    """What ``--modes`` prints for a subset of the modes: each mode's seconds, bytes per sample, curve and plan; far's
    ``of_bound`` against the hosts' rates alone when solo ran too."""
    result: dict[str, Any] = {
        mode: {
            "seconds": run.seconds,
            "bytes_per_sample": round(sent[mode] / run.samples, 1),
            "curve": run.curve,
            "plan": run.plan,
        }
        for mode, run in runs.items()
    }
    if round_bytes is not None:
        result["far"]["round_bytes_per_sample"] = round_bytes
    if "solo" in runs and "far" in runs:
        result["far"]["of_bound"] = round(runs["far"].samples / runs["far"].seconds / sum(alone), 3)
        result["solo"]["per_host"] = alone
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.far", description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="digits")
    parser.add_argument("--samples", type=int, default=None, help="samples per mode, over every host (task's default)")
    parser.add_argument("--eval-every", type=int, default=None, help="score the held-out set every this many samples")
    parser.add_argument("--batch-size", type=int, default=None, help="one worker's batch (task's default)")
    parser.add_argument("--lr", type=float, default=None, help="one worker's learning rate (sync: times the hosts)")
    parser.add_argument("--width", type=int, default=None, help="the MLP's hidden width, the transformer's d_model")
    parser.add_argument("--context", type=int, default=64, help="chars: bytes per window")
    parser.add_argument("--eval-windows", type=int, default=256, help="chars: held-out windows scored")
    parser.add_argument("--every", type=int, default=None, help="force H (default: the planner's)")
    parser.add_argument("--codec", choices=[codec.value for codec in Codec], default=None, help="force the codec")
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET, help="the share of a round its exchange's local work may add"
    )
    parser.add_argument("--rate", default="", help="the emulated link's rate, for the record (e.g. 100mbit)")
    parser.add_argument("--outer-lr", type=float, default=LocalSteps.outer_lr, help="the outer step's learning rate")
    parser.add_argument("--outer-momentum", type=float, default=LocalSteps.outer_momentum, help="its Nesterov momentum")
    parser.add_argument("--no-overlap", action="store_true", help="every host waits for each exchange where it is sent")
    parser.add_argument(
        "--fragments", type=int, default=LocalSteps.fragments, help="cut the model into at most this many fragments"
    )
    parser.add_argument("--delay", type=int, default=None, help="force τ, the steps a fragment's exchange overlaps")
    parser.add_argument("--modes", default=",".join(MODES), help="for a quicker look: a comma-separated subset")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    torch.set_num_threads(1)
    hvd.init()
    task = TASKS[args.task](args)
    runs = {mode: train(mode, task, args) for mode in args.modes.split(",")}
    hosts = hvd.size()
    sent = {mode: summed(run.sent, mode) for mode, run in runs.items()}
    far_rounds = runs.get("far")
    rounds_sent = summed(far_rounds.rounds_sent, "far.rounds") if far_rounds is not None else 0.0
    round_bytes = round(rounds_sent / max(far_rounds.rounds_samples, 1), 1) if far_rounds is not None else None
    solo_run = runs.get("solo")
    alone = hvd.allgather_object(round(solo_run.samples / solo_run.seconds, 1) if solo_run is not None else 0.0)
    if hvd.rank() != 0:
        hvd.shutdown()
        return
    for mode, run in runs.items():
        print(
            f"{mode:>5}: {run.samples / run.seconds:8.0f} samples/s, "
            + ", ".join(f"{s}:{loss:.3f}" for s, _, loss, _ in run.curve)
        )
    if set(runs) != set(MODES):  # a look at some modes: no comparison
        print(json.dumps(looks(runs, sent, round_bytes, alone)))
        hvd.shutdown()
        return
    solo, sync, far = runs["solo"], runs["sync"], runs["far"]
    target = round(sync.curve[-1][2] * 1.01, 5)
    ips = {mode: run.samples / run.seconds for mode, run in runs.items()}
    bound = sum(alone)  # each host alone at once, under the same sharing of the machine
    entries = sum(p.numel() for p in task.model().parameters())
    result: dict[str, Any] = {
        "bench": "far",
        "hosts": hosts,
        "rate": args.rate,
        "task": args.task,
        "samples": args.samples,
        "far_ips": round(ips["far"], 1),
        "sync_ips": round(ips["sync"], 1),
        "solo_ips": round(ips["solo"], 1),
        "solo_ips_per_host": alone,
        "bound_ips": round(bound, 1),
        "of_bound": round(ips["far"] / bound, 3),
        "of_bound_without_last_meeting": round(far.samples / (far.seconds - far.final_s) / bound, 3),
        "far_bytes_per_sample": round(sent["far"] / far.samples, 1),
        "far_round_bytes_per_sample": round_bytes,
        "sync_bytes_per_sample": round(sent["sync"] / sync.samples, 1),
        "allreduce_bytes_per_sample": round(2 * (hosts - 1) * 4 * entries / (args.batch_size * hosts), 1),
        "far_time_to_target_s": time_to(far, target),
        "sync_time_to_target_s": time_to(sync, target),
        "solo_time_to_target_s": time_to(solo, target),
        "far_eval_loss": round(far.curve[-1][2], 5),
        "sync_eval_loss": round(sync.curve[-1][2], 5),
        "solo_eval_loss": round(solo.curve[-1][2], 5),
        "target": target,
        "far_accuracy": far.curve[-1][3],
        "sync_accuracy": sync.curve[-1][3],
        "plan": far.plan,
    }
    emit(result, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
