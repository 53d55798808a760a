"""Time to accuracy: the same training run under Shoal (uncompressed, ``auto-lossy``, forced compressed schemes),
DDP and DDP with torch's PowerSGD hook, one after another in one invocation, on scikit-learn's digits (1,797 real
8×8 images; needs scikit-learn).

Run: ``shoalrun -np 2 python -m shoal.bench.accuracy --model mlp`` (or under ``shoal.bench.netns`` for a slow link).
Each variant trains from the same initial weights on the same shards for ``--epochs``; after every epoch the clock
stops and every rank scores the test set; the uncompressed Shoal run comes first and sets the target, and every
other variant trains on past ``--epochs`` until it reaches the target (up to ``--max-epochs``). Rank 0 prints each
curve (seconds, test accuracy), then one JSON line: ``{"bench": "accuracy", "model": .., "world": .., "target": ..,
"variants": {name: {"final_accuracy": .., "seconds": .., "time_to_target_s": .., "curve": [[s, acc], ...]}},
"lossy_vs_ddp": .., "lossy_vs_ddp_powersgd": ..}`` where ``target`` is the uncompressed Shoal run's final accuracy
minus half a point, ``time_to_target_s`` the training seconds until a variant first reaches it (null if never), and
the ratios are DDP's time to target over ``auto-lossy``'s. ``--plot FILE`` draws the curves (needs matplotlib).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import shoal.torch as hvd
from shoal.bench import add_json_flag, emit
from shoal.bench.digits import load_digits_tensors
from shoal.comm.baselines import wrap_ddp, wrap_ddp_powersgd

VARIANTS = ("shoal", "auto-lossy", "powersgd", "topk", "ddp", "ddp-powersgd", "solo")
"""``shoal``: uncompressed allreduce (the reference accuracy); ``auto-lossy``: the planner may compress;
``powersgd``/``topk``: that scheme forced on every layer; ``ddp``/``ddp-powersgd``: torch's, for comparison;
``solo``: one worker alone, no communication (every rank trains the same run at once, on its own core), with one
worker's batch and learning rate over the whole training set: the first baseline a second worker must beat."""


def build_model(name: str, width: int) -> nn.Module:
    """``mlp``: 64 → width → width → 10; ``cnn``: two convolutions (16 and 32 channels) and a classifier."""
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        )
    raise ValueError(f"unknown model {name!r}; choose mlp or cnn")


def _optimizer(variant: str, model: nn.Module, lr: float, total_steps: int, rank: int, ratio: float) -> tuple[nn.Module, Any]:
    """The model as trained (wrapped for DDP) and its optimizer, for one variant."""
    warmup = max(2, total_steps // 10)  # torch's advice for PowerSGD: about 10% of the run
    if variant == "solo":
        return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sgd = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    if variant == "ddp":
        return wrap_ddp(model), sgd
    if variant == "ddp-powersgd":
        wrapped = wrap_ddp_powersgd(model, rank, start_iter=warmup)
        return wrapped, torch.optim.SGD(wrapped.parameters(), lr=lr * hvd.size(), momentum=0.9)
    compression: Any = hvd.Compression.none
    comm = "allreduce"
    if variant == "powersgd":
        compression = hvd.Compression.powersgd(rank=rank, total_steps=total_steps)
    elif variant == "topk":
        compression = hvd.Compression.topk(ratio=ratio, total_steps=total_steps)
    elif variant == "auto-lossy":
        comm, compression = "auto-lossy", hvd.Compression.powersgd(rank=None, max_rank=rank, total_steps=total_steps)
    optimizer = hvd.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(), model=model, comm=comm, compression=compression
    )
    return model, optimizer


def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    """Test accuracy of ``model`` on all of ``dataset`` (every rank holds the same weights)."""
    model.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        result = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return result


def train_variant(
    variant: str,
    model_name: str,
    epochs: int,
    batch_size: int,
    lr: float,
    width: int = 512,
    rank: int = 4,
    ratio: float = 0.01,
    target: float | None = None,
    max_epochs: int | None = None,
) -> list[tuple[float, float]]:
    """Train one variant (every rank calls it); returns its curve: (training seconds so far, test accuracy) after
    each epoch. The clock stops while the test set is scored. With ``target``, training goes on past ``epochs`` (up
    to ``max_epochs``) until the test accuracy reaches it: every rank holds the same weights, so all stop alike."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    train_set, test_set = load_digits_tensors()
    replicas, index = (1, 0) if variant == "solo" else (hvd.size(), hvd.rank())
    sampler: DistributedSampler[Any] = DistributedSampler(train_set, num_replicas=replicas, rank=index, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True)
    model = build_model(model_name, width)
    if variant != "solo":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    last = max(epochs, max_epochs or epochs) if target is not None else epochs
    trained, optimizer = _optimizer(variant, model, lr, epochs * len(loader), rank, ratio)
    loss_fn = nn.CrossEntropyLoss()
    curve: list[tuple[float, float]] = []
    elapsed = 0.0
    for epoch in range(last):
        if epoch >= epochs and target is not None and curve[-1][1] >= target:
            break
        sampler.set_epoch(epoch)
        hvd.barrier()
        start = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(trained(x), y).backward()
            optimizer.step()
        hvd.barrier()
        elapsed += time.perf_counter() - start
        curve.append((round(elapsed, 3), round(accuracy(model, test_set), 4)))
    return curve


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Training seconds until the curve first reaches ``target`` (None if it never does)."""
    return next((seconds for seconds, value in curve if value >= target), None)


def _plot(curves: dict[str, list[tuple[float, float]]], target: float, path: str, title: str) -> None:
    from shoal.bench.plot import _matplotlib

    plt = _matplotlib()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        axes.plot([s for s, _ in curve], [a for _, a in curve], "o-", label=name)
    axes.axhline(target, color="grey", linestyle="--", label="target")
    axes.set_xlabel("training seconds")
    axes.set_ylabel("test accuracy")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> None:
    """Parse flags, train every variant, print the curves and the JSON line (rank 0)."""
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate for one worker; scaled by world size")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (default 1024: 1.1M parameters for mlp)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank: forced, auto-lossy's bound, DDP's hook")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)} (shoal always runs)"
    )
    parser.add_argument(
        "--max-epochs", type=int, default=None, help="the others train on until the target, up to this (default 2x --epochs)"
    )
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k's share of entries sent (default 0.01)")
    parser.add_argument("--plot", default=None, help="draw the curves into this PNG (needs matplotlib)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    args.max_epochs = args.max_epochs or 2 * args.epochs
    variants = ["shoal", *(v for v in args.variants.split(",") if v and v != "shoal")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(1)
    hvd.init()
    settings = (args.model, args.epochs, args.batch_size, args.lr, args.width, args.rank, args.ratio)
    curves = {"shoal": train_variant("shoal", *settings)}
    target = round(curves["shoal"][-1][1] - 0.005, 4)
    for variant in variants[1:]:  # each goes on until it reaches the target, up to --max-epochs
        curves[variant] = train_variant(variant, *settings, target=target, max_epochs=args.max_epochs)
    if hvd.rank() == 0:
        result: dict[str, object] = {"bench": "accuracy", "model": args.model, "world": hvd.size(), "target": target}
        table = {}
        for name, curve in curves.items():
            print(f"{name:>13}: " + ", ".join(f"{s:.1f}s {a:.3f}" for s, a in curve))
            table[name] = {
                "final_accuracy": curve[-1][1],
                "seconds": curve[-1][0],
                "time_to_target_s": time_to(curve, target),
                "curve": [list(point) for point in curve],
            }
        result["variants"] = table
        lossy = table.get("auto-lossy", {}).get("time_to_target_s")
        for baseline in ("ddp", "ddp-powersgd"):
            other = table.get(baseline, {}).get("time_to_target_s")
            key = f"lossy_vs_{baseline.replace('-', '_')}"
            result[key] = round(other / lossy, 3) if lossy and other else None  # type: ignore[operator]
        if args.plot:
            _plot(curves, target, args.plot, f"digits {args.model}, {hvd.size()} workers")
        emit(result, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
