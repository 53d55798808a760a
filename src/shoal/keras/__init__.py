"""``import shoal.keras as hvd``: Horovod's Keras API for Keras 3 and Keras 2 (``tf_keras``), on Shoal's engine.

Works with Keras 3 on the TensorFlow backend (``import shoal.tensorflow.keras as hvd`` is the same module, as
``horovod.tensorflow.keras``) and on the torch backend (``KERAS_BACKEND=torch``: gradients are torch tensors and
go straight to ``shoal.torch``). ``DistributedOptimizer`` wraps a Keras optimizer so that ``model.fit`` averages
gradients over the ranks; the callbacks are in ``shoal.keras.callbacks``.
"""

from __future__ import annotations

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


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: Any = None,
) -> np.ndarray:
    """A value (number, array, tensor) averaged (or summed) over the ranks, as a numpy array."""
    reduced = _functions.allreduce(
        _tensor(value), average=average, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor
    )
    return np.asarray(reduced.numpy())


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    """Every rank's value concatenated along the first dimension, as a numpy array."""
    return np.asarray(_functions.allgather(_tensor(value), name=name).numpy())


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    """``root_rank``'s value on every rank, as a numpy array."""
    return np.asarray(_functions.broadcast(_tensor(value), root_rank, name=name).numpy())


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> np.ndarray:
    """The value reduced over the ranks, this rank's block of rows, as a numpy array."""
    return np.asarray(_functions.reducescatter(_tensor(value), name=name, op=op).numpy())


def broadcast_global_variables(root_rank: int) -> None:
    """Horovod's TF1 graph-mode helper; under Keras 3 use ``BroadcastGlobalVariablesCallback``."""
    raise RuntimeError(
        "broadcast_global_variables() is a TF1 graph-mode helper: use callbacks.BroadcastGlobalVariablesCallback, "
        "or callbacks.broadcast_variables(model.variables, root_rank)"
    )


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
