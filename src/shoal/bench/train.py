"""Training throughput: Shoal's DistributedOptimizer against DDP, same model, data and seed, in one invocation.

Run: ``shoalrun -np 2 python -m shoal.bench.train --model mlp --compare ddp``. Prints per-phase lines, then (rank
0) one JSON line: ``{"bench":"train","model":..,"world":..,"shoal_ips":..,"ddp_ips":..,"ratio":..,"solo_ips":..}``
where ips counts images (or sequences) per second over all workers and ``ratio`` = shoal_ips / ddp_ips.
``solo_ips`` is one process training alone with no communication (the other ranks wait).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

import shoal.torch as hvd
from shoal.bench import add_json_flag, emit
from shoal.bench.models import build, parameter_count
from shoal.comm.baselines import wrap_ddp
from shoal.plan.planner import median_error
from shoal.ps.config import resolve_config
from shoal.torch.layer_comm.router import last_plan

COMM_CHOICES = ("allreduce", "fp16", "bf16", "sfb", "ps", "auto")


def _batches(model_name: str, batch_size: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234 + hvd.rank())
    _, make_input = build(model_name)
    return [(make_input(batch_size, generator), torch.randint(0, 10, (batch_size,), generator=generator))
            for _ in range(count)]  # fmt: skip


def _timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 warmup: int, steps: int, sync: Callable[[], None]) -> float:  # fmt: skip
    """Seconds for ``steps`` training steps after ``warmup`` ones (the slowest rank's time when ``sync`` syncs)."""
    loss_fn = nn.CrossEntropyLoss()

    def step(index: int) -> None:
        x, y = batches[index % len(batches)]
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    for index in range(warmup):
        step(index)
    sync()
    start = time.perf_counter()
    for index in range(steps):
        step(index)
    sync()
    return time.perf_counter() - start


def _slowest(seconds: float) -> float:
    return float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="bench.train.elapsed").item())


def run_shoal(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Images per second over all workers with Shoal's DistributedOptimizer."""
    torch.manual_seed(0)
    model, _ = build(args.model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters(), model=model,
                                         comm=args.comm)  # fmt: skip
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elapsed = _slowest(_timed_steps(model, optimizer, batches, args.warmup, args.steps, hvd.barrier))
    if args.comm == "auto":
        hvd.plan_report()  # rank 0 prints it
    return hvd.size() * args.batch_size * args.steps / elapsed


def run_ddp(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Images per second over all workers with torch's DistributedDataParallel."""
    torch.manual_seed(0)
    model, _ = build(args.model)
    ddp_model = wrap_ddp(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    elapsed = _slowest(_timed_steps(ddp_model, optimizer, batches, args.warmup, args.steps, hvd.barrier))
    return hvd.size() * args.batch_size * args.steps / elapsed


def run_solo(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Images per second of rank 0 training alone (no communication) while the other ranks wait."""
    ips = 0.0
    if hvd.rank() == 0:
        torch.manual_seed(0)
        model, _ = build(args.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        elapsed = _timed_steps(model, optimizer, batches, args.warmup, args.steps, lambda: None)
        ips = args.batch_size * args.steps / elapsed
    hvd.barrier()
    return ips


def run_autotuned(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """Train under autotune until every rank froze the best setting, then time the same steps as ``run_shoal``.

    Returns (images per second with the frozen setting, tuning steps it took).
    """
    from shoal.torch import handles

    torch.manual_seed(0)
    model, _ = build(args.model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters())  # fmt: skip
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = nn.CrossEntropyLoss()
    tuning_steps = 0
    while True:  # the ranks agree on when the tuning is over, so that all start the timed phase together
        frozen = float(bool(handles.engine().autotune_frozen))
        if hvd.allreduce(torch.tensor([frozen]), op=hvd.Min, name="bench.train.frozen").item() > 0:
            break
        x, y = batches[tuning_steps % len(batches)]
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        tuning_steps += 1
    elapsed = _slowest(_timed_steps(model, optimizer, batches, args.warmup, args.steps, hvd.barrier))
    return hvd.size() * args.batch_size * args.steps / elapsed, tuning_steps


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run the phases, print the JSON line."""
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.train", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["cnn", "mlp", "transformer"], default="mlp")
    parser.add_argument("--compare", choices=["ddp", "none"], default="ddp", help="baseline to run in the same invocation")
    parser.add_argument("--comm", choices=COMM_CHOICES, default="allreduce", help="how Shoal communicates gradients")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per phase (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each phase (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating Shoal/DDP rounds; the best of each is kept")
    parser.add_argument("--autotune", action="store_true",
                        help="then autotune (needs optuna) and time the frozen setting against the defaults")  # fmt: skip
    parser.add_argument("--autotune-samples", type=int, default=12, help="scored autotune samples (default 12)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    batches = _batches(args.model, args.batch_size, 4)
    shoal_runs, ddp_runs = [], []
    for round_number in range(args.rounds):
        shoal_runs.append(run_shoal(args, batches))
        if args.compare == "ddp":
            ddp_runs.append(run_ddp(args, batches))
        if hvd.rank() == 0:  # progress: each round as it ends
            ddp = f", ddp {ddp_runs[-1]:.1f} img/s" if ddp_runs else ""
            print(f"round {round_number + 1}/{args.rounds}: shoal {shoal_runs[-1]:.1f} img/s{ddp}", flush=True)
    solo_ips = run_solo(args, batches)
    tuned: tuple[float, int] | None = None
    settings: list[object] = []
    if args.autotune:  # re-init under autotune, in the same invocation as the default-settings rounds above
        hvd.shutdown()
        os.environ.update(SHOAL_AUTOTUNE="1", SHOAL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES=str(args.autotune_samples))
        hvd.init()
        tuned = run_autotuned(args, batches)
        from shoal.torch import handles

        engine = handles.engine()
        settings = [engine.config.fusion_threshold_bytes, round(engine.config.cycle_time_ms, 3), engine.tuned_bucket_bytes]
        shoal_runs.append(run_shoal(args, batches))  # the defaults once more, after tuning, as a drift check
    if hvd.rank() == 0:
        model, _ = build(args.model)
        shoal_ips = max(shoal_runs)
        print(f"model {args.model} ({parameter_count(model) / 1e6:.1f}M parameters), {hvd.size()} workers, "
              f"batch {args.batch_size} per worker, comm {args.comm}")  # fmt: skip
        print(f"shoal: {', '.join(f'{v:.1f}' for v in shoal_runs)} img/s")
        result: dict[str, object] = {"bench": "train", "model": args.model, "world": hvd.size(), "comm": args.comm,
                                     "shoal_ips": round(shoal_ips, 1)}  # fmt: skip
        if args.comm == "ps":  # co-located (a server thread in every worker) unless shoalrun started servers
            config = resolve_config()
            result["ps_mode"] = config.mode
            result["ps_servers"] = config.num_servers if config.dedicated else hvd.size()
            result["ps_dedicated"] = config.dedicated
        plan = last_plan()
        if args.comm == "auto" and plan is not None:
            error = median_error(plan.plans)
            result["plan_median_error"] = round(error, 3) if error is not None else None
            result["plan_choices"] = dict(Counter(p.choice for p in plan.plans))
            result["plan_refits"] = plan.refits
        if ddp_runs:
            print(f"ddp:   {', '.join(f'{v:.1f}' for v in ddp_runs)} img/s")
            result["ddp_ips"] = round(max(ddp_runs), 1)
            result["ratio"] = round(shoal_ips / max(ddp_runs), 3)
        if tuned is not None:
            print(f"autotuned: {tuned[0]:.1f} img/s after {tuned[1]} tuning steps (settings {settings})")
            result["autotuned_ips"] = round(tuned[0], 1)
            result["autotune_ratio"] = round(tuned[0] / shoal_ips, 3)
            result["autotune_settings"] = settings
        print(f"solo (1 process, no communication): {solo_ips:.1f} img/s")
        result["solo_ips"] = round(solo_ips, 1)
        emit(result, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
