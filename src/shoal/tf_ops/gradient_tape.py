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

from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import (
    ReduceSpec,
    divides_local_gradients,
    exchanges_gradients,
    resolve_groups,
    split_gradients,
    split_groups,
)
from shoal.runtime import elastic_rendezvous
from shoal.tf_ops.compression import Compression, Compressor
from shoal.tf_ops.ops import Average, grouped_allreduce, size_op


class GradientReducer:
    """Reduce a list of gradients as Horovod's optimizers and tapes do (shared with the Keras optimizer)."""

    def __init__(
        self,
        compression: type[Compressor] = Compression.none,
        sparse_as_dense: bool = False,
        op: int = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Sequence[Sequence[Any]] | int | None = None,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
        device_dense: str = "",
        device_sparse: str = "",
    ) -> None:
        self.spec = ReduceSpec.for_gradients(op, gradient_predivide_factor)
        groups = resolve_groups(num_groups, groups)
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.device_dense = device_dense
        self.device_sparse = device_sparse
        self.local_sources: set[Any] = set()
        self.aggregation = 1.0
        """A factor on every result (the Keras optimizer's sum of accumulated gradients)."""

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local."""
        self.local_sources.add(_ref(source))

    def reduce(self, grads: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        """The reduced gradients, in order; None stays None; local sources are only scaled."""
        grads = [tf.convert_to_tensor(g) if self.sparse_as_dense and isinstance(g, tf.IndexedSlices) else g for g in grads]
        results = list(grads)
        shared, local = split_gradients(grads, [_ref(s) in self.local_sources for s in sources])
        # Decided while tracing: in an elastic job the size may change between runs of the same graph, so there
        # the exchange is always traced (a no-op at size 1) and local gradients use the size read at run time.
        elastic = elastic_rendezvous.is_elastic_worker()
        members = self.process_set.size()
        exchanging = exchanges_gradients(members, self.process_set.included(), elastic)
        if exchanging:
            for chunk in self._chunks(shared, sources) if shared else []:
                reduced = grouped_allreduce(
                    [grads[i] for i in chunk],
                    device_dense=self.device_dense,
                    device_sparse=self.device_sparse,
                    compression=self.compression,
                    op=self.spec.op,
                    prescale_factor=self.spec.prescale,
                    postscale_factor=self.spec.aggregated(self.aggregation).postscale,
                    process_set=self.process_set,
                )
                for index, value in zip(chunk, reduced, strict=True):
                    results[index] = value
        elif self.aggregation != 1.0:
            for index in shared:
                results[index] = _scaled(grads[index], lambda dtype: tf.constant(self.aggregation, dtype))
        divide = divides_local_gradients(self.scale_local_gradients, exchanging)
        if local and (divide or self.aggregation != 1.0):

            def scale(dtype: Any) -> Any:
                factor = tf.constant(self.aggregation, dtype)
                if not divide:
                    return factor
                return factor / tf.cast(size_op(self.process_set.process_set_id or 0) if elastic else members, dtype)

            for index in local:
                results[index] = _scaled(grads[index], scale)
        return results

    def _chunks(self, shared: list[int], sources: Sequence[Any]) -> list[list[int]]:
        if self.groups is None:
            return [shared]
        if isinstance(self.groups, int):
            return split_groups(shared, self.groups)
        position = {_ref(v): g for g, group in enumerate(self.groups) for v in group}
        grouped: dict[Any, list[int]] = {}
        for index in shared:
            key = position.get(_ref(sources[index]), ("alone", index))
            grouped.setdefault(key, []).append(index)
        return list(grouped.values())


def _scaled(grad: Any, factor: Any) -> Any:
    """``grad`` (dense or ``IndexedSlices``) times ``factor(dtype)``."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor(grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * factor(grad.dtype)


def _ref(value: Any) -> Any:
    return value.ref() if hasattr(value, "ref") else id(value)


class _DistributedGradientTape(tf.GradientTape):
    """The methods mixed into the user's tape class."""

    _shoal_reducer: GradientReducer

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
            (local if _ref(source) in self._shoal_reducer.local_sources else shared).append((source, grad))
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
    tape._shoal_reducer = GradientReducer(
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
        device_dense,
        device_sparse,
    )
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
