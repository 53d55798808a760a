"""Horovod's Keras callbacks for Keras 3 (TensorFlow or torch backend) and Keras 2 (``tf_keras``).

Values cross to Shoal's engine as numpy arrays and come back through ``variable.assign``, which both Keras
versions have. Each callback is a Keras 3 callback that Keras 2's ``fit`` also accepts (it carries the hooks
``tf_keras``'s callback list asks for); ``BestModelCheckpoint`` follows ``tf.keras``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import torch

from shoal.core import basics, requests
from shoal.core.rules import Kind, ReduceOp, ReduceSpec
from shoal.keras.flavour import build_optimizer, is_variable, keras2_module, optimizer_variables, tf_keras_is_keras2, to_numpy


def variable_value(variable: Any) -> np.ndarray:
    """A Keras variable's value as a numpy array of its own (Keras 2 or 3, either backend)."""
    return to_numpy(variable)


def broadcast_variables(variables: Sequence[Any], root_rank: int) -> None:
    """Give every Keras variable ``root_rank``'s value (one grouped broadcast of numpy copies)."""
    variables = list(variables)
    if not variables or basics.size() == 1:
        return
    values = [torch.from_numpy(variable_value(v)) for v in variables]
    call = requests.Call(Kind.BROADCAST, root_rank=root_rank, in_place=True)
    requests.run(call, values, "keras.broadcast_variables", grouped=True)
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value.numpy())


class KerasCallback(keras.callbacks.Callback):
    """A Keras 3 callback that Keras 2's ``fit`` accepts too: the attributes ``tf_keras``'s callback list reads."""

    _supports_tf_logs = False
    _chief_worker_only = None
    validation_data = None

    def _implements_train_batch_hooks(self) -> bool:
        return True

    def _implements_test_batch_hooks(self) -> bool:
        return True

    def _implements_predict_batch_hooks(self) -> bool:
        return True


class BroadcastGlobalVariablesCallback(KerasCallback):
    """Give every rank ``root_rank``'s model and optimizer variables when training starts.

    Horovod broadcasts after the first batch, when its optimizers' slots exist; Keras 3 can build the optimizer's
    variables up front, so this broadcasts before the first step (every rank starts from the same state) and, if a
    later ``fit`` finds the optimizer rebuilt, again.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Sequence[Any] | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self._local = {id(v) for v in local_variables or []}

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = self.model.optimizer
        if optimizer is not None:
            build_optimizer(optimizer, list(self.model.trainable_variables))
        shared = [v for v in self.model.variables if id(v) not in self._local]
        broadcast_variables(shared + (optimizer_variables(optimizer) if optimizer is not None else []), self.root_rank)


class MetricAverageCallback(KerasCallback):
    """At each epoch's end, replace every logged metric by its average over the ranks (list it before callbacks
    that read the logs: checkpoints, ReduceLROnPlateau, TensorBoard)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs or basics.size() == 1:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        values = torch.tensor([float(logs[k]) for k in names], dtype=torch.float64)
        call = requests.Call(Kind.ALLREDUCE, spec=ReduceSpec(ReduceOp.Average))
        averaged = requests.run(call, [values], f"keras.metrics.{epoch}.{len(names)}")
        for name, value in zip(names, averaged.tolist(), strict=True):
            logs[name] = value


def _learning_rate(optimizer: Any) -> float:
    return float(to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(KerasCallback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``; a
    number ``multiplier`` means ``multiplier ** (epoch - start_epoch)``. ``staircase`` changes it once an epoch,
    otherwise every batch (with fractional epochs). Momentum correction scales a momentum that is a Keras variable
    by new/old learning rate for the batch of a change; Keras 3's built-in optimizers keep momentum as a constant of
    the compiled step, where it cannot be changed (the flag is then a no-op)."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0
        self._restore_momentum: float | None = None
        if callable(multiplier):
            self.multiplier: Callable[[float], float] = multiplier
        else:
            self.multiplier = lambda epoch: float(multiplier) ** (epoch - start_epoch)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    "Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                    "parameter to the callback."
                )
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def _active(self) -> bool:
        return self.current_epoch >= self.start_epoch and (self.end_epoch is None or self.current_epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = _learning_rate(optimizer)
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate.assign(new)
        momentum: Any = getattr(optimizer, "momentum", None)
        if self.momentum_correction and is_variable(momentum) and old > 0:
            self._restore_momentum = float(to_numpy(momentum))
            momentum.assign(self._restore_momentum * new / old)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self._active():
            return
        if self.staircase:
            if batch == 0:
                self._adjust(self.current_epoch)
        else:
            assert self.steps_per_epoch
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` epochs, batch by
    batch (Goyal et al.; Horovod's formula: at batch b of epoch e, ``initial_lr / size * ((e + (b + 1) /
    steps_per_epoch) * (size - 1) / warmup_epochs + 1)``)."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            size = basics.size()
            assert self.steps_per_epoch
            return 1.0 / size * ((epoch + 1.0 / self.steps_per_epoch) * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
            verbose=verbose,
        )
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_learning_rate(self.model.optimizer):g}.")


class _BestModel:
    """``ModelCheckpoint`` with ``save_best_only=True`` and a ``filepath`` keyword, for either Keras."""

    filepath: str | None

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        filepath: str | None = None,
    ) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"  # Keras 3 checks the suffix
        super().__init__(  # type: ignore[call-arg]
            filepath or placeholder,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        self.filepath = filepath

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint needs a filepath: BestModelCheckpoint(filepath=...) or set .filepath")
        super().on_train_begin(logs)  # type: ignore[misc]


class BestModelCheckpoint(_BestModel, keras.callbacks.ModelCheckpoint):
    """Keep the best model seen so far: ``ModelCheckpoint`` with ``save_best_only=True``.

    Horovod's left ``filepath`` to its Spark estimator; here it is a keyword (``.keras``, or ``.weights.h5`` with
    ``save_weights_only``; any name on Keras 2), or set ``callback.filepath`` before training. Give it to rank 0's
    ``fit`` only, as any checkpoint. When ``tf.keras`` is Keras 2 (``TF_USE_LEGACY_KERAS=1``) it is a ``tf_keras``
    ``ModelCheckpoint``.

    Raises:
        ValueError: at the start of training, when no ``filepath`` was set.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is BestModelCheckpoint and tf_keras_is_keras2():
            return _keras2_best_model_checkpoint()(*args, **kwargs)
        return super().__new__(cls)


_KERAS2_CLASSES: dict[str, type] = {}


def _keras2_best_model_checkpoint() -> type:
    if "BestModelCheckpoint" not in _KERAS2_CLASSES:
        base = keras2_module().callbacks.ModelCheckpoint
        _KERAS2_CLASSES["BestModelCheckpoint"] = type("BestModelCheckpoint", (_BestModel, base), {"__module__": __name__})
    return _KERAS2_CLASSES["BestModelCheckpoint"]
