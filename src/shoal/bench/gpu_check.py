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


def check_more_collectives(device: torch.device) -> bool:
    """fp16 compression, uneven allgather, alltoall with splits and reducescatter keep the device and the values."""
    rank, size = hvd.rank(), hvd.size()
    mine = torch.arange(8, dtype=torch.float32, device=device) * (rank + 1)
    mean = torch.arange(8, dtype=torch.float32) * (size + 1) / 2
    compressed = hvd.allreduce(mine, compression=hvd.Compression.fp16, name="gpu_check.fp16")
    ok = compressed.dtype == torch.float32 and torch.allclose(compressed.cpu(), mean, rtol=1e-3)
    uneven = hvd.allgather(torch.full((rank + 1, 2), float(rank), device=device), name="gpu_check.uneven")
    ok &= torch.equal(uneven.cpu(), torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)]))
    sent = torch.arange(size * 2, dtype=torch.float32, device=device) + 100 * rank
    received, splits = hvd.alltoall(sent, splits=[2] * size, name="gpu_check.alltoall")
    expected = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in range(size)])
    ok &= torch.equal(received.cpu(), expected) and splits.tolist() == [2] * size
    scattered = hvd.reducescatter(torch.ones(size * 3, device=device) * (rank + 1), op=hvd.Sum, name="gpu_check.rs")
    ok &= torch.equal(scattered.cpu(), torch.full((3,), float(size * (size + 1) // 2)))
    return bool(ok and all(t.device == device for t in (compressed, uneven, received, scattered)))


def check_accumulation(device: torch.device, per_rank: int = 4) -> bool:
    """backward_passes_per_step=2: two local passes, one exchange, the weights of one process with both batches."""
    rank, size = hvd.rank(), hvd.size()
    model, reference = _model(device), _model(device)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), backward_passes_per_step=2
    )
    solo = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer.zero_grad()
    solo.zero_grad()
    for micro in range(2):
        x, y = _global_batch(micro, size, per_rank, device)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        F.cross_entropy(reference(x), y).backward()
    optimizer.step()
    solo.step()
    return all(
        torch.allclose(p, q, rtol=_TOLERANCE, atol=_TOLERANCE)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


def check_state(device: torch.device) -> bool:
    """Adam state broadcast from rank 0 and an elastic commit/restore keep CUDA tensors on their device."""
    model = _model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if hvd.rank() == 0:
        F.cross_entropy(model(torch.ones(2, 16, device=device)), torch.zeros(2, dtype=torch.long, device=device)).backward()
        optimizer.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    moments = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    ok = all(m.device == device for m in moments)
    gathered = hvd.allgather(torch.cat([m.flatten() for m in moments]).unsqueeze(0), name="gpu_check.state")
    ok &= bool((gathered == gathered[0]).all())
    state = hvd.elastic.TorchState(model, optimizer, epoch=3)
    state.commit()
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state.restore()
    ok &= all(torch.equal(p, q) and p.device == device for p, q in zip(model.parameters(), before, strict=True))
    return bool(ok and getattr(state, "epoch", None) == 3)


def _guarded(check: Callable[[torch.device], bool], device: torch.device) -> bool:
    """A check that raises reports false with its error on stderr; the other checks still run."""
    try:
        return check(device)
    except Exception as error:
        print(f"gpu_check: {check.__name__} raised {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return False


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
        if hvd.local_rank() >= torch.cuda.device_count():
            sys.exit(
                f"gpu_check: local rank {hvd.local_rank()} has no GPU of its own ({torch.cuda.device_count()} here); NCCL "
                "needs one GPU per rank, so run at most that many ranks per host"
            )
        torch.cuda.set_device(hvd.local_rank())  # Horovod's recipe: rank i on cuda:i (negotiation uses the type)
        device = torch.device("cuda", hvd.local_rank())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    checks = {
        "collectives": _guarded(check_collectives, device),
        "more_collectives": _guarded(check_more_collectives, device),
        "distributed_optimizer": _guarded(check_optimizer, device),
        "accumulation": _guarded(check_accumulation, device),
        "optimizer_and_elastic_state": _guarded(check_state, device),
        "sync_batch_norm": _guarded(check_sync_batch_norm, device),
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
