"""GPU checks of the NCCL path: collectives, DistributedOptimizer and SyncBatchNorm on CUDA tensors, against
single-process references, plus one allreduce timing against raw NCCL in the same run.

Run on a GPU machine: ``shoalrun -np N python -m shoal.bench.gpu_check`` (N up to the number of GPUs; each rank
takes ``cuda:local_rank``, Horovod's recipe). ``--device cpu`` runs the same checks over gloo, which is how CI keeps
this script working on machines without a GPU. Prints one line per check, then (rank 0) one JSON line:
``{"bench":"gpu_check","world":..,"device":..,"checks":{name: true|false},"allreduce":{"bytes","shoal_ms","raw_ms",
"ratio"}}``; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import shoal.torch as hvd
from shoal.bench import add_json_flag, emit
from shoal.comm import collectives
from shoal.plan.calibration import median_seconds

_TOLERANCE = 1e-4
"""Relative and absolute tolerance: float32, with reductions in a different order than the reference's."""


def _global_batch(step: int, size: int, per_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(size * per_rank, 16, generator=generator)
    y = torch.randint(0, 4, (size * per_rank,), generator=generator)
    return x.to(device), y.to(device)


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)


def check_collectives(device: torch.device) -> bool:
    rank, size = hvd.rank(), hvd.size()
    mine = torch.arange(6, dtype=torch.float32, device=device) + rank
    every = [torch.arange(6, dtype=torch.float32) + r for r in range(size)]
    total = torch.stack(every).sum(0)
    ok = torch.allclose(hvd.allreduce(mine, op=hvd.Sum).cpu(), total)
    ok &= torch.allclose(hvd.allreduce(mine.half()).float().cpu(), total / size, rtol=1e-2)
    ok &= torch.equal(hvd.allgather(mine.view(2, 3)).cpu(), torch.cat([e.view(2, 3) for e in every]))
    ok &= torch.equal(hvd.broadcast(mine, root_rank=size - 1).cpu(), every[-1])
    grouped = hvd.grouped_allreduce([mine, mine * 2], op=hvd.Sum)
    ok &= all(torch.allclose(g.cpu(), total * k) for g, k in zip(grouped, (1, 2), strict=True))
    ok &= all(t.device == device for t in grouped)
    return bool(ok)


def check_optimizer(device: torch.device, steps: int = 5, per_rank: int = 8) -> bool:
    """N ranks x batch B give the weights of one process with batch N*B."""
    rank, size = hvd.rank(), hvd.size()
    model, reference = _model(device), _model(device)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    solo = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _global_batch(step, size, per_rank, device)
        optimizer.zero_grad()
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        optimizer.step()
        solo.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        solo.step()
    return all(
        torch.allclose(p, q, rtol=_TOLERANCE, atol=_TOLERANCE)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


def check_sync_batch_norm(device: torch.device) -> bool:
    rank = hvd.rank()
    layer = hvd.SyncBatchNorm(3).to(device)
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(rank)).to(device)
    y = layer(x)
    every = hvd.allgather(x, name="gpu_check.sbn")
    expected = F.batch_norm(every, None, None, layer.weight, layer.bias, training=True, eps=layer.eps)
    return bool(torch.allclose(y, expected[4 * rank : 4 * rank + 4], rtol=_TOLERANCE, atol=_TOLERANCE))


def _timed_ms(fn: Callable[[], object], device: torch.device, iterations: int = 10) -> float:
    def synchronized() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return median_seconds(synchronized, iterations) * 1e3


def time_allreduce(device: torch.device, nbytes: int) -> dict[str, float]:
    """Shoal's engine against raw torch.distributed (NCCL for CUDA) on the same tensor, in the same run."""
    tensor = torch.ones(nbytes // 4, device=device)
    shoal_ms = _timed_ms(lambda: hvd.allreduce_(tensor, op=hvd.Sum, name="gpu_check.timed"), device)
    raw_ms = _timed_ms(lambda: collectives.allreduce_(tensor, "sum", None), device)
    return {"bytes": nbytes, "shoal_ms": round(shoal_ms, 3), "raw_ms": round(raw_ms, 3), "ratio": round(raw_ms / shoal_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description="Check Shoal's NCCL path on GPUs (or the same checks on CPU).")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--mib", type=int, default=64, help="size of the timed allreduce")
    add_json_flag(parser)
    args = parser.parse_args()
    hvd.init()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("gpu_check: no CUDA device here; use --device cpu to run the checks over gloo")
        torch.cuda.set_device(hvd.local_rank())  # Horovod's recipe: rank i on cuda:i (negotiation uses the type)
        device = torch.device("cuda", hvd.local_rank())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    checks = {
        "collectives": check_collectives(device),
        "distributed_optimizer": check_optimizer(device),
        "sync_batch_norm": check_sync_batch_norm(device),
    }
    timing = time_allreduce(device, args.mib << 20)
    agreed = hvd.allgather_object(checks)
    checks = {name: all(rank_checks[name] for rank_checks in agreed) for name in checks}
    if hvd.rank() == 0:
        for name, passed in checks.items():
            print(f"{name}: {'ok' if passed else 'FAILED'}")
        print(f"allreduce {args.mib} MiB: shoal {timing['shoal_ms']} ms, raw {timing['raw_ms']} ms")
        result = {"bench": "gpu_check", "world": hvd.size(), "device": args.device, "checks": checks, "allreduce": timing}
        emit(result, args.json)
    hvd.shutdown()
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
