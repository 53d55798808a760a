"""Gradients in shared memory: the optimizer's CPU gradients live in the host's arena and are reduced where they lie.

Each case trains on N ranks with batch B and compares the weights with one process trained on the global batch
N*B (atol 1e-5, float32), and for 2 ranks with the same run with the path switched off: bit-identical, since the
two paths add the same two numbers. The gradients move into the arena after the second step, when that step
accumulated them where the first left them (``zero_grad(set_to_none=False)``); steps 3 to 5 then use it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import shoal.torch as hvd
from shoal.core import session
from shoal.testing import run_ranks
from shoal.torch.optimizer import exchange_of

pytestmark = pytest.mark.check  # the quick tier: make check

BATCH = 4
STEPS = 5
ATOL = 1e-5
OFF = {"SHOAL_SHARED_GRADIENTS": "0"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def data(size: int, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, passes, size * BATCH, 8, generator=generator), torch.randn(
        STEPS, passes, size * BATCH, 4, generator=generator
    )


def step(model: Net, optimizer: Any, x: torch.Tensor, y: torch.Tensor, case: str, index: int, distributed: bool) -> None:
    """One step as each case's user writes it."""
    optimizer.zero_grad(set_to_none=case == "set_to_none=True" or (case == "replaced .grad" and index == 3))
    if case == "replaced .grad" and index == 4:  # the user's own tensor, which autograd accumulates into
        model.fc2.weight.grad = torch.zeros_like(model.fc2.weight)
    for micro in range(x.shape[0]):
        nn.functional.mse_loss(model(x[micro]), y[micro]).backward()
    if case == "clipping":
        if distributed:
            optimizer.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if distributed:
            with optimizer.skip_synchronize():
                optimizer.step()
            return
    optimizer.step()


def passes_of(case: str) -> int:
    return 2 if case == "backward_passes_per_step=2" else 1


def reference(size: int, case: str) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data(size, passes_of(case))
    for index in range(STEPS):
        step(model, optimizer, x[index], y[index], case, index, distributed=False)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def _train(case: str) -> dict[str, Any]:
    hvd.init()
    torch.manual_seed(0)
    model = Net()
    passes = passes_of(case)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
    )
    x, y = data(hvd.size(), passes)
    rows = slice(hvd.rank() * BATCH, (hvd.rank() + 1) * BATCH)
    for index in range(STEPS):
        step(model, optimizer, x[index, :, rows], y[index, :, rows], case, index, distributed=True)
        if case == "re-init" and index == 0:
            hvd.shutdown()  # as an elastic re-form does: the arena belonged to the old engine
            hvd.init()
    shared = exchange_of(optimizer).shared
    arena = shared.arena.own() if shared is not None else None
    in_arena = [
        arena is not None and arena.data_ptr() <= p.grad.data_ptr() < arena.data_ptr() + arena.numel()
        for p in model.parameters()
    ]
    executed = [
        name for (_, name) in session.engine()._executor.executions if re.fullmatch(r"shoal\.shared_gradients\.g\d+\.\d+", name)
    ]
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    # No rank leaves before every rank has looked at its arena: a peer that exits ends the others' engines, and an
    # ended engine unmaps its arenas (a rank slowed by a loaded machine would find its own gone).
    hvd.allreduce(torch.zeros(1), name="looked")
    return {"weights": weights, "in_arena": in_arena, "executed": sorted(executed)}


CASES = ["plain", "backward_passes_per_step=2", "clipping", "replaced .grad", "re-init"]


@pytest.mark.parametrize("case", CASES)
def test_gradients_in_shared_memory_match_one_process_and_the_copying_path(case: str) -> None:
    results = run_ranks(_train, 2, args=(case,), timeout_s=90)
    copying = run_ranks(_train, 2, args=(case,), env=OFF, timeout_s=90)
    expected = reference(2, case)
    for rank, (result, copied) in enumerate(zip(results, copying, strict=True)):
        assert all(result["in_arena"]), f"rank {rank}: not every gradient lives in the arena: {result['in_arena']}"
        assert result["executed"], "no allreduce ran in the arena"
        assert not any(copied["in_arena"]) and not copied["executed"]
        for name, value in expected.items():
            np.testing.assert_allclose(result["weights"][name], value, atol=ATOL, err_msg=f"{case}: rank {rank}, {name}")
            assert np.array_equal(result["weights"][name], copied["weights"][name]), f"{case}: rank {rank}, {name}"


@pytest.mark.parametrize("size", [3, 4])
def test_three_and_four_ranks_match_one_process(size: int) -> None:
    expected = reference(size, "plain")
    for rank, result in enumerate(run_ranks(_train, size, args=("plain",), timeout_s=120)):
        assert all(result["in_arena"]) and result["executed"]
        for name, value in expected.items():
            np.testing.assert_allclose(result["weights"][name], value, atol=ATOL, err_msg=f"rank {rank}, {name}")


def test_gradients_set_to_none_every_step_stay_on_the_copying_path() -> None:
    expected = reference(2, "set_to_none=True")
    for result in run_ranks(_train, 2, args=("set_to_none=True",), timeout_s=90):
        assert not any(result["in_arena"]) and not result["executed"]
        for name, value in expected.items():
            np.testing.assert_allclose(result["weights"][name], value, atol=ATOL)


def test_one_rank_switched_off_keeps_every_rank_on_the_copying_path() -> None:
    results = run_ranks(_train, 2, args=("plain",), rank_env_overrides={1: OFF}, timeout_s=90)
    expected = reference(2, "plain")
    for result in results:
        assert not any(result["in_arena"]) and not result["executed"]
        for name, value in expected.items():
            np.testing.assert_allclose(result["weights"][name], value, atol=ATOL)
