"""An elastic training function for the Ray and Spark elastic tests, and a way to watch its progress from outside."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

TOTAL_STEPS = 80


def elastic_training(progress: str, total_steps: int, pids: str | None = None) -> dict[str, Any]:
    """Regression, one commit per step; rank 0 writes "step size" to ``progress`` after each commit. With ``pids``
    (a directory) each worker leaves a file named by its pid holding "first-rank parent-pid"."""
    import torch

    import shoal.torch as hvd

    hvd.init()
    if pids is not None:
        with open(os.path.join(pids, str(os.getpid())), "w") as out:
            out.write(f"{hvd.rank()} {os.getppid()}")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, log=[])
    restores = 0
    committed_restore = state.restore

    def counting_restore() -> None:
        nonlocal restores
        restores += 1
        committed_restore()

    state.restore = counting_restore  # type: ignore[method-assign]

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.step < total_steps:
            generator = torch.Generator().manual_seed(state.step)
            x = torch.randn(8, 4, generator=generator)
            y = x @ torch.tensor([[1.0], [-1.0], [2.0], [0.5]])
            shard = slice(hvd.rank(), None, hvd.size())
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
            optimizer.step()
            state.log.append([state.step, hvd.size()])
            state.step += 1
            state.commit()
            if hvd.rank() == 0:
                with open(progress, "w") as out:
                    out.write(f"{state.step} {hvd.size()}")
            time.sleep(0.05 if hvd.size() > 1 else 0.25)  # alone: slow enough for the new node to join before the end

    train(state)
    weight = model.weight.detach().flatten().tolist()
    return {"rank": hvd.rank(), "size": hvd.size(), "log": state.log, "weight": weight, "restores": restores}


def wait_progress(path: Path, predicate: Any, timeout_s: float) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            step, size = map(int, path.read_text().split())
            if predicate(step, size):
                return step, size
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"training never reached the expected progress; last: {path.read_text() if path.exists() else None}")
