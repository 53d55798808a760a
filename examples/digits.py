"""Train a small CNN on scikit-learn's digits (1,797 real 8x8 images) with Shoal.

Run: ``shoalrun -np 2 python examples/digits.py`` (or ``python examples/digits.py`` as a single process).
The training set is sharded with DistributedSampler; DistributedOptimizer averages gradients while backprop runs.
Rank 0 shows a progress bar, prints per-epoch metrics averaged over all ranks and saves a checkpoint. Ends with
one JSON line: {"example": "digits", "world": .., "test_accuracy": ..}.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import shoal.torch as hvd
from shoal.bench.digits import load_digits_tensors  # scikit-learn's data and split, without its import


class DigitsNet(nn.Module):
    """Two convolutions and a classifier: about 21k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The digits as (N, 1, 8, 8) tensors scaled to [0, 1], split 80/20 with a fixed seed."""
    return load_digits_tensors()


def evaluate(model: nn.Module, dataset: TensorDataset) -> float:
    """Accuracy on this rank's shard of ``dataset``, averaged over ranks by sample count."""
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    correct = torch.zeros(2)
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=256, sampler=sampler):
            correct += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    totals = hvd.allreduce(correct, op=hvd.Sum, name="eval.correct")
    return float(totals[0] / totals[1])


def train(
    epochs: int = 8, batch_size: int = 32, lr: float = 0.05, checkpoint: str = "checkpoints/digits.pt", op: str = "average"
) -> dict[str, object]:
    """Initialise Shoal, train on this rank's shard, and return the summary every rank agrees on (rank 0 prints
    per-epoch metrics and saves the checkpoint). ``examples/ray_digits.py`` runs this on Ray actors."""
    hvd.init()
    torch.manual_seed(0)
    train_set, test_set = load_data()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    model = DigitsNet()
    adasum = op == "adasum"
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * (1 if adasum else hvd.size()), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), op=hvd.Adasum if adasum else hvd.Average
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    test_accuracy = 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        totals = torch.zeros(3)  # loss sum, correct, samples
        batches = tqdm(loader, desc=f"epoch {epoch + 1}/{epochs}", disable=hvd.rank() != 0, leave=False)
        for x, y in batches:
            optimizer.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            totals += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)])
        totals = hvd.allreduce(totals, op=hvd.Sum, name="epoch.totals")
        test_accuracy = evaluate(model, test_set)
        if hvd.rank() == 0:
            print(
                f"epoch {epoch + 1}: train loss {totals[0] / totals[2]:.4f}, train accuracy "
                f"{totals[1] / totals[2]:.4f}, test accuracy {test_accuracy:.4f}",
                flush=True,
            )

    if hvd.rank() == 0:
        os.makedirs(os.path.dirname(checkpoint) or ".", exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
        print(f"saved {checkpoint}")
    return {"example": "digits", "world": hvd.size(), "op": op, "test_accuracy": round(test_accuracy, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a CNN on sklearn digits with Shoal.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank; scaled by world size")
    parser.add_argument("--checkpoint", default="checkpoints/digits.pt", help="where rank 0 saves the model")
    parser.add_argument(
        "--op",
        choices=["average", "adasum"],
        default="average",
        help="how updates combine: average the gradients (lr scaled by world size) or Adasum the updates (lr not "
        "scaled, as Horovod recommends on CPU)",
    )
    args = parser.parse_args()
    summary = train(args.epochs, args.batch_size, args.lr, args.checkpoint, args.op)
    if hvd.rank() == 0:
        print(json.dumps(summary))
    hvd.shutdown()


if __name__ == "__main__":
    main()
