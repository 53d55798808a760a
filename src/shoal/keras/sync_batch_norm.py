"""``SyncBatchNormalization``: batch normalization whose batch statistics cover every rank's batch.

Each rank sums its inputs and their squares over the normalized axes and counts its elements; one Sum allreduce of
the three gives the global mean and variance. The allreduce's gradient (a Sum allreduce of the upstream gradient)
carries every rank's share back, so N ranks x batch B train as one process with batch N*B.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from shoal.core.basics import size
from shoal.keras.flavour import keras2_module, tf_keras_is_keras2
from shoal.runtime import elastic_rendezvous
from shoal.tf_ops.ops import Sum, allreduce


def _global_moments(inputs: Any, axes: list[int], keep_dims: bool) -> tuple[Any, Any]:
    """Mean and variance over ``axes`` of every rank's ``inputs``: one Sum allreduce of sums, squares and count."""
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
    sums = tf.reduce_sum(inputs, axis=axes, keepdims=keep_dims)
    squares = tf.reduce_sum(tf.square(inputs), axis=axes, keepdims=keep_dims)
    local = tf.concat([tf.reshape(sums, [-1]), tf.reshape(squares, [-1]), tf.reshape(count, [1])], 0)
    total = allreduce(local, op=Sum, name=None)
    channels = tf.size(sums)
    global_count = total[-1]
    mean = total[:channels] / global_count
    variance = tf.maximum(total[channels : 2 * channels] / global_count - tf.square(mean), 0.0)
    return tf.reshape(mean, tf.shape(sums)), tf.reshape(variance, tf.shape(sums))


def _local_only(mask: Any) -> bool:
    return mask is not None or (size() == 1 and not elastic_rendezvous.is_elastic_worker())


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``BatchNormalization`` with statistics over all ranks (as ``horovod.tensorflow.SyncBatchNormalization``).

    A Keras 3 layer for Keras's TensorFlow backend; when ``tf.keras`` is Keras 2 (``TF_USE_LEGACY_KERAS=1``) a
    ``tf_keras`` layer. Raises ValueError for ``fused=True`` or ``fused=None`` (Horovod's rule).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is SyncBatchNormalization and tf_keras_is_keras2():
            return _keras2_sync_batch_normalization()(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if keras.backend.backend() != "tensorflow":
            raise ValueError("shoal.tensorflow.SyncBatchNormalization needs Keras's TensorFlow backend")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> Any:
        if _local_only(mask):
            return super()._moments(inputs, mask)
        return _global_moments(inputs, list(self._reduction_axes), keep_dims=False)


_KERAS2: dict[str, type] = {}


def _keras2_sync_batch_normalization() -> type:
    """The Keras 2 layer: ``tf_keras``'s ``BatchNormalization`` with the global moments."""
    if "SyncBatchNormalization" in _KERAS2:
        return _KERAS2["SyncBatchNormalization"]
    base = keras2_module().layers.BatchNormalization

    def __init__(self: Any, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        base.__init__(self, fused=False, **kwargs)

    def _moments(self: Any, inputs: Any, reduction_axes: Any, keep_dims: bool, mask: Any = None) -> Any:
        if _local_only(mask):
            return base._moments(self, inputs, reduction_axes, keep_dims, mask=mask)
        return _global_moments(inputs, list(reduction_axes), keep_dims)

    layer = type("SyncBatchNormalization", (base,), {"__init__": __init__, "_moments": _moments, "__module__": __name__})
    _KERAS2["SyncBatchNormalization"] = layer
    return layer
