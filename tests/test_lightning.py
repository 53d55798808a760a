"""shoal.lightning.ShoalStrategy: the digits LightningModule on 2 ranks, and 2 ranks x batch B against one process
with batch 2B (plain steps and gradient accumulation), metrics reduced over ranks, checkpoints from rank 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, SHOALRUN, clean_env
from shoal.testing import run_ranks

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install 'shoal[lightning]')")

TOLERANCE = 1e-5
"""Largest weight difference allowed between 2 ranks and one process: float32 sums in another order."""


def test_digits_lightning_module_reaches_95_percent_on_two_ranks(tmp_path: Path) -> None:
    script = [sys.executable, str(REPO / "examples" / "lightning_digits.py"), "--root-dir", str(tmp_path)]
    result = subprocess.run(
        [*SHOALRUN, "-np", "2", *script], env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=170
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1].split(":", 1)[1])  # "[0]<stdout>:{...}"
    assert summary["example"] == "lightning_digits" and summary["world"] == 2
    assert summary["test_accuracy"] >= 0.95, summary
    checkpoints = list((tmp_path / "checkpoints").glob("*.ckpt"))
    assert len(checkpoints) == 1, checkpoints  # written once, by rank 0
    saved = torch.load(checkpoints[0], weights_only=False)
    assert saved["epoch"] == 7 and "net.fc.weight" in saved["state_dict"]


def _train(global_batch: int, accumulate: int, steps: int) -> dict[str, Any]:
    """Fit a small regression model with Lightning; returns its final weights and the logged metrics."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import shoal.torch as hvd
    from shoal.lightning import ShoalStrategy

    strategy = ShoalStrategy()
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(global_batch * accumulate * steps, 6, generator=generator)
    y = x @ torch.randn(6, 1, generator=generator) + 0.1 * torch.randn(len(x), 1, generator=generator)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(hvd.rank())  # ranks start apart: the broadcast from rank 0 must make them equal
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("rank_value", float(hvd.rank() + 1), sync_dist=True, reduce_fx="mean")
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    model = Regression()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    batch = global_batch // hvd.size()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = strategy.all_gather(torch.tensor([float(hvd.rank())]))
    return {
        "weights": weights,
        "rank_value": float(trainer.callback_metrics["rank_value"]),
        "gathered": gathered.flatten().tolist(),
        "steps": trainer.global_step,
    }


def _one_process(global_batch: int, accumulate: int, steps: int) -> dict[str, Any]:
    return run_ranks(_train, 1, args=(global_batch, accumulate, steps), timeout_s=90)[0]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_ranks_match_one_process_with_the_global_batch(accumulate: int) -> None:
    two = run_ranks(_train, 2, args=(8, accumulate, 6), timeout_s=120)
    one = _one_process(8, accumulate, 6)
    assert one["steps"] == two[0]["steps"] == 6
    torch.testing.assert_close(two[0]["weights"], two[1]["weights"], rtol=0, atol=0)  # ranks agree exactly
    difference = (two[0]["weights"] - one["weights"]).abs().max().item()
    assert difference <= TOLERANCE, difference
    assert (one["weights"] - _initial_weights()).abs().max().item() > 0.01  # it trained
    assert two[0]["rank_value"] == two[1]["rank_value"] == 1.5  # (1 + 2) / 2: sync_dist averaged over ranks
    assert two[0]["gathered"] == [0.0, 1.0]


def _initial_weights() -> torch.Tensor:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return torch.cat([p.detach().flatten() for p in net.parameters()])
