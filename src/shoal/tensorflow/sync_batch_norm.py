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
from shoal.runtime import elastic_rendezvous
from shoal.tensorflow.ops import Sum, allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with statistics over all ranks (as ``horovod.tensorflow.SyncBatchNormalization``).

    For Keras's TensorFlow backend. Raises ValueError for ``fused=True`` or ``fused=None`` (Horovod's rule).
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if keras.backend.backend() != "tensorflow":
            raise ValueError("shoal.tensorflow.SyncBatchNormalization needs Keras's TensorFlow backend")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> Any:
        if mask is not None or (size() == 1 and not elastic_rendezvous.is_elastic_worker()):
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
        local = tf.concat(
            [tf.reduce_sum(inputs, axis=axes), tf.reduce_sum(tf.square(inputs), axis=axes), tf.reshape(count, [1])], 0
        )
        total = allreduce(local, op=Sum, name=None)
        channels = (tf.shape(local)[0] - 1) // 2
        global_count = total[-1]
        mean = total[:channels] / global_count
        variance = tf.maximum(total[channels : 2 * channels] / global_count - tf.square(mean), 0.0)
        return mean, variance
