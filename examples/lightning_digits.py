"""The digits CNN as a PyTorch Lightning module, trained with ``Trainer(strategy=ShoalStrategy())``.

Run: ``shoalrun -np 2 python examples/lightning_digits.py`` (or ``python examples/lightning_digits.py`` alone).
Lightning shards the training set with its distributed sampler (Shoal's rank and size), ShoalStrategy averages the
gradients while backward runs, ``self.log(..., sync_dist=True)`` averages the metrics over the ranks, and rank 0
writes the checkpoint. Ends with one JSON line from rank 0: {"example": "lightning_digits", "world": ..,
"test_accuracy": ..}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import DigitsNet, load_data  # the same model and data as examples/digits.py

import shoal.torch as hvd
from shoal.lightning import ShoalStrategy


class LitDigits(pl.LightningModule):
    """DigitsNet with SGD and momentum; logs loss and accuracy averaged over ranks."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = DigitsNet()
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_accuracy", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the digits CNN with Lightning on Shoal.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank; scaled by world size")
    parser.add_argument("--root-dir", default="checkpoints/lightning_digits", help="where rank 0 writes checkpoints")
    args = parser.parse_args()

    strategy = ShoalStrategy()  # joins the job (hvd.init())
    pl.seed_everything(0, verbose=False)
    train_set, test_set = load_data()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=args.epochs,
        default_root_dir=args.root_dir,
        enable_progress_bar=hvd.rank() == 0,
        enable_model_summary=False,
        logger=False,
    )
    # As examples/digits.py: the learning rate grows with the global batch (Lightning's own rule leaves it alone).
    model = LitDigits(lr=args.lr * hvd.size())
    trainer.fit(model, DataLoader(train_set, batch_size=args.batch_size, shuffle=True))
    results = trainer.test(model, DataLoader(test_set, batch_size=256), verbose=False)
    if trainer.is_global_zero:
        summary = {"example": "lightning_digits", "world": hvd.size(), "test_accuracy": round(results[0]["test_accuracy"], 4)}
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
