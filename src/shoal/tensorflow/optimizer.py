"""``horovod.tensorflow.DistributedOptimizer``: Keras optimizers go to ``shoal.keras.DistributedOptimizer``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import ReduceSpec
from shoal.keras.flavour import is_keras2
from shoal.keras.optimizer import DistributedOptimizer as KerasDistributedOptimizer
from shoal.tf_ops.compression import Compression, Compressor
from shoal.tf_ops.ops import Adasum, Average


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Sequence[Sequence[Any]] | int | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Wrap a Keras optimizer (TensorFlow 2's optimizers are Keras's) so its updates use gradients reduced over the
    ranks; the same as ``shoal.keras.DistributedOptimizer``. Horovod drops ``op`` and ``groups`` on this path; Shoal
    passes them on.

    Raises:
        ValueError: a TF1 optimizer (``tf.compat.v1.train.Optimizer``: graph mode and sessions; use a Keras optimizer
            or ``DistributedGradientTape``), anything else that is not a Keras optimizer, Adasum, or
            ``gradient_predivide_factor`` with an op other than Average.
    """
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    ReduceSpec.for_gradients(op, gradient_predivide_factor)  # Horovod's rule, checked before anything is built
    if isinstance(optimizer, keras.optimizers.Optimizer) or is_keras2(optimizer):
        if op == Adasum:
            raise ValueError("op == Adasum is not supported yet with Keras")
        return KerasDistributedOptimizer(
            optimizer,
            name=name,
            device_dense=device_dense,
            device_sparse=device_sparse,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            num_groups=num_groups,
            groups=groups,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
        )
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ValueError(
            f"{type(optimizer).__name__} is a TF1 optimizer (graph mode, sessions), which Shoal does not support: "
            "use a Keras optimizer (tf.keras.optimizers) or hvd.DistributedGradientTape"
        )
    raise ValueError(f"Provided optimizer doesn't inherit from either legacy TensorFlow or Keras optimizer: {optimizer}")
