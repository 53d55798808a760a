"""What each rank of ``LightningEstimator.fit`` runs: its share of the Parquet data as dict batches, a Lightning
``Trainer`` with ``ShoalStrategy``, the logged metrics per epoch on the driver, a checkpoint per epoch (rank 0)."""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from shoal.spark._remote import DataSpec


@dataclass(frozen=True)
class LightningSpec(DataSpec):
    """The Lightning estimator's: Lightning callbacks too."""

    callbacks: list[Any] = field(default_factory=list)


class _Collate:
    """Indices into a rank's share to a batch: a dict of tensors keyed by column name, shaped by
    ``input_shapes``/``label_shapes``."""

    def __init__(self, spec: DataSpec, data: dict[str, np.ndarray[Any, Any]]) -> None:
        self._data = data
        names = list(dict.fromkeys([*spec.feature_cols, *spec.label_cols]))
        shapes = dict(zip([*spec.label_cols, *spec.feature_cols], [*spec.label_shapes, *spec.input_shapes], strict=True))
        self._columns = [(name, shapes[name]) for name in names]

    def __call__(self, indices: list[int]) -> dict[str, Any]:
        from shoal.spark._data import as_tensor

        rows = np.asarray(indices)
        return {name: as_tensor(self._data[name][rows], shape) for name, shape in self._columns}


class _EpochOrder:
    """``length`` row indices per epoch over a share of ``count`` rows, cycling through it: a fresh permutation of
    the whole share each epoch (seeded by epoch and rank) when shuffling, else in order. Lightning calls
    ``set_epoch`` before each epoch, as for a ``DistributedSampler``."""

    def __init__(self, count: int, length: int, shuffle: bool, seed: int, rank: int) -> None:
        self._count, self._length, self._shuffle, self._seed, self._rank = count, length, shuffle, seed, rank
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Any:
        order = np.arange(self._count)
        if self._shuffle:
            order = np.random.default_rng([self._seed, self._epoch, self._rank]).permutation(self._count)
        return iter(order[np.arange(self._length) % self._count].tolist())


def _loaders(spec: LightningSpec, rank: int, size: int) -> tuple[Any, Any]:
    """The training batches (``train_steps`` per epoch on every rank) and the validation batches (the same count on
    every rank: a rank with fewer validation rows repeats some, so that every rank reaches each metric's reduction)."""
    from torch.utils.data import DataLoader

    from shoal.spark._data import load_shard, row_count

    columns = list(dict.fromkeys(spec.feature_cols + spec.label_cols))
    data = load_shard(spec.train_path, columns, rank, size)
    count = len(data[spec.label_cols[0]])
    order = _EpochOrder(count, spec.train_steps * spec.batch_size, spec.shuffle, spec.seed, rank)
    train = DataLoader(
        cast(Any, range(count)), batch_size=spec.batch_size, sampler=order, drop_last=True,
        collate_fn=_Collate(spec, data),
    )  # fmt: skip
    if not spec.val_path:
        return train, None
    val_data = load_shard(spec.val_path, columns, rank, size)
    most = -(-row_count(spec.val_path) // size)  # the largest rank's share
    val_order = _EpochOrder(len(val_data[spec.label_cols[0]]), most, False, spec.seed, rank)
    val = DataLoader(
        cast(Any, range(most)), batch_size=spec.val_batch_size, sampler=val_order, collate_fn=_Collate(spec, val_data)
    )
    return train, val


def train_lightning(spec: LightningSpec) -> dict[str, Any] | None:
    """One rank's training; rank 0 returns the trained module's state and the metrics per epoch."""
    import lightning.pytorch as pl
    import torch

    import shoal.torch as hvd
    from shoal.lightning import ShoalStrategy

    hvd.init()
    torch.manual_seed(spec.seed)
    history: dict[str, list[float]] = {}

    class Progress(pl.Callback):
        """Records every logged metric per epoch; rank 0 prints them and checkpoints."""

        started = time.monotonic()

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            Progress.started = time.monotonic()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            metrics = {name: float(value) for name, value in trainer.callback_metrics.items() if value.numel() == 1}
            for name, value in metrics.items():
                history.setdefault(name, []).append(value)
            trainer.save_checkpoint(spec.checkpoint_file, weights_only=False)  # the strategy writes on rank 0 only
            if hvd.rank() == 0 and spec.verbose >= 1:
                shown = ", ".join(f"{name} {value:.4f}" for name, value in sorted(metrics.items()))
                took = time.monotonic() - Progress.started
                print(f"epoch {trainer.current_epoch + 1}/{spec.epochs}: {shown} ({took:.1f} s)", flush=True)

    use_cuda = spec.use_gpu and torch.cuda.is_available()
    os.makedirs(os.path.dirname(spec.checkpoint_file), exist_ok=True)
    trainer = pl.Trainer(
        strategy=ShoalStrategy(),
        accelerator="gpu" if use_cuda else "cpu",
        max_epochs=spec.epochs,
        limit_val_batches=spec.val_steps if spec.val_steps is not None else 1.0,
        callbacks=[Progress(), *spec.callbacks],
        use_distributed_sampler=False,  # each rank reads its own rows already
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train, val = _loaders(spec, hvd.rank(), hvd.size())
    found = hvd.rank() == 0 and os.path.exists(spec.checkpoint_file)  # rank 0 decides for every rank
    resume = spec.checkpoint_file if hvd.broadcast_object(found, root_rank=0, name="estimator.resume") else None
    trainer.fit(spec.model, train, val, ckpt_path=resume)
    result = None
    if hvd.rank() == 0:
        buffer = io.BytesIO()
        torch.save(spec.model.cpu().state_dict(), buffer)
        result = {"state": buffer.getvalue(), "history": history}
    hvd.shutdown()
    return result
