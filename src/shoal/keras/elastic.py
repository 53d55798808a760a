"""Elastic Keras (Horovod's ``hvd.elastic`` for Keras): ``KerasState`` and the callbacks that keep it current.

Run under ``shoalrun`` with an elastic flag (``--min-np``, ``--max-np``, ``--host-discovery-script``), decorate the
function that calls ``model.fit`` with ``hvd.elastic.run``, and pass ``CommitStateCallback``,
``UpdateBatchStateCallback`` and ``UpdateEpochStateCallback`` to ``fit``. The state is the model's and the
optimizer's variables (copied in memory at each commit, broadcast from rank 0 at each sync) plus any plain values.
Works on Keras's TensorFlow and torch backends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import keras
import numpy as np

from shoal.core.basics import rank
from shoal.core.elastic import ObjectState, State
from shoal.core.elastic import run as _run
from shoal.core.objects import allgather_object, broadcast_object
from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from shoal.keras.callbacks import KerasCallback, broadcast_variables, variable_value
from shoal.keras.flavour import build_optimizer, optimizer_variables, tf_keras_is_keras2

Result = TypeVar("Result")


def run(func: Callable[..., Result]) -> Callable[..., Result]:
    """Decorate ``train(state, ...)`` so that it survives workers dying and joining (Horovod's ``elastic.run``).

    As ``shoal.core.elastic.run``; on the TensorFlow backend, a collective that failed inside the compiled train
    step (a ``tf.errors.OpError`` carrying ``HorovodInternalError``) counts as the failure it is.
    """
    if keras.backend.backend() == "tensorflow" or tf_keras_is_keras2():
        from shoal.tf_ops.errors import surfacing

        return _run(surfacing(func))
    return _run(func)


class KerasState(ObjectState):
    """A Keras model, its optimizer and plain values (``epoch``, ``batch``), committed in memory.

    Args:
        model: a built Keras model (its optimizer, after ``compile``, is taken when ``optimizer`` is None).
        optimizer: the optimizer, when it is not ``model.optimizer``.
        **kwargs: more state, reachable as attributes (``state.epoch``, ``state.batch``).

    Raises:
        ValueError: the model is not built yet.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)` (or call it once).")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if self.optimizer is not None:
            build_optimizer(self.optimizer, list(model.trainable_variables))  # its slots exist now: commits include them
        self._saved_values: list[np.ndarray] = []
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)
        self.save()

    def _variables(self) -> list[Any]:
        optimizer = optimizer_variables(self.optimizer) if self.optimizer is not None else []
        return list(self.model.variables) + optimizer

    def save(self) -> None:
        """Copy every model and optimizer variable, and the plain values."""
        super().save()
        self._saved_values = [variable_value(v) for v in self._variables()]

    def restore(self) -> None:
        """Put the last commit back into the variables and values."""
        for variable, value in zip(self._variables(), self._saved_values, strict=True):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        """Give every worker rank 0's variables and values, and commit them.

        Raises:
            ValueError: on every worker, when the workers' models or optimizers do not hold the same variables.
        """
        variables = self._variables()
        layout = [(str(getattr(v, "path", None) or getattr(v, "name", i)), tuple(v.shape)) for i, v in enumerate(variables)]
        layouts = allgather_object(layout, name="elastic.keras.layout")
        for worker, other in enumerate(layouts):
            if other != layouts[0]:
                differ = sorted(set(other) ^ set(layouts[0]))[:4]
                raise ValueError(
                    f"KerasState: rank {worker} holds {len(other)} variables and rank 0 {len(layouts[0])}; "
                    f"they differ in {differ}: build the same model and optimizer on every worker"
                )
        broadcast_variables(variables, 0)
        super().sync()


class CommitStateCallback(KerasCallback):
    """Commit the state every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(KerasCallback):
    """Keep ``state.batch`` at the last finished batch of the epoch (0 at each epoch's end).

    As Horovod's, it lowers ``params['steps']`` by ``state.batch`` for an epoch that starts after a reset; Keras 3
    reads the epoch's length from its data, not from ``params``, so that epoch still runs all its steps.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - getattr(self.state, "batch", 0)

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = batch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(KerasCallback):
    """Keep ``state.epoch`` at the number of finished epochs: ``fit(epochs=total - state.epoch)`` then resumes."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = getattr(state, "epoch", 0)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_epoch = self.state.epoch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]


__all__ = [
    "CommitStateCallback",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
