"""Elastic TensorFlow (Horovod's ``horovod.tensorflow.elastic``): ``TensorFlowState``, ``TensorFlowKerasState`` and
``run``, on Shoal's elastic driver (``shoalrun --min-np/--max-np/--host-discovery-script``).

``run`` is ``shoal.core.elastic.run`` that also recognises a collective that failed inside a ``tf.function`` (a
``tf.errors.OpError`` carrying ``HorovodInternalError``); other errors propagate unchanged (Horovod's returned None
for unrelated TensorFlow errors; Shoal does not hide them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

from shoal.core.basics import rank
from shoal.core.elastic import ObjectState, State
from shoal.core.elastic import run as _run
from shoal.core.objects import broadcast_object
from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from shoal.keras.elastic import KerasState
from shoal.tf_ops.errors import surfacing
from shoal.tf_ops.ops import broadcast_variables

Result = TypeVar("Result")


def run(func: Callable[..., Result]) -> Callable[..., Result]:
    """Decorate ``train(state, ...)`` so that it survives workers dying and joining; see the module docstring."""
    return _run(surfacing(func))


class TensorFlowKerasState(KerasState):
    """A Keras model and its optimizer (``horovod.tensorflow.elastic.TensorFlowKerasState``); ``backend`` is accepted
    for Horovod's signature and unused (Keras 3 has no sessions)."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class TensorFlowState(ObjectState):
    """A list of ``tf.Variable``s and plain values, committed in memory.

    Args:
        variables: the variables to track. TensorFlow 2 has no global variable collection in eager mode, so they
            must be given (Horovod's default, ``tf.compat.v1.global_variables()``, is empty there).
        session: TF1 sessions are not supported; must be None.
        **kwargs: more state, reachable as attributes.

    Raises:
        ValueError: no variables (and none in the TF1 global collection), or a session.
    """

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("TensorFlowState: TF1 sessions are not supported; pass the variables in eager mode")
        self.variables = list(variables) if variables is not None else list(tf.compat.v1.global_variables())
        if not self.variables:
            raise ValueError("TensorFlowState needs the variables to track (e.g. model.variables + optimizer.variables)")
        self._saved_values: list[np.ndarray] = []
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)
        self.save()

    def save(self) -> None:
        """Copy every variable and the plain values."""
        super().save()
        self._saved_values = [np.array(v.numpy()) for v in self.variables]

    def restore(self) -> None:
        """Put the last commit back."""
        for variable, value in zip(self.variables, self._saved_values, strict=True):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        """Give every worker rank 0's variables and values, and commit them."""
        broadcast_variables(self.variables, 0)
        super().sync()


__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "run",
]
