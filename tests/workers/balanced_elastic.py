"""Elastic training with a BalancedLoader, for tests/test_elastic.py (tests/test_balanced.py takes its model, data
and 1-process reference): a regression whose global batch stays the same while the world shrinks and grows. Rank 0
prints "step N world W" after each commit and, at the end, one JSON line {"weights": .., "log": [[epoch, step, world,
[indices the ranks processed]], ...], "restores": ..} of the committed steps and rank 0's rollbacks to a commit.

Run: ``shoalrun -np 2 --min-np 1 --host-discovery-script S python tests/workers/balanced_elastic.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

SAMPLES = 54  # B=16, b=4: 4 steps per epoch, the last of 6 samples (micro-batches of 4 and 2)
GLOBAL_BATCH = 16
MICRO_BATCH = 4
SEED = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 4, generator=generator))


def optimizer_for(model: nn.Module, kind: str = "sgd") -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def reference_weights(epochs: int, kind: str = "sgd") -> dict[str, Any]:
    """One process, each step's whole global batch in one backward pass (weights as lists)."""
    from shoal.core.balance import MicroBatchSchedule

    torch.manual_seed(0)
    model = Net()
    optimizer = optimizer_for(model, kind)
    x, y = dataset().tensors
    schedule = MicroBatchSchedule(SAMPLES, GLOBAL_BATCH, MICRO_BATCH, seed=SEED)
    for epoch in range(epochs):
        for step in range(schedule.steps_per_epoch):
            index = torch.tensor([i for m in schedule.micro_batches(epoch, step) for i in m])
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[index]), y[index]).backward()
            optimizer.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def main() -> None:
    import shoal.torch as hvd

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument(
        "--hold-file",
        default=None,
        help="while this file exists and one worker is left, wait after each commit (checking for hosts joining) "
        "instead of training on: a test removes it once it has seen the world grow again, so training cannot end "
        "before a returning worker has started, however long that takes on a loaded machine",
    )
    parser.add_argument("--shard", default=None, help="DistributedOptimizer's shard= (default: none)")
    args = parser.parse_args()
    hvd.init()
    print(f"worker pid {os.getpid()} starts as rank {hvd.rank()}", flush=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    loader = hvd.BalancedLoader(dataset(), GLOBAL_BATCH, MICRO_BATCH, shuffle=True, seed=SEED)
    optimizer = hvd.DistributedOptimizer(
        optimizer_for(model), named_parameters=model.named_parameters(), loader=loader, shard=args.shard
    )
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, loader=loader, epoch=0, log=[])
    restores = 0
    committed_restore = state.restore

    def counting_restore() -> None:
        nonlocal restores
        restores += 1
        committed_restore()

    state.restore = counting_restore  # type: ignore[method-assign]

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.epoch < args.epochs:
            loader.set_epoch(state.epoch)
            for step in loader:
                optimizer.zero_grad()
                for x, y in step:
                    nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                processed = hvd.allgather_object(step.indices, name="balanced_elastic.processed")
                plan = step.plan
                state.log.append([plan.epoch, plan.step, hvd.size(), sorted(i for part in processed for i in part)])
                state.commit()
                if hvd.rank() == 0:
                    print(f"step {len(state.log)} world {hvd.size()}", flush=True)
                time.sleep(args.step_delay)
                while args.hold_file and hvd.size() == 1 and os.path.exists(args.hold_file):
                    state.check_host_updates()
                    time.sleep(0.05)
            state.epoch += 1
            state.commit()

    train(state)
    if hvd.rank() == 0:
        weights = {k: v.tolist() for k, v in model.state_dict().items()}
        print(json.dumps({"weights": weights, "log": state.log, "restores": restores}), flush=True)


if __name__ == "__main__":
    main()
