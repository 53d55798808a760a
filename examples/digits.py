"""Train a small CNN on scikit-learn's digits (1,797 real 8x8 images) with Shoal.

Run: ``shoalrun -np 2 python examples/digits.py`` (or ``python examples/digits.py`` as a single process).
Each rank trains on its shard; gradients are averaged with one grouped allreduce per step, so every rank keeps
identical weights. Ends with one JSON line: {"example": "digits", "world": .., "test_accuracy": ..}.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import shoal.torch as hvd


class DigitsNet(nn.Module):
    """Two convolutions and a classifier: about 20k parameters."""

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
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(images, labels, test_size=0.2, random_state=0)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank; scaled by world size")
    args = parser.parse_args()

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    train_set, test_set = load_data()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = DigitsNet()
    for name, tensor in model.state_dict().items():  # every rank starts from rank 0's weights
        hvd.broadcast_(tensor, root_rank=0, name=f"init.{name}")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total_loss = torch.zeros(1)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            hvd.grouped_allreduce_([p.grad for p in model.parameters()], name="grads")
            optimizer.step()
            total_loss += loss.detach()
        mean_loss = hvd.allreduce(total_loss / len(loader), name="epoch.loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {mean_loss:.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        x_test, y_test = test_set.tensors
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if hvd.rank() == 0:
        print(json.dumps({"example": "digits", "world": hvd.size(), "test_accuracy": round(accuracy, 4)}))
    hvd.shutdown()


if __name__ == "__main__":
    main()
