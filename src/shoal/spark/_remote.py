"""What each rank of ``TorchEstimator.fit`` runs: read its share of the Parquet data, train with
``shoal.torch.DistributedOptimizer``, report the loss per epoch, checkpoint on rank 0, return the trained state."""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as it travels: its class, hyperparameters, groups (as indices into ``model.parameters()``) and
    state, so that it can be rebuilt on another copy of the model."""

    cls: type
    defaults: dict[str, Any]
    groups: list[list[int]]
    state: dict[str, Any]

    @staticmethod
    def of(model: Any, optimizer: Any) -> OptimizerSpec:
        index = {id(param): position for position, param in enumerate(model.parameters())}
        groups = []
        for group in optimizer.param_groups:
            if any(id(param) not in index for param in group["params"]):
                raise ValueError(
                    "shoal.spark.TorchEstimator: the optimizer holds parameters that are not the model's; build it on "
                    "model.parameters()"
                )
            groups.append([index[id(param)] for param in group["params"]])
        return OptimizerSpec(type(optimizer), dict(optimizer.defaults), groups, optimizer.state_dict())

    def build(self, model: Any) -> Any:
        """The optimizer on ``model``'s parameters, hyperparameters and state included."""
        params = list(model.parameters())
        groups = [{"params": [params[index] for index in group]} for group in self.groups]
        try:
            optimizer = self.cls(groups, **self.defaults)
        except TypeError:  # a constructor that does not take its own defaults back
            optimizer = self.cls(groups)
        optimizer.load_state_dict(self.state)
        return optimizer


@dataclass(frozen=True)
class DataSpec:
    """What every estimator's ranks need: the model, the data and the loop (shipped from the driver, cloudpickled
    with ``shoal.spark.run``'s payload)."""

    model: Any
    feature_cols: list[str]
    label_cols: list[str]
    input_shapes: list[list[int] | None]
    label_shapes: list[list[int] | None]
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps: int
    val_steps: int | None
    shuffle: bool
    seed: int
    train_path: str
    val_path: str | None
    checkpoint_file: str
    verbose: int
    use_gpu: bool


@dataclass(frozen=True)
class TrainSpec(DataSpec):
    """The torch estimator's: the optimizer and losses too."""

    optimizer: OptimizerSpec | None = None
    losses: list[Any] = field(default_factory=list)
    loss_weights: list[float] = field(default_factory=list)
    backward_passes_per_step: int = 1
    compression: Any = None


def _batch(spec: DataSpec, data: dict[str, np.ndarray[Any, Any]], rows: np.ndarray[Any, Any], device: Any) -> Any:
    """Feature and label tensors for ``rows`` of this rank's share."""
    from shoal.spark._data import as_tensor

    pairs = (zip(spec.feature_cols, spec.input_shapes, strict=True), zip(spec.label_cols, spec.label_shapes, strict=True))
    return [[as_tensor(data[name][rows], shape).to(device) for name, shape in columns] for columns in pairs]


def _loss(spec: TrainSpec, outputs: Any, labels: list[Any]) -> Any:
    """The weighted sum of each output's loss against its label."""
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if len(outputs) != len(labels):
        raise ValueError(
            f"shoal.spark.TorchEstimator: the model returned {len(outputs)} output(s) for {len(labels)} label column(s)"
        )
    terms = zip(spec.loss_weights, spec.losses, outputs, labels, strict=True)
    return sum(weight * loss(output, label) for weight, loss, output, label in terms)


def _validate(spec: TrainSpec, model: Any, data: dict[str, np.ndarray[Any, Any]], device: Any) -> float:
    """The validation loss over every rank's share (one allreduce, whatever each rank's batch count)."""
    import torch

    import shoal.torch as hvd

    count = len(data[spec.label_cols[0]])
    starts = list(range(0, count, spec.val_batch_size))
    if spec.val_steps is not None:
        starts = starts[: spec.val_steps]
    total, rows = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in starts:
            index = np.arange(start, min(start + spec.val_batch_size, count))
            features, labels = _batch(spec, data, index, device)
            total += float(_loss(spec, model(*features), labels)) * len(index)
            rows += len(index)
    sums = hvd.allreduce(torch.tensor([total, float(rows)], dtype=torch.float64), op=hvd.Sum, name="estimator.val_loss")
    return float(sums[0]) / max(float(sums[1]), 1.0)


def _save_checkpoint(spec: TrainSpec, model: Any, optimizer: Any, epoch: int, history: dict[str, list[float]]) -> None:
    import torch

    os.makedirs(os.path.dirname(spec.checkpoint_file), exist_ok=True)
    temporary = spec.checkpoint_file + ".tmp"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "history": history}
    torch.save(state, temporary)
    os.replace(temporary, spec.checkpoint_file)  # a reader never sees half a checkpoint


def _resume(spec: DataSpec, model: Any, optimizer: Any) -> tuple[int, dict[str, list[float]]]:
    """The epoch to start from and the history so far: a checkpoint of this run resumes it. Rank 0 decides and
    loads (another rank's view of a shared filesystem may lag); the broadcasts that follow give the others its
    state."""
    import torch

    import shoal.torch as hvd

    start: tuple[int, dict[str, list[float]]] = (0, {})
    if hvd.rank() == 0 and os.path.exists(spec.checkpoint_file):
        state = torch.load(spec.checkpoint_file, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = (int(state["epoch"]) + 1, state["history"])
    first, history = hvd.broadcast_object(start, root_rank=0, name="estimator.resume")
    return int(first), dict(history)


def train(spec: TrainSpec) -> dict[str, Any] | None:
    """One rank's training; rank 0 returns the trained model's and optimizer's state and the history."""
    import torch

    import shoal.torch as hvd
    from shoal.spark._data import load_shard

    hvd.init()
    if spec.seed is not None:
        torch.manual_seed(spec.seed)
    device = torch.device("cpu")
    if spec.use_gpu and torch.cuda.is_available():
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)
    model = spec.model.to(device)
    assert spec.optimizer is not None
    optimizer = spec.optimizer.build(model)
    first_epoch, history = _resume(spec, model, optimizer)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    distributed = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        backward_passes_per_step=spec.backward_passes_per_step,
        **({"compression": spec.compression} if spec.compression is not None else {}),
    )
    columns = list(dict.fromkeys(spec.feature_cols + spec.label_cols))  # a column may be feature and label
    train_data = load_shard(spec.train_path, columns, hvd.rank(), hvd.size())
    val_data = load_shard(spec.val_path, columns, hvd.rank(), hvd.size()) if spec.val_path else None
    for epoch in range(first_epoch, spec.epochs):
        started = time.monotonic()
        loss = _train_epoch(spec, model, distributed, train_data, epoch, device)
        history.setdefault("loss", []).append(loss)
        line = f"epoch {epoch + 1}/{spec.epochs}: loss {loss:.4f}"
        if val_data is not None:
            history.setdefault("val_loss", []).append(_validate(spec, model, val_data, device))
            line += f", val_loss {history['val_loss'][-1]:.4f}"
        if hvd.rank() == 0:
            _save_checkpoint(spec, model, optimizer, epoch, history)
            if spec.verbose >= 1:
                print(f"{line} ({time.monotonic() - started:.1f} s)", flush=True)
    result = None
    if hvd.rank() == 0:
        buffer = io.BytesIO()
        torch.save({"model": model.cpu().state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        result = {"state": buffer.getvalue(), "history": history}
    hvd.shutdown()
    return result


def _train_epoch(
    spec: TrainSpec, model: Any, optimizer: Any, data: dict[str, np.ndarray[Any, Any]], epoch: int, device: Any
) -> float:
    """``spec.train_steps`` steps over this rank's share (cycling when the steps ask for more rows than it has,
    shuffled per epoch unless shuffling is off); the mean loss over every rank's steps."""
    import torch

    import shoal.torch as hvd

    count = len(data[spec.label_cols[0]])
    order = np.arange(count)
    if spec.shuffle:
        order = np.random.default_rng([spec.seed, epoch, hvd.rank()]).permutation(count)
    model.train()
    total = 0.0
    passes = spec.backward_passes_per_step
    for step in range(spec.train_steps):
        rows = order[np.arange(step * spec.batch_size, (step + 1) * spec.batch_size) % count]
        features, labels = _batch(spec, data, rows, device)
        if step % passes == 0:
            optimizer.zero_grad()
        loss = _loss(spec, model(*features), labels)
        loss.backward()  # with backward_passes_per_step k, k batches' gradients add up before one exchange (Horovod)
        if (step + 1) % passes == 0 or step + 1 == spec.train_steps:
            optimizer.step()
        total += float(loss.detach())
    mean = hvd.allreduce(torch.tensor([total / spec.train_steps], dtype=torch.float64), name="estimator.loss")
    return float(mean[0])
