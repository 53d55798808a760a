"""Adasum: the allreduce op and the delta optimizer, against a numpy reference of the same recursion.

The reference (written here independently of ``shoal.engine.adasum``): a' = (1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b,
combined over adjacent pairs level by level (an odd one out moves up unchanged). Tolerance 1e-5 (float32 inputs,
float64 dot products).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shoal.torch as hvd
from shoal.testing import run_ranks

pytestmark = pytest.mark.check  # the quick tier: make check


def numpy_adasum(parts: list[np.ndarray]) -> np.ndarray:
    level = [p.astype(np.float64) for p in parts]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2], strict=False):
            dot, aa, bb = float(a.ravel() @ b.ravel()), float(a.ravel() @ a.ravel()), float(b.ravel() @ b.ravel())
            nxt.append((1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def rank_tensors(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]


def _adasum_ops() -> dict[str, list[float]]:
    hvd.init()
    first, second = rank_tensors(hvd.rank())
    out = {"single": hvd.allreduce(first, op=hvd.Adasum).reshape(-1).tolist()}
    grouped = hvd.grouped_allreduce([first, second], op=hvd.Adasum)  # fused: each tensor keeps its own dot products
    out["grouped0"], out["grouped1"] = grouped[0].reshape(-1).tolist(), grouped[1].tolist()
    out["same"] = hvd.allreduce(torch.ones(4), op=hvd.Adasum).tolist()
    axis = torch.zeros(hvd.size())
    axis[hvd.rank()] = 1.0
    out["orthogonal"] = hvd.allreduce(axis, op=hvd.Adasum).tolist()
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_adasum_allreduce_matches_the_reference_recursion(size: int) -> None:
    results = run_ranks(_adasum_ops, size, timeout_s=90)
    every = [rank_tensors(r) for r in range(size)]
    expected = {
        "single": numpy_adasum([t[0].numpy() for t in every]).reshape(-1),
        "grouped0": numpy_adasum([t[0].numpy() for t in every]).reshape(-1),
        "grouped1": numpy_adasum([t[1].numpy() for t in every]),
    }
    for result in results:
        for key, value in expected.items():
            np.testing.assert_allclose(result[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
        assert result["same"] == [1.0] * 4  # parallel updates are averaged
        assert result["orthogonal"] == [1.0] * size  # orthogonal updates add up
    assert all(r == results[0] for r in results)  # bit-identical on every rank


def _adasum_sgd(steps: int) -> list[float]:
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), op=hvd.Adasum
    )
    for step in range(steps):
        x = torch.arange(3.0) + hvd.rank() * (step + 1)
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()
    return model.weight.detach().reshape(-1).tolist()


@pytest.mark.parametrize("size", [2, 3])
def test_adasum_optimizer_applies_the_adasum_of_the_local_updates(size: int) -> None:
    steps = 3
    torch.manual_seed(0)
    weight = torch.nn.Linear(3, 1, bias=False).weight.detach().reshape(-1).double().numpy()
    for step in range(steps):
        deltas = []
        for rank in range(size):
            x = (np.arange(3.0) + rank * (step + 1)).astype(np.float64)
            grad = 2 * float(weight @ x) * x  # d/dw (w.x)^2
            deltas.append(-0.1 * grad)  # one local SGD step
        weight = weight + numpy_adasum(deltas)
    for result in run_ranks(_adasum_sgd, size, args=(steps,)):
        np.testing.assert_allclose(result, weight, rtol=1e-5, atol=1e-6)
