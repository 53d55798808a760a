"""Reducing a list of gradients as Horovod's TensorFlow optimizer, gradient tape and Keras optimizers do, once for
every framework (Horovod's ``_make_allreduce_grads_fn``).

``GradientOptions.parse`` reads Horovod's arguments once: the op and ``gradient_predivide_factor`` (a ``ReduceSpec``),
``groups``/``num_groups`` (``rules.resolve_groups``), ``sparse_as_dense``, ``scale_local_gradients`` and the process
set. ``ListReducer.reduce(grads, sources)`` then

1. makes sparse gradients dense when ``sparse_as_dense``;
2. splits the gradients into those exchanged and those of local sources (``register_local_source``); a missing
   gradient (None) stays None;
3. exchanges the shared ones, one grouped allreduce per group (all together without groups; ``groups=N`` near-equal
   contiguous groups; lists of sources: each list together, every other source alone), with the spec's factors and
   ``aggregation`` (a factor on the result: the Keras optimizers' sum of accumulated gradients);
4. divides the local ones by the set's size when ``scale_local_gradients`` and the others were exchanged.

What differs between frameworks is small and lives in a ``ListAdapter``: how a sparse gradient becomes dense, how a
list is allreduced, how a gradient is scaled, and how a source is keyed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import (
    ReduceSpec,
    divides_local_gradients,
    exchanges_gradients,
    resolve_groups,
    split_gradients,
    split_groups,
)


@dataclass(frozen=True)
class GradientOptions:
    """Horovod's gradient-reduction arguments, parsed and checked once."""

    spec: ReduceSpec
    """The op, and the predivide factor as prescale and postscale."""
    groups: int | list[list[Any]] | None
    """None (one group), a count of near-equal contiguous groups, or lists of sources reduced together."""
    sparse_as_dense: bool = False
    scale_local_gradients: bool = True
    process_set: ProcessSet = global_process_set

    @classmethod
    def parse(
        cls,
        op: int,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        scale_local_gradients: bool = True,
        process_set: ProcessSet = global_process_set,
    ) -> GradientOptions:
        """Options from Horovod's arguments.

        Raises:
            ValueError: a predivide factor with another op than Average, or bad ``groups``/``num_groups``.
        """
        return cls(
            ReduceSpec.for_gradients(op, gradient_predivide_factor),
            resolve_groups(num_groups, groups),
            bool(sparse_as_dense),
            bool(scale_local_gradients),
            process_set,
        )


class ListAdapter(Protocol):
    """A framework's part of ``ListReducer``."""

    def key(self, source: Any) -> Any:
        """A hashable key for a source (a variable, a parameter)."""

    def densify(self, grad: Any) -> Any:
        """``grad`` as a dense tensor (a sparse one made dense; a dense one as it is)."""

    def weigh(self, grads: list[Any], process_set: ProcessSet) -> list[Any]:
        """The exchanged gradients as this rank contributes them (Keras-on-torch's ``BalancedData``: each rank's
        share of the global batch); as they are elsewhere."""

    def allreduce(self, grads: list[Any], spec: ReduceSpec, process_set: ProcessSet) -> list[Any]:
        """The grads reduced over ``process_set`` as one grouped exchange, in order."""

    def scale(self, grad: Any, factor: float, per_member_of: ProcessSet | None) -> Any:
        """``grad`` times ``factor``, and divided by ``per_member_of``'s size when given (read when the step runs,
        where the size may change between runs of a compiled step)."""

    def exchanging(self, options: GradientOptions) -> bool:
        """Whether this rank exchanges gradients (``rules.exchanges_gradients``, with the framework's view of an
        elastic job)."""


class ListReducer:
    """Reduce a list of gradients with ``options`` on a framework's ``adapter`` (see the module)."""

    def __init__(self, options: GradientOptions, adapter: ListAdapter) -> None:
        self.options = options
        self.adapter = adapter
        self.local_sources: set[Any] = set()
        """Keys of the sources whose gradients stay on this rank."""
        self.aggregation = 1.0
        """A factor on every result (the Keras optimizers' sum of accumulated gradients)."""

    @property
    def process_set(self) -> ProcessSet:
        return self.options.process_set

    @property
    def groups(self) -> int | list[list[Any]] | None:
        return self.options.groups

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local."""
        self.local_sources.add(self.adapter.key(source))

    def is_local(self, source: Any) -> bool:
        """Whether ``source``'s gradient stays local."""
        return self.adapter.key(source) in self.local_sources

    def reduce(self, grads: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        """The reduced gradients, in order; None stays None; local sources' are only scaled."""
        adapter, options = self.adapter, self.options
        grads = [adapter.densify(g) if options.sparse_as_dense and g is not None else g for g in grads]
        results = list(grads)
        shared, local = split_gradients(grads, [self.is_local(s) for s in sources])
        exchanging = adapter.exchanging(options)
        if shared:
            for index, weighed in zip(shared, adapter.weigh([grads[i] for i in shared], options.process_set), strict=True):
                grads[index] = weighed
        if exchanging:
            spec = options.spec.aggregated(self.aggregation)
            for chunk in self._chunks(shared, sources) if shared else []:
                reduced = adapter.allreduce([grads[i] for i in chunk], spec, options.process_set)
                for index, value in zip(chunk, reduced, strict=True):
                    results[index] = value
        elif self.aggregation != 1.0:
            for index in shared:
                results[index] = adapter.scale(grads[index], self.aggregation, None)
        divide = divides_local_gradients(options.scale_local_gradients, exchanging)
        if divide or self.aggregation != 1.0:
            for index in local:
                results[index] = adapter.scale(grads[index], self.aggregation, options.process_set if divide else None)
        return results

    def _chunks(self, shared: list[int], sources: Sequence[Any]) -> list[list[int]]:
        """The exchanged gradients' indices, one list per grouped allreduce."""
        groups = self.options.groups
        if groups is None:
            return [shared]
        if isinstance(groups, int):
            return split_groups(shared, groups)
        position = {self.adapter.key(v): g for g, group in enumerate(groups) for v in group}
        grouped: dict[Any, list[int]] = {}
        for index in shared:
            grouped.setdefault(position.get(self.adapter.key(sources[index]), ("alone", index)), []).append(index)
        return list(grouped.values())


def plain_exchanging(options: GradientOptions) -> bool:
    """``ListAdapter.exchanging`` for a framework without compiled steps: this rank and others are in the set."""
    return exchanges_gradients(options.process_set.size(), options.process_set.included())
