"""ElasticSampler: shard an epoch across the current world, and resume it after the world changes.

Like Horovod's: the sampler remembers which indices of the epoch were processed in committed steps; after a reset
(a worker left or joined), the indices not yet processed are re-partitioned over the new world, so no sample is
repeated or skipped. Its ``state_dict()`` is what an elastic state commits; ``reset()`` re-shards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class ElasticSampler(Sampler[int]):
    """Shards ``dataset`` over ``num_replicas`` ranks (default: the current Shoal world), resumable mid-epoch.

    Args:
        dataset: anything with ``len()``.
        shuffle: shuffle each epoch (with ``seed + epoch``), identically on every rank.
        seed: the shuffle seed.
        num_replicas: world size to shard over; default ``shoal.torch.size()`` at each reset.
        rank: this rank; default ``shoal.torch.rank()`` at each reset.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0, num_replicas: int | None = None,
                 rank: int | None = None) -> None:  # fmt: skip
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self._fixed_replicas = num_replicas
        self._fixed_rank = rank
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.reset()

    def _world(self) -> tuple[int, int]:
        if self._fixed_replicas is not None and self._fixed_rank is not None:
            return self._fixed_replicas, self._fixed_rank
        import shoal.torch as hvd

        return hvd.size(), hvd.rank()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing of it is processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_index: int, batch_size: int) -> None:
        """Mark this rank's ``batch_index``-th batch (of ``batch_size``) of the current shard as processed."""
        start = batch_index * batch_size
        self.record_indices(self.indices[start : start + batch_size])

    def record_indices(self, indices: list[int]) -> None:
        """Mark dataset indices as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        """What a commit saves: the epoch and the processed indices."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a committed state (then ``reset()`` re-shards what is left)."""
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-shard the epoch's unprocessed indices over the current world."""
        self.num_replicas, self.rank = self._world()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        # Every rank gets the same count (padding by wrapping around, as DistributedSampler does), so collectives
        # stay in step; padding repeats only within this shard's last batch.
        per_rank = -(-len(self.remaining_indices) // self.num_replicas) if self.remaining_indices else 0
        padded = self.remaining_indices + self.remaining_indices[: per_rank * self.num_replicas - len(self.remaining_indices)]
        self.indices = padded[self.rank : per_rank * self.num_replicas : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
