"""ElasticSampler: shard an epoch across the current world, and resume it after the world changes.

Like Horovod's: the sampler remembers which indices of the epoch were processed in committed steps; after a reset
(a worker left or joined), the indices not yet processed are re-partitioned over the new world, so no sample is
repeated or skipped. Its ``state_dict()`` is what an elastic state commits; ``reset()`` re-shards.

Training is synchronous, so when this rank finished its ``i``-th batch every rank finished its own ``i``-th batch:
``record_batch`` marks all of them, and the record survives whichever worker dies (Horovod records only this
rank's and unions them at the next sync, which loses the batches of a worker that died since the last sync).
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

    def __init__(
        self, dataset: Sized, shuffle: bool = True, seed: int = 0, num_replicas: int | None = None, rank: int | None = None
    ) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.processed_count = 0
        """Samples recorded this epoch, padding excluded; equals ``len(processed_indices)`` unless one repeated."""
        self._padded: list[int] = []
        self._per_rank = 0
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
        self.processed_count = 0
        self.reset()

    def record_batch(self, batch_index: int, batch_size: int) -> None:
        """Mark the ``batch_index``-th batch (of ``batch_size``) of every rank's current shard as processed."""
        real = len(self.remaining_indices)
        positions = range(batch_index * batch_size, min((batch_index + 1) * batch_size, self._per_rank))
        flat = [j * self.num_replicas + r for r in range(self.num_replicas) for j in positions]
        self.record_indices([self._padded[p] for p in flat if p < real])  # padding repeats samples; not counted

    def record_indices(self, indices: list[int]) -> None:
        """Mark dataset indices as processed."""
        self.processed_indices.update(int(i) for i in indices)
        self.processed_count += len(indices)

    def state_dict(self) -> dict[str, Any]:
        """What a commit saves: the epoch, the processed indices and how many were recorded."""
        return {
            "epoch": self.epoch,
            "processed_indices": sorted(self.processed_indices),
            "processed_count": self.processed_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a committed state (then ``reset()`` re-shards what is left)."""
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.processed_count = int(state.get("processed_count", len(self.processed_indices)))
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
        remaining = self.remaining_indices
        per_rank = -(-len(remaining) // self.num_replicas) if remaining else 0
        total = per_rank * self.num_replicas
        padded = (remaining * -(-total // len(remaining)))[:total] if remaining else []  # wraps as often as needed
        self._padded, self._per_rank = padded, per_rank
        self.indices = padded[self.rank : per_rank * self.num_replicas : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
