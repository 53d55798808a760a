"""Training throughput: Shoal's DistributedOptimizer against DDP, same model, data and seed, in one invocation.

Run: ``shoalrun -np 2 python -m shoal.bench.train --model mlp --compare ddp``. Prints per-phase lines, then (rank
0) one JSON line: ``{"bench":"train","model":..,"world":..,"shoal_ips":..,"ddp_ips":..,"ratio":..,"bound_ips":..,
"of_bound":..,"solo_ips":..}`` where ips counts images (or sequences) per second over all workers, ``ratio`` =
shoal_ips / ddp_ips, ``bound_ips`` is every rank training at the same time with no communication at all (the
machine's limit for this model: ranks share memory bandwidth and caches), ``of_bound`` = shoal_ips / bound_ips, and
``solo_ips`` is one process training alone (the other ranks wait). ``bare_reduce_ms`` is one Average allreduce of
all the gradient bytes with nothing else running, and ``no_overlap_ips`` the bound's step plus that reduction: the
best a step can do when every core is busy computing, so the reduction cannot hide under backward.
``--lockstep-bound`` adds ``lockstep_ips`` and ``of_lockstep``: the bound with the ranks meeting after each backward
pass (a one-element allreduce), as a synchronous job's ranks must, so that their memory-bound updates coincide.
``--compare-copying`` adds ``copying_ips`` and ``shared_gain`` (= shoal_ips / copying_ips): a second Shoal job in
the same rounds whose gradients are copied to be reduced instead of living in shared memory. ``--compare
ddp,ddp-powersgd`` also runs DDP with torch's PowerSGD hook at ``--rank``: ``ddp_powersgd_ips`` and
``powersgd_ratio`` (= shoal_ips / ddp_powersgd_ips). ``--comm auto-lossy`` lets the plan compress (PowerSGD up to
``--rank``, top-k) after ``--lossy-warmup`` steps. ``--compare-comm C`` adds a second Shoal job with comm C in the
same rounds: ``other_ips`` and ``comm_ratio`` (= shoal_ips / other_ips). ``--zero-grad zeros`` makes every phase's
``zero_grad`` fill gradients with zeros instead of setting them to None. ``--profile`` then times one more Shoal
phase with a timeline and prints where a step's time goes. ``barrier_us`` is the shared-memory barrier's round trip
before the phases and after them (``shoal.bench.barrier_us``: whether the ranks' cores shared a cache during the
run; null without shared memory).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import shoal.torch as hvd
from shoal.bench import add_json_flag, barrier_us, emit
from shoal.comm.baselines import wrap_ddp, wrap_ddp_powersgd
from shoal.config import env_name
from shoal.core import session as handles
from shoal.plan.planner import median_error
from shoal.plan.schemes import COMM_CHOICES, Compressed, Planned, parse_comm, row_of
from shoal.predict.models import build, parameter_count
from shoal.ps.config import resolve_config
from shoal.torch.compression import Compressor
from shoal.torch.layer_comm.report import last_plan
from shoal.torch.layer_comm.schemes import SufficientFactors
from shoal.torch.optimizer import router_of


def _batches(model_name: str, batch_size: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234 + hvd.rank())
    _, make_input = build(model_name)
    return [(make_input(batch_size, generator), torch.randint(0, 10, (batch_size,), generator=generator)) for _ in range(count)]


def _timed_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
    steps: int,
    sync: Callable[[], None],
    after_backward: Callable[[], None] | None = None,
    set_to_none: bool = True,
) -> float:
    """Seconds for ``steps`` training steps after ``warmup`` ones (the slowest rank's time when ``sync`` syncs);
    each step starts with ``zero_grad(set_to_none)``."""
    loss_fn = nn.CrossEntropyLoss()

    def step(index: int) -> None:
        x, y = batches[index % len(batches)]
        optimizer.zero_grad(set_to_none=set_to_none)
        loss_fn(model(x), y).backward()
        if after_backward is not None:
            after_backward()
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


def _shoal_model(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The benchmark model under Shoal's DistributedOptimizer with ``args.comm``, rank 0's weights everywhere."""
    torch.manual_seed(0)
    model, _ = build(args.model)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        model=model,
        comm=args.comm,
        compression=_compression(args),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, optimizer


def _compression(args: argparse.Namespace) -> type[Compressor] | Compressed:
    """The compressed schemes' settings for ``--comm`` (their warm-up and PowerSGD's rank), else none."""
    row, planned = row_of(parse_comm(args.comm)), args.comm == Planned.AUTO_LOSSY
    if planned or (row is not None and row.ranked):  # auto-lossy: the plan picks each layer's rank up to --rank
        return hvd.Compression.powersgd(rank=None if planned else args.rank, max_rank=args.rank, warmup_steps=args.lossy_warmup)
    if row is not None and row.error_feedback:
        return Compressed(row.scheme, warmup_steps=args.lossy_warmup)
    return hvd.Compression.none


def run_shoal(
    args: argparse.Namespace,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    job: tuple[nn.Module, torch.optim.Optimizer] | None = None,
    shared_gradients: bool = True,
) -> float:
    """Images per second over all workers with Shoal's DistributedOptimizer: ``job``'s model and optimizer (a
    training job that goes on from the previous phase), or new ones. ``shared_gradients=False``: the job's
    gradients stay where autograd puts them (the setting is read when the job adopts them, after its first step)."""
    model, optimizer = job if job is not None else _shoal_model(args)
    config = handles.engine().config
    setting, config.shared_gradients = config.shared_gradients, shared_gradients and config.shared_gradients
    try:
        elapsed = _slowest(
            _timed_steps(model, optimizer, batches, args.warmup, args.steps, hvd.barrier, set_to_none=args.set_to_none)
        )
    finally:
        config.shared_gradients = setting
    if args.comm in tuple(Planned):
        hvd.plan_report()  # rank 0 prints it
    return hvd.size() * args.batch_size * args.steps / elapsed


def run_ddp(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]], powersgd: bool = False) -> float:
    """Images per second over all workers with torch's DistributedDataParallel (``powersgd``: with its PowerSGD
    hook at ``--rank``, compressing from the second of the phase's untimed warm-up steps on)."""
    torch.manual_seed(0)
    model, _ = build(args.model)
    ddp_model = wrap_ddp_powersgd(model, args.rank) if powersgd else wrap_ddp(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    elapsed = _slowest(
        _timed_steps(ddp_model, optimizer, batches, args.warmup, args.steps, hvd.barrier, set_to_none=args.set_to_none)
    )
    return hvd.size() * args.batch_size * args.steps / elapsed


def run_profiled(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """One more Shoal phase with a timeline on every rank; rank 0 returns where a step's time went."""
    from shoal.timeline import hidden_share, load_trace, step_profile

    model, optimizer = _shoal_model(args)
    _timed_steps(
        model, optimizer, batches, args.warmup, 0, hvd.barrier, set_to_none=args.set_to_none
    )  # warm up outside the timeline
    with tempfile.TemporaryDirectory(prefix="shoal-profile-") as directory:
        shared = hvd.broadcast_object(directory, root_rank=0, name="bench.train.profile_dir")  # one host: rank 0's
        hvd.start_timeline(os.path.join(shared, "tl-{rank}.json"))
        _timed_steps(model, optimizer, batches, 0, args.steps, hvd.barrier, set_to_none=args.set_to_none)
        hvd.stop_timeline()
        hvd.barrier()
        lines: list[str] = []
        if hvd.rank() == 0:
            files = [os.path.join(shared, f"tl-{rank}.json") for rank in range(hvd.size())]
            trace = load_trace([f for f in files if os.path.exists(f)])
            profile = step_profile(trace, 0)
            lines = profile.lines(0) if profile is not None else ["no optimizer steps in the profile timeline"]
            shares = hidden_share(trace)
            if 0 in shares:
                lines.append(f"collectives hidden under backward on rank 0: {shares[0][1]:.0%}")
            rebuilds = [c for c in router_of(optimizer).layers() if isinstance(c, SufficientFactors)]
            if rebuilds:
                total = sum(c.rebuild_seconds for c in rebuilds) * 1e3
                lines.append(f"SFB gradient rebuilds, last step: {total:.2f} ms over {len(rebuilds)} layers")
        hvd.barrier()  # rank 0 has read the files before the directory goes
    return lines


def run_bound(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]], lockstep: bool = False) -> float:
    """Images per second over all workers when every rank trains at once with no communication (the bound).

    ``lockstep``: no gradient bytes either, but the ranks meet after each backward pass (one one-element allreduce,
    the least a synchronous job exchanges), so that their updates and forward passes run at the same time, as in any
    synchronous data-parallel job.
    """
    torch.manual_seed(0)
    model, _ = build(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    token = torch.zeros(1)

    def meet() -> None:
        hvd.allreduce_(token, op=hvd.Sum, name="bench.train.lockstep")

    elapsed = _timed_steps(
        model, optimizer, batches, args.warmup, args.steps, hvd.barrier, meet if lockstep else None, args.set_to_none
    )
    return hvd.size() * args.batch_size * args.steps / _slowest(elapsed)


def bare_reduce_seconds(args: argparse.Namespace, repeats: int = 10) -> float:
    """Median seconds of one Average allreduce of all the model's gradient bytes at once, nothing else running."""
    model, _ = build(args.model)
    flat = torch.zeros(sum(p.numel() for p in model.parameters() if p.requires_grad))
    samples = []
    for index in range(repeats + 2):
        hvd.barrier()
        start = time.perf_counter()
        hvd.allreduce_(flat, op=hvd.Average, name="bench.train.bare_reduce")
        if index >= 2:  # two warm-ups (the first negotiates the name)
            samples.append(time.perf_counter() - start)
    return _slowest(sorted(samples)[len(samples) // 2])


def run_solo(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Images per second of rank 0 training alone (no communication) while the other ranks wait."""
    ips = 0.0
    if hvd.rank() == 0:
        torch.manual_seed(0)
        model, _ = build(args.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        elapsed = _timed_steps(model, optimizer, batches, args.warmup, args.steps, lambda: None, set_to_none=args.set_to_none)
        ips = args.batch_size * args.steps / elapsed
    hvd.barrier()
    return ips


def run_autotuned(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """Train under autotune until every rank froze the best setting, then time the same steps as ``run_shoal``.

    Returns (images per second with the frozen setting, tuning steps it took).
    """
    torch.manual_seed(0)
    model, _ = build(args.model)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = nn.CrossEntropyLoss()
    tuning_steps = 0
    while True:  # the ranks agree on when the tuning is over, so that all start the timed phase together
        frozen = float(bool(handles.engine().autotune_frozen))
        if hvd.allreduce(torch.tensor([frozen]), op=hvd.Min, name="bench.train.frozen").item() > 0:
            break
        x, y = batches[tuning_steps % len(batches)]
        optimizer.zero_grad(set_to_none=args.set_to_none)
        loss_fn(model(x), y).backward()
        optimizer.step()
        tuning_steps += 1
    elapsed = _slowest(
        _timed_steps(model, optimizer, batches, args.warmup, args.steps, hvd.barrier, set_to_none=args.set_to_none)
    )
    return hvd.size() * args.batch_size * args.steps / elapsed, tuning_steps


def _report_bound(result: dict[str, object], key: str, what: str, runs: list[float], shoal_ips: float) -> float:
    """Print a bound's rounds and Shoal's share of the best; record ``<key>_ips`` and ``of_<key>``."""
    best = max(runs)
    print(f"{what}: {', '.join(f'{v:.1f}' for v in runs)} img/s; Shoal reaches {shoal_ips / best:.1%} of it")
    result[f"{key}_ips"] = round(best, 1)
    result[f"of_{key}"] = round(shoal_ips / best, 3)
    return best


BASELINES = ("ddp", "ddp-powersgd")


def _baselines(value: str) -> tuple[str, ...]:
    """``--compare``'s list."""
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    if names == ("none",):
        return ()
    unknown = [name for name in names if name not in BASELINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown baseline {unknown or value!r}; choose from {', '.join(BASELINES)} or none")
    return names


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.train", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["cnn", "mlp", "transformer"], default="mlp")
    parser.add_argument(
        "--compare",
        type=_baselines,
        default=("ddp",),
        help="baselines to run in the same invocation, comma-separated: ddp, ddp-powersgd (torch's PowerSGD hook at "
        "--rank), or none (default ddp)",
    )
    parser.add_argument(
        "--rank", type=int, default=4, help="PowerSGD's rank: DDP's hook, Shoal's powersgd, auto-lossy's bound (default 4)"
    )
    parser.add_argument(
        "--lossy-warmup",
        type=int,
        default=0,
        help="Shoal's steps before compressing (--comm powersgd, topk, auto-lossy; default 0: the rates are steady-state)",
    )
    parser.add_argument("--comm", choices=COMM_CHOICES, default="allreduce", help="how Shoal communicates gradients")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per phase (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each phase (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating Shoal/DDP rounds; the best of each is kept")
    parser.add_argument(
        "--autotune", action="store_true", help="then autotune (needs optuna) and time the frozen setting against the defaults"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then time one more Shoal phase with a timeline and print where a step's time goes",
    )
    parser.add_argument(
        "--lockstep-bound",
        action="store_true",
        help="each round also time the lockstep bound: no gradient bytes, but the ranks meet after every backward",
    )
    parser.add_argument("--autotune-samples", type=int, default=12, help="scored autotune samples (default 12)")
    parser.add_argument(
        "--compare-copying",
        action="store_true",
        help="each round also time a second Shoal job whose gradients are copied to be reduced (no shared-memory "
        "gradients): copying_ips, shared_gain",
    )
    parser.add_argument(
        "--compare-comm",
        choices=COMM_CHOICES,
        default=None,
        help="each round also time a second Shoal job with this comm: other_ips, comm_ratio (= shoal_ips / other_ips)",
    )
    parser.add_argument(
        "--zero-grad",
        choices=["none", "zeros"],
        default="none",
        help="every phase's zero_grad(): set gradients to None (torch's default) or fill them with zeros",
    )
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.warmup < 3 and "ddp-powersgd" in args.compare:
        parser.error("--compare ddp-powersgd needs --warmup >= 3: torch's hook starts compressing at its second step")
    args.set_to_none = args.zero_grad == "none"
    return args


@dataclass
class Phases:
    """What one invocation measured, for rank 0's report."""

    shoal: list[float]
    ddp: list[float]
    ddp_powersgd: list[float]
    bound: list[float]
    lockstep: list[float]
    copying: list[float]
    other: list[float]
    """A second Shoal job's rates (``--compare-comm``)."""
    plan: Any
    """The main Shoal job's last plan (``comm="auto"`` or ``"auto-lossy"``), or None."""
    solo_ips: float
    reduce_s: float
    profile: list[str]
    tuned: tuple[float, int] | None
    settings: list[object]
    barrier_us: list[float | None]
    """The shared-memory barrier's round trip before the phases and after them (``shoal.bench.barrier_us``)."""


def _report(args: argparse.Namespace, phases: Phases) -> None:
    """Print the figures and the JSON line (rank 0)."""
    model, _ = build(args.model)
    shoal_ips = max(phases.shoal)
    print(
        f"model {args.model} ({parameter_count(model) / 1e6:.1f}M parameters), {hvd.size()} workers, "
        f"batch {args.batch_size} per worker, comm {args.comm}"
    )
    print(f"shoal: {', '.join(f'{v:.1f}' for v in phases.shoal)} img/s")
    result: dict[str, object] = {
        "bench": "train",
        "model": args.model,
        "world": hvd.size(),
        "comm": args.comm,
        "zero_grad": args.zero_grad,
        "shoal_ips": round(shoal_ips, 1),
    }
    if (row := row_of(parse_comm(args.comm))) is not None and row.on_servers:  # co-located unless shoalrun started servers
        config = resolve_config()
        result["ps_mode"] = config.mode
        result["ps_servers"] = config.num_servers if config.dedicated else hvd.size()
        result["ps_dedicated"] = config.dedicated
    plan = phases.plan
    if args.comm in tuple(Planned) and plan is not None:
        error = median_error(plan.plans)
        result["plan_median_error"] = round(error, 3) if error is not None else None
        result["plan_choices"] = dict(Counter(p.choice.value + (f"@{p.rank}" if p.rank else "") for p in plan.plans))
        result["plan_refits"] = plan.refits
    if phases.ddp:
        print(f"ddp:   {', '.join(f'{v:.1f}' for v in phases.ddp)} img/s")
        result["ddp_ips"] = round(max(phases.ddp), 1)
        result["ratio"] = round(shoal_ips / max(phases.ddp), 3)
    if phases.ddp_powersgd:
        print(f"ddp with torch's PowerSGD hook (rank {args.rank}): {', '.join(f'{v:.1f}' for v in phases.ddp_powersgd)} img/s")
        result["ddp_powersgd_ips"] = round(max(phases.ddp_powersgd), 1)
        result["powersgd_ratio"] = round(shoal_ips / max(phases.ddp_powersgd), 3)
    if phases.other:
        print(f"shoal with comm {args.compare_comm}: {', '.join(f'{v:.1f}' for v in phases.other)} img/s")
        result["other_comm"] = args.compare_comm
        result["other_ips"] = round(max(phases.other), 1)
        result["comm_ratio"] = round(shoal_ips / max(phases.other), 3)
    if phases.copying:
        print(f"copying gradients: {', '.join(f'{v:.1f}' for v in phases.copying)} img/s")
        result["copying_ips"] = round(max(phases.copying), 1)
        result["shared_gain"] = round(shoal_ips / max(phases.copying), 3)
    if phases.tuned is not None:
        print(f"autotuned: {phases.tuned[0]:.1f} img/s after {phases.tuned[1]} tuning steps (settings {phases.settings})")
        result["autotuned_ips"] = round(phases.tuned[0], 1)
        result["autotune_ratio"] = round(phases.tuned[0] / shoal_ips, 3)
        result["autotune_settings"] = phases.settings
    bound_ips = _report_bound(result, "bound", "bound (all ranks, no communication)", phases.bound, shoal_ips)
    if phases.lockstep:
        what = "lockstep bound (no gradient bytes, ranks meet after each backward)"
        _report_bound(result, "lockstep", what, phases.lockstep, shoal_ips)
    # With every core busy computing, the reduction cannot hide: the best step is then the bound's plus one
    # bare reduction of all gradients (a figure, not an upper limit, where cores are left free).
    step_s = hvd.size() * args.batch_size / bound_ips
    no_overlap_ips = hvd.size() * args.batch_size / (step_s + phases.reduce_s)
    print(
        f"bare Average allreduce of all gradients: {phases.reduce_s * 1e3:.2f} ms; bound step {step_s * 1e3:.2f} ms; "
        f"without overlap {no_overlap_ips:.1f} img/s, Shoal {shoal_ips / no_overlap_ips:.1%} of that"
    )
    result["bare_reduce_ms"] = round(phases.reduce_s * 1e3, 3)
    result["no_overlap_ips"] = round(no_overlap_ips, 1)
    print(f"solo (1 process, no communication): {phases.solo_ips:.1f} img/s")
    result["solo_ips"] = round(phases.solo_ips, 1)
    result["barrier_us"] = phases.barrier_us
    if phases.profile:
        print("profile (one more Shoal phase, timed with a timeline on every rank):")
        for line in phases.profile:
            print(f"  {line}")
    emit(result, args.json)


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run the phases, print the JSON line."""
    args = _parse(argv)
    torch.set_num_threads(1)
    hvd.init()
    placement = [barrier_us()]
    batches = _batches(args.model, args.batch_size, 4)
    shoal_runs, ddp_runs, powersgd_runs, bound_runs, lockstep_runs, copying_runs, other_runs = [], [], [], [], [], [], []
    # One Shoal training job across the rounds, as in real training: comm="auto" plans (and may refit) once, in the
    # first round, and later rounds run the plan it settled on.
    shoal_job = _shoal_model(args)
    copying_job = _shoal_model(args) if args.compare_copying else None
    other_args = argparse.Namespace(**{**vars(args), "comm": args.compare_comm})
    other_job = _shoal_model(other_args) if args.compare_comm else None
    plan = None
    for round_number in range(args.rounds):  # alternating, so that a slow spell of the machine hits each alike
        shoal_runs.append(run_shoal(args, batches, shoal_job))
        plan = last_plan()  # this job's (the other job plans too)
        if other_job is not None:
            other_runs.append(run_shoal(other_args, batches, other_job))
        if copying_job is not None:
            copying_runs.append(run_shoal(args, batches, copying_job, shared_gradients=False))
        if "ddp" in args.compare:
            ddp_runs.append(run_ddp(args, batches))
        if "ddp-powersgd" in args.compare:
            powersgd_runs.append(run_ddp(args, batches, powersgd=True))
        bound_runs.append(run_bound(args, batches))
        if args.lockstep_bound:
            lockstep_runs.append(run_bound(args, batches, lockstep=True))
        if hvd.rank() == 0:  # progress: each round as it ends
            ddp = f", ddp {ddp_runs[-1]:.1f}" if ddp_runs else ""
            ddp += f", ddp-powersgd {powersgd_runs[-1]:.1f}" if powersgd_runs else ""
            lockstep = f", lockstep bound {lockstep_runs[-1]:.1f}" if lockstep_runs else ""
            copying = f", copying gradients {copying_runs[-1]:.1f}" if copying_runs else ""
            copying += f", shoal with comm {args.compare_comm} {other_runs[-1]:.1f}" if other_runs else ""
            print(
                f"round {round_number + 1}/{args.rounds}: shoal {shoal_runs[-1]:.1f}{copying}{ddp}, no-communication bound "
                f"{bound_runs[-1]:.1f}{lockstep} img/s",
                flush=True,
            )
    solo_ips = run_solo(args, batches)
    reduce_s = bare_reduce_seconds(args)
    placement.append(barrier_us())
    profile = run_profiled(args, batches) if args.profile else []
    tuned: tuple[float, int] | None = None
    settings: list[object] = []
    if args.autotune:  # re-init under autotune, in the same invocation as the default-settings rounds above
        hvd.shutdown()
        os.environ.update({env_name("AUTOTUNE"): "1", env_name("AUTOTUNE_BAYES_OPT_MAX_SAMPLES"): str(args.autotune_samples)})
        hvd.init()
        tuned = run_autotuned(args, batches)
        engine = handles.engine()
        settings = [engine.tuned.fusion_threshold_bytes, round(engine.tuned.cycle_time_ms, 3), engine.tuned.bucket_bytes]
        shoal_runs.append(run_shoal(args, batches))  # the defaults once more, after tuning, as a drift check
    if hvd.rank() == 0:
        _report(
            args,
            Phases(
                shoal_runs,
                ddp_runs,
                powersgd_runs,
                bound_runs,
                lockstep_runs,
                copying_runs,
                other_runs,
                plan,
                solo_ips,
                reduce_s,
                profile,
                tuned,
                settings,
                placement,
            ),
        )
    hvd.shutdown()


if __name__ == "__main__":
    main()
