"""``import shoal.keras as hvd``: Horovod's Keras API for Keras 3 and Keras 2 (``tf_keras``), on Shoal's engine.

Works with Keras 3 on the TensorFlow backend (``import shoal.tensorflow.keras as hvd`` is the same module, as
``horovod.tensorflow.keras``) and on the torch backend (``KERAS_BACKEND=torch``: gradients are torch tensors and
go straight to ``shoal.torch``). ``DistributedOptimizer`` wraps a Keras optimizer so that ``model.fit`` averages
gradients over the ranks; the callbacks are in ``shoal.keras.callbacks``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shoal.core.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from shoal.core.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from shoal.core.session import start_timeline, stop_timeline
from shoal.keras import callbacks, elastic
from shoal.keras.balanced import BalancedData
from shoal.keras.flavour import keras2_module
from shoal.keras.optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
    backend,
    default_compression,
    is_distributed,
    load_model,
)
from shoal.torch import functions as _functions
from shoal.torch.functions import Average, Sum

Compression = default_compression()
"""The backend's compressors: ``Compression.none`` and ``Compression.fp16``."""


def _tensor(value: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(value))


def _on_backend(tf_collective: Callable[[Any], Any], torch_collective: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """Run a collective on ``value`` as Horovod's Keras does, on the backend's tensors: a ``tf.Tensor`` back in eager
    mode, the value evaluated in Keras's session in a TF1 graph (Keras 2 with eager execution off), a ``torch.Tensor``
    on Keras 3's torch backend."""
    if backend() == "torch":
        return torch_collective(_tensor(value))
    import tensorflow as tf

    result = tf_collective(tf.constant(value))
    if tf.executing_eagerly():
        return result
    return _keras_session().run(result)


def _keras_session() -> Any:
    """The session Keras 2 runs its TF1 graph in: ``tf.compat.v1.keras.backend.get_session()`` (Keras 2's under
    ``TF_USE_LEGACY_KERAS=1``), else ``tf_keras``'s own."""
    import tensorflow as tf

    get_session = getattr(tf.compat.v1.keras.backend, "get_session", None)
    if get_session is None:
        keras2_module()  # says how to install tf_keras when it is missing
        from tf_keras.src import backend as keras2_backend

        get_session = keras2_backend.get_session
    return get_session()


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: Any = None,
) -> Any:
    """A value (number, array, tensor) averaged (or summed, ...) over the ranks: a tensor of the backend (numpy in a
    TF1 graph, evaluated in Keras's session), as Horovod's."""

    def on_tf(tensor: Any) -> Any:
        compressor = compression or Compression.none
        return _tf_ops().allreduce(
            tensor,
            average=average,
            compression=compressor,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            name=name,
        )

    def on_torch(tensor: torch.Tensor) -> Any:
        return _functions.allreduce(
            tensor, average=average, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor
        )

    return _on_backend(on_tf, on_torch, value)


def allgather(value: Any, name: str | None = None) -> Any:
    """Every rank's value concatenated along the first dimension (a tensor of the backend, as ``allreduce``)."""
    return _on_backend(
        lambda tensor: _tf_ops().allgather(tensor, name=name), lambda tensor: _functions.allgather(tensor, name=name), value
    )


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """``root_rank``'s value on every rank (a tensor of the backend, as ``allreduce``)."""
    return _on_backend(
        lambda tensor: _tf_ops().broadcast(tensor, root_rank, name=name),
        lambda tensor: _functions.broadcast(tensor, root_rank, name=name),
        value,
    )


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    """The value reduced over the ranks, this rank's block of rows (a tensor of the backend, as ``allreduce``)."""
    return _on_backend(
        lambda tensor: _tf_ops().reducescatter(tensor, op=op, name=name),
        lambda tensor: _functions.reducescatter(tensor, name=name, op=op),
        value,
    )


def _tf_ops() -> Any:
    """``shoal.tf_ops.ops``, imported on the TensorFlow backend only (the torch backend needs no TensorFlow)."""
    from shoal.tf_ops import ops

    return ops


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 helper: assign ``root_rank``'s value to every global variable, in Keras's session.

    Raises:
        RuntimeError: in eager mode (Keras 3, or Keras 2 with eager execution on), as Horovod's does: broadcast the
            model's variables with ``callbacks.BroadcastGlobalVariablesCallback`` or
            ``callbacks.broadcast_variables(model.variables, root_rank)`` instead.
    """
    if backend() == "torch":
        raise RuntimeError(
            "broadcast_global_variables() is a TF1 graph-mode helper: use callbacks.BroadcastGlobalVariablesCallback, "
            "or callbacks.broadcast_variables(model.variables, root_rank)"
        )
    return _keras_session().run(_tf_ops().broadcast_global_variables(root_rank))  # raises RuntimeError eagerly


__all__ = [
    "Average",
    "BalancedData",
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "allgather",
    "allreduce",
    "backend",
    "broadcast",
    "broadcast_global_variables",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_distributed",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
