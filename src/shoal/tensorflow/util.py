"""``horovod.tensorflow.util``'s helpers, which Horovod's code and tests call as ``hvd.util``: whether TensorFlow
runs eagerly, a function traced into a graph, a cache of per-mode results, and variables as hashable references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (False inside a ``tf.function`` or a ``tf.compat.v1`` graph)."""
    return bool(tf.executing_eagerly())


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` traced into a graph (a ``tf.function``)."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` remembering its result per arguments and execution mode (eager or graph)."""
    results: dict[tuple[Any, bool], Any] = {}

    def cached(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]

    return cached


def vars_to_refs(variables: Any) -> Any:
    """A variable, or nested lists of them, as hashable references (tuples for lists)."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """``vars_to_refs`` undone: the variables again (lists for tuples)."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
