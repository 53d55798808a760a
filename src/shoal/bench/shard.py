"""Sharded optimizer state (``DistributedOptimizer(shard=...)``, ZeRO stages 1 and 2) against the same job unsharded,
DDP, and torch's own ZeRO stage 1 (``ZeroRedundancyOptimizer`` under DDP), with Adam, in one invocation.

Run: ``shoalrun -np 2 python -m shoal.bench.shard --model mlp``. Every phase trains the same model from the same
weights on the same batches. Rank 0 prints one JSON line: ``{"bench":"shard","model":..,"world":..,"phases":{name:
{"ips":..,"state_bytes":..,"grad_bytes":..,"peak_bytes":..,"held_bytes":..,"sent_bytes_per_step":..,"max_abs_diff":..}},
"solo_ips":..,...}``. Per phase (the best of ``--rounds`` rounds, the phases alternating):

- ``ips``: samples per second over all workers;
- ``state_bytes``: the largest optimizer state any rank holds (its tensors' bytes);
- ``grad_bytes``: the largest gradient bytes a rank holds once the step's reduction is done (before the update);
- ``peak_bytes``: the largest rise of a rank's resident memory during the phase (Linux's peak resident size,
  restarted before it), and ``held_bytes`` the rise still held after its last step (``--only`` runs one phase in
  the job, so that neither owes anything to the phases before it);
- for Shoal's phases, ``predicted_held_bytes`` and ``predicted_peak_bytes`` (``shoal.plan.memory``'s prediction
  for the option, with the top level's ``activation_bytes``: what one plain forward and backward pass held beyond
  its parameters and gradients, measured first) and ``held_error``, ``peak_error`` (prediction / measurement - 1);
- ``sent_bytes_per_step``: the most bytes a rank's network namespace sent per timed step, loopback aside (under
  ``shoal.bench.netns``, the bytes between hosts; 0 on one host);
- ``max_abs_diff``: the largest difference of the phase's final weights from the unsharded Shoal phase's.

``solo_ips`` is one process training alone (the others wait); ``<phase>_ratio`` keys give each phase's ips over
DDP's and ``<phase>_state_share`` its state bytes over DDP's (with every phase run; null or absent with
``--only``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import shoal.torch as hvd
from shoal.bench import add_json_flag, emit
from shoal.bench.far import sent_bytes
from shoal.comm.baselines import wrap_ddp, wrap_zero_ddp
from shoal.config import worker_setting
from shoal.plan.memory import estimate
from shoal.predict.models import build, parameter_count
from shoal.torch.sharding.memory import model_memory

PHASES = ("ddp", "torch_zero1", "shoal", "shoal_optimizer", "shoal_gradients")
"""Every phase, in the order they run: the baselines first, then Shoal unsharded and at stages 1 and 2."""
LR = 1e-3


def _build(name: str) -> tuple[nn.Module, Callable[[int, torch.Generator], torch.Tensor]]:
    """The benchmark's model: one of ``shoal.predict.models``, or ``wide-mlp``, an MLP of 33.6M parameters (134 MB in
    fp32) on 4096 inputs, whose state outweighs the process's own memory (for ``peak_bytes``)."""
    if name != "wide-mlp":
        return build(name)
    layers = [nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)]
    return nn.Sequential(*layers), lambda n, g: torch.randn(n, 4096, generator=g)


def _batches(model_name: str, batch_size: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234 + hvd.rank())
    _, make_input = _build(model_name)
    return [(make_input(batch_size, generator), torch.randint(0, 10, (batch_size,), generator=generator)) for _ in range(count)]


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the optimizer state this rank holds (for a sharded one, its shards' state only)."""
    shards = getattr(optimizer, "_shoal_shards", None)
    inner = shards.inner if shards is not None else getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer
    return _tensor_bytes(t for state in inner.state.values() for t in state.values())


def _grad_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The gradient bytes this rank holds: the parameters' and, sharded, its shards'."""
    shards = getattr(optimizer, "_shoal_shards", None)
    held = _tensor_bytes(p.grad for p in model.parameters())
    return held + (_tensor_bytes(s.grad for s in shards.shards) if shards is not None else 0)


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    wait: Callable[[], None],
) -> tuple[float, int, int]:
    """Seconds for the timed steps (the slowest rank's) after the warm-up ones, the gradient bytes held after the
    last step's reduction, and the bytes this rank's host sent during the timed steps."""
    loss_fn = nn.CrossEntropyLoss()
    grad_bytes = 0
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            hvd.barrier()
            start, sent = time.perf_counter(), sent_bytes()
        x, y = batches[index % len(batches)]
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        wait()
        grad_bytes = _grad_bytes(model, optimizer)
        with getattr(optimizer, "skip_synchronize", contextlib.nullcontext)():  # Shoal's: wait() synchronized it
            optimizer.step()
    elapsed, sent = time.perf_counter() - start, sent_bytes() - sent
    hvd.barrier()
    elapsed = float(hvd.allreduce(torch.tensor([elapsed]), op=hvd.Max, name="bench.shard.t").item())
    return elapsed, grad_bytes, sent


def _memory_mark() -> int:
    """Give freed memory back to the system and restart the peak resident size here; return the resident bytes now
    (what a phase's peak is measured above). Linux: ``malloc_trim`` and ``/proc/self/clear_refs``."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident size
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_phase(name: str, args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """One phase: the model from seed 0, its optimizer as ``name`` says, trained; its figures and final weights."""
    base = _memory_mark()
    torch.manual_seed(0)
    model, _ = _build(args.model)
    wait: Callable[[], None] = lambda: None  # noqa: E731
    if name == "ddp":
        model = wrap_ddp(model)
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    elif name == "torch_zero1":
        model, optimizer = wrap_zero_ddp(model, torch.optim.Adam, lr=LR)
    else:
        shard = {"shoal": None, "shoal_optimizer": "optimizer", "shoal_gradients": "gradients"}[name]
        optimizer = hvd.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=LR), named_parameters=model.named_parameters(), shard=shard
        )
        wait = optimizer.synchronize  # type: ignore[attr-defined]
    elapsed, grad_bytes, sent = _train(model, optimizer, batches, args, wait)
    peak_bytes, held_bytes = _status_bytes("VmHWM") - base, _status_bytes("VmRSS") - base
    state_bytes = _state_bytes(optimizer)
    figures = torch.tensor([state_bytes, grad_bytes, peak_bytes, held_bytes, sent / args.steps], dtype=torch.float64)
    state_bytes, grad_bytes, peak_bytes, held_bytes, sent_per_step = (
        int(v) for v in hvd.allreduce(figures, op=hvd.Max, name=f"bench.shard.{name}.bytes")
    )
    if name.startswith("shoal"):  # what shoal.plan.memory predicts for this option, against what was measured
        option = {"shoal": "none", "shoal_optimizer": "optimizer", "shoal_gradients": "gradients"}[name]
        bucket_bytes = worker_setting("bucket_bytes")
        memory = model_memory(optimizer, bucket_bytes, hvd.local_size(), args.activation_bytes)
        predicted = estimate(memory, hvd.size(), option)
        extra = {"predicted_held_bytes": predicted.held, "held_error": predicted.held / max(held_bytes, 1) - 1}
        extra |= {"predicted_peak_bytes": predicted.peak, "peak_error": predicted.peak / max(peak_bytes, 1) - 1}
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ips = hvd.size() * args.batch_size * args.steps / elapsed
    return {
        "ips": ips,
        "state_bytes": state_bytes,
        "grad_bytes": grad_bytes,
        "peak_bytes": peak_bytes,
        "held_bytes": held_bytes,
        "sent_bytes_per_step": sent_per_step,
        "weights": weights,
        **(extra if name.startswith("shoal") else {}),
    }


def _warm_up(args: argparse.Namespace) -> None:
    """One short unsharded job, so that what the runtime allocates once (the engine's fusion buffer, shared-memory
    slots, torch's first-use caches) is in place before any phase's memory is measured: a phase's ``held_bytes`` and
    ``peak_bytes`` are then what its model and optimizer add."""
    torch.manual_seed(0)
    model, make_input = _build(args.model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters())
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(
            model(make_input(args.batch_size, generator)), torch.zeros(args.batch_size, dtype=torch.long)
        ).backward()
        optimizer.step()
    hvd.allgather(torch.zeros(4), name="bench.shard.warm.allgather")
    hvd.reducescatter(torch.zeros(4), name="bench.shard.warm.reducescatter")


def measure_activations(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """What one plain forward and backward pass holds beyond its parameters and gradients (the activations, and the
    kernels' workspaces), from the rise of this process's peak resident size: the measured step that
    ``shoal.plan.memory`` takes its activations from."""
    base = _memory_mark()
    torch.manual_seed(0)
    model, _ = _build(args.model)
    x, y = batches[0]
    nn.functional.cross_entropy(model(x), y).backward()
    model_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    risen = _status_bytes("VmHWM") - base - model_bytes
    return max(0, int(hvd.allreduce(torch.tensor([float(risen)]), op=hvd.Max, name="bench.shard.activations").item()))


def run_solo(args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Samples per second of rank 0 training alone with Adam (the other ranks wait at the barrier)."""
    elapsed = 0.0
    if hvd.rank() == 0:
        torch.manual_seed(0)
        model, _ = _build(args.model)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        loss_fn = nn.CrossEntropyLoss()
        for index in range(args.warmup + args.steps):
            if index == args.warmup:
                start = time.perf_counter()
            x, y = batches[index % len(batches)]
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        elapsed = time.perf_counter() - start
    hvd.barrier()
    return args.batch_size * args.steps / max(elapsed, 1e-9) if hvd.rank() == 0 else 0.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.shard", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="mlp", choices=["mlp", "cnn", "transformer", "wide-mlp"], help="the model (default mlp)"
    )
    parser.add_argument(
        "--only",
        choices=PHASES,
        default=None,
        help="run this phase alone (no solo run): its peak_bytes then owe nothing to the phases before it",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step (default 32)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per phase (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each phase (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every phase, the best kept (default 3)")
    add_json_flag(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    hvd.init()
    torch.set_num_threads(1)
    batches = _batches(args.model, args.batch_size, 4)
    _warm_up(args)
    args.activation_bytes = measure_activations(args, batches)
    phases: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):  # the phases alternate round by round; each keeps its best round
        for name in (args.only,) if args.only else PHASES:
            run = run_phase(name, args, batches)
            if name not in phases or run["ips"] > phases[name]["ips"]:
                phases[name] = run
    result: dict[str, Any] = {
        "bench": "shard",
        "model": args.model,
        "params": parameter_count(_build(args.model)[0]),
        "world": hvd.size(),
        "solo_ips": None if args.only else run_solo(args, batches),
        "activation_bytes": args.activation_bytes,
    }
    reference = phases["shoal"]["weights"] if "shoal" in phases else None
    for phase in phases.values():
        weights = phase.pop("weights")
        phase["max_abs_diff"] = None if reference is None else float((weights - reference).abs().max())
    result["phases"] = phases
    for name, phase in phases.items() if "ddp" in phases else ():
        result[f"{name}_ratio"] = phase["ips"] / phases["ddp"]["ips"]
        result[f"{name}_state_share"] = phase["state_bytes"] / phases["ddp"]["state_bytes"]
    if hvd.rank() == 0:
        emit(result, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
