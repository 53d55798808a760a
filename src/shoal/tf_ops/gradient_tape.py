"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged over the
ranks, as ``horovod.tensorflow.DistributedGradientTape``.

TensorFlow's tape computes every gradient in one call and offers no per-gradient hook, so the reduction cannot
start while backprop runs: the gradients of one ``gradient()`` call are reduced together, as one fused exchange
(one ``grouped_allreduce``; with ``groups``, one per group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from shoal.core.gradient_lists import GradientOptions, ListReducer
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import ReduceSpec, exchanges_gradients
from shoal.runtime import elastic_rendezvous
from shoal.tf_ops.compression import Compression, Compressor
from shoal.tf_ops.ops import Average, grouped_allreduce, size_op


class TFListAdapter:
    """TensorFlow's part of the one list reducer (``shoal.core.gradient_lists``): ``IndexedSlices`` made dense, one
    ``grouped_allreduce`` per group with the compression and devices given, factors as constants of each gradient's
    dtype. In an elastic job the exchange is always traced (a no-op at size 1) and local gradients are divided by the
    size read when the step runs: a compiled step is traced once, and the job's size may change between its runs."""

    def __init__(self, compression: type[Compressor], device_dense: str = "", device_sparse: str = "") -> None:
        self.compression = compression
        self.device_dense = device_dense
        self.device_sparse = device_sparse

    def key(self, source: Any) -> Any:
        return _ref(source)

    def densify(self, grad: Any) -> Any:
        return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad

    def weigh(self, grads: list[Any], process_set: ProcessSet) -> list[Any]:
        return grads

    def allreduce(self, grads: list[Any], spec: ReduceSpec, process_set: ProcessSet) -> list[Any]:
        return grouped_allreduce(
            grads,
            device_dense=self.device_dense,
            device_sparse=self.device_sparse,
            compression=self.compression,
            op=spec.op,
            prescale_factor=spec.prescale,
            postscale_factor=spec.postscale,
            process_set=process_set,
        )

    def scale(self, grad: Any, factor: float, per_member_of: ProcessSet | None) -> Any:
        def times(dtype: Any) -> Any:
            value = tf.constant(factor, dtype)
            if per_member_of is None:
                return value
            elastic = elastic_rendezvous.is_elastic_worker()
            members = size_op(per_member_of.process_set_id or 0) if elastic else per_member_of.size()
            return value / tf.cast(members, dtype)

        return _scaled(grad, times)

    def exchanging(self, options: GradientOptions) -> bool:
        members, included = options.process_set.size(), options.process_set.included()
        return exchanges_gradients(members, included, elastic_rendezvous.is_elastic_worker())


def tf_list_reducer(
    options: GradientOptions, compression: type[Compressor] = Compression.none, device_dense: str = "", device_sparse: str = ""
) -> ListReducer:
    """The one list reducer on TensorFlow's tensors (the tape's, the TF optimizer's and Keras 2's / Keras 3 on
    TensorFlow's)."""
    return ListReducer(options, TFListAdapter(compression, device_dense, device_sparse))


def _scaled(grad: Any, factor: Any) -> Any:
    """``grad`` (dense or ``IndexedSlices``) times ``factor(dtype)``."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor(grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * factor(grad.dtype)


def _ref(value: Any) -> Any:
    return value.ref() if hasattr(value, "ref") else id(value)


class _DistributedGradientTape(tf.GradientTape):
    """The methods mixed into the user's tape class."""

    _shoal_reducer: ListReducer

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local (not reduced; divided by the number of ranks when
        ``scale_local_gradients``)."""
        self._shoal_reducer.register_local_source(source)

    def gradient(
        self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False, **kwargs: Any
    ) -> Any:
        """The tape's gradients, reduced over the ranks (``sources`` a flat list, or one variable)."""
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        if not isinstance(sources, (list, tuple)):
            return self._shoal_reducer.reduce([grads], [sources])[0]
        return self._shoal_reducer.reduce(list(grads), list(sources))

    def get_local_and_global_gradients(
        self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """The gradients as ``gradient()`` computes them (the global ones reduced, the local ones scaled), as two
        lists of ``(source, gradient)`` pairs in ``sources``' order: the local sources', then the global ones'."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local: list[tuple[Any, Any]] = []
        shared: list[tuple[Any, Any]] = []
        for source, grad in zip(sources, grads, strict=True):
            (local if self._shoal_reducer.is_local(source) else shared).append((source, grad))
        return local, shared


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Sequence[Sequence[Any]] | int | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """Wrap a tape (after its ``with`` block, or before) so that ``gradient()`` averages over the ranks.

    The returned object is of a subclass of the tape's class and shares its recording.
    """
    cls: Any = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    tape = cls.__new__(cls)
    tape.__dict__ = gradtape.__dict__  # the same recording, persistence and watched variables
    options = GradientOptions.parse(
        op, gradient_predivide_factor, num_groups, groups, sparse_as_dense, scale_local_gradients, process_set
    )
    tape._shoal_reducer = tf_list_reducer(options, compression, device_dense, device_sparse)
    return tape


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Sequence[Sequence[Any]] | int | None = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """A ``DistributedGradientTape`` whose ``local_layers`` (a layer or a list of them) keep local gradients."""
    if local_layers is None:
        layers: list[Any] = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        layers = [local_layers]
    elif isinstance(local_layers, (list, tuple)) and all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        layers = list(local_layers)
    else:
        raise ValueError("local_layers must be a Keras layer or a list of Keras layers")
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
