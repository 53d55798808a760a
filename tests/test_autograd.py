"""Every differentiable collective's gradient, on several ranks, against a single-process autograd reference.

Horovod's backward passes (horovod/torch/mpi_ops.py) are the specification. In terms of the ranks' losses L_r:
allreduce and alltoall give the gradient of sum_r L_r; allgather and broadcast that of mean_r L_r (they average
the upstream gradients); reducescatter gives size times the gradient of sum_r L_r (it scales Sum's gradient by the
set size and leaves Average's unscaled). The reference builds every rank's input as a leaf in one process, runs the
same forward with plain torch ops, and backpropagates factor * sum_r L_r. Tolerance: 1e-5 relative (float32).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import shoal.torch as hvd
from shoal.engine.executor import split_rows
from shoal.testing import run_ranks

pytestmark = pytest.mark.check  # the quick tier: make check

# op name -> factor on sum_r L_r whose gradient Horovod's backward computes
FACTORS: dict[str, Callable[[int], float]] = {
    "allreduce_sum_scaled": lambda n: 1.0,
    "allreduce_average": lambda n: 1.0,
    "grouped_allreduce": lambda n: 1.0,
    "allgather": lambda n: 1.0 / n,
    "grouped_allgather": lambda n: 1.0 / n,
    "broadcast": lambda n: 1.0 / n,
    "alltoall": lambda n: 1.0,
    "reducescatter_sum": lambda n: float(n),
    "reducescatter_average_scaled": lambda n: float(n),
    "grouped_reducescatter": lambda n: float(n),
}


def inputs_of(op: str, rank: int, size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s inputs for ``op`` (deterministic, different on every rank)."""
    generator = torch.Generator().manual_seed(1000 * rank + len(op))
    if op in ("allgather", "grouped_allgather"):
        shapes = [(rank + 1, 3), (2 * rank + 1,)]
    elif op == "alltoall":
        shapes = [(sum(r + 1 for r in range(size)) + rank, 2)]
    elif op.startswith("reducescatter") or op == "grouped_reducescatter":
        shapes = [(2 * size + 1, 2), (size, 3)]
    else:
        shapes = [(3, 2), (4,)]
    count = 2 if op.startswith("grouped") else 1
    return [torch.randn(shape, generator=generator) for shape in shapes[:count]]


def alltoall_splits(rank: int, size: int) -> list[int]:
    """Rows rank ``rank`` sends to each rank: uneven, and the last destination takes the rank's extra rows."""
    splits = [r + 1 for r in range(size)]
    splits[-1] += rank
    return splits


def weights_for(outputs: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(out.shape, generator=generator) for out in outputs]


def distributed_forward(op: str, xs: list[torch.Tensor], rank: int, size: int) -> list[torch.Tensor]:
    if op == "allreduce_sum_scaled":
        return [hvd.allreduce(xs[0], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)]
    if op == "allreduce_average":
        return [hvd.allreduce(xs[0])]
    if op == "grouped_allreduce":
        return hvd.grouped_allreduce(xs, op=hvd.Sum, postscale_factor=3.0)
    if op == "allgather":
        return [hvd.allgather(xs[0])]
    if op == "grouped_allgather":
        return hvd.grouped_allgather(xs)
    if op == "broadcast":
        return [hvd.broadcast(xs[0], root_rank=size - 1)]
    if op == "alltoall":
        return [hvd.alltoall(xs[0], splits=alltoall_splits(rank, size))[0]]
    if op == "reducescatter_sum":
        return [hvd.reducescatter(xs[0], op=hvd.Sum)]
    if op == "reducescatter_average_scaled":
        return [hvd.reducescatter(xs[0], op=hvd.Average, prescale_factor=2.0, postscale_factor=0.25)]
    if op == "grouped_reducescatter":
        return hvd.grouped_reducescatter(xs, op=hvd.Sum)
    raise AssertionError(op)


def reference_forward(op: str, every: list[list[torch.Tensor]], rank: int, size: int) -> list[torch.Tensor]:
    """What ``distributed_forward`` returns on ``rank``, computed from every rank's inputs in one process."""

    def stacked(index: int) -> torch.Tensor:
        return torch.stack([xs[index] for xs in every])

    def block(total: torch.Tensor) -> torch.Tensor:
        counts = split_rows(total.shape[0], size)
        return total[sum(counts[:rank]) : sum(counts[: rank + 1])]

    if op == "allreduce_sum_scaled":
        return [0.5 * (2.0 * stacked(0)).sum(0)]
    if op == "allreduce_average":
        return [stacked(0).mean(0)]
    if op == "grouped_allreduce":
        return [3.0 * stacked(i).sum(0) for i in range(2)]
    if op in ("allgather", "grouped_allgather"):
        return [torch.cat([xs[i] for xs in every]) for i in range(len(every[0]))]
    if op == "broadcast":
        return [every[size - 1][0]]
    if op == "alltoall":
        pieces = []
        for source, xs in enumerate(every):
            splits = alltoall_splits(source, size)
            pieces.append(xs[0][sum(splits[:rank]) : sum(splits[: rank + 1])])
        return [torch.cat(pieces)]
    if op == "reducescatter_sum":
        return [block(stacked(0).sum(0))]
    if op == "reducescatter_average_scaled":
        return [block(0.25 * (2.0 * stacked(0)).sum(0) / size)]
    if op == "grouped_reducescatter":
        return [block(stacked(i).sum(0)) for i in range(2)]
    raise AssertionError(op)


def _rank_gradients(ops: list[str]) -> dict[str, list[list[float]]]:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    grads = {}
    for op in ops:
        xs = [x.requires_grad_() for x in inputs_of(op, rank, size)]
        outputs = distributed_forward(op, xs, rank, size)
        loss = sum((out * w).sum() for out, w in zip(outputs, weights_for(outputs, rank), strict=True))
        loss.backward()  # type: ignore[union-attr]
        grads[op] = [x.grad.reshape(-1).tolist() for x in xs]  # type: ignore[union-attr]
    hvd.barrier()
    return grads


def reference_gradients(op: str, size: int) -> list[list[torch.Tensor]]:
    every = [[x.requires_grad_() for x in inputs_of(op, r, size)] for r in range(size)]
    total = torch.zeros(())
    for rank in range(size):
        outputs = reference_forward(op, every, rank, size)
        total = total + sum((out * w).sum() for out, w in zip(outputs, weights_for(outputs, rank), strict=True))
    (FACTORS[op](size) * total).backward()
    return [[x.grad if x.grad is not None else torch.zeros_like(x) for x in xs] for xs in every]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_differentiable_collective_matches_horovods_gradient(size: int) -> None:
    ops = list(FACTORS)
    results = run_ranks(_rank_gradients, size, args=(ops,), timeout_s=90)
    for op in ops:
        expected = reference_gradients(op, size)
        for rank in range(size):
            for index, grad in enumerate(results[rank][op]):
                torch.testing.assert_close(
                    torch.tensor(grad),
                    expected[rank][index].reshape(-1),
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m, op=op, rank=rank: f"{op} rank {rank}: {m}",
                )


def _process_set_gradients() -> list[float] | None:
    """allgather's gradient within a process set of ranks {1, 2}: rows are offset by the set rank, not the global."""
    hvd.init()
    subset = hvd.add_process_set([1, 2])
    grad = None
    if subset.included():
        x = torch.full((subset.rank() + 1, 2), 1.0, requires_grad=True)
        gathered = hvd.allgather(x, process_set=subset)
        (gathered * torch.arange(gathered.shape[0], dtype=torch.float32).unsqueeze(1)).sum().backward()
        grad = x.grad.reshape(-1).tolist()  # type: ignore[union-attr]
    hvd.barrier()
    return grad


def test_allgather_gradient_in_a_process_set_uses_the_set_rank() -> None:
    results = run_ranks(_process_set_gradients, 3)
    # Both members weight row j by j; the averaged gradient of row j is j; set rank 1 owns rows 1 and 2.
    assert results == [None, [0.0, 0.0], [1.0, 1.0, 2.0, 2.0]]
