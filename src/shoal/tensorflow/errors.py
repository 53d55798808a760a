"""Shoal's exceptions out of TensorFlow's op errors.

A collective inside a ``tf.function`` runs in a ``tf.py_function``; an exception it raises reaches the caller as a
``tf.errors.OpError`` (``UnknownError``) whose message names the original class. Elastic training must see the
original: a peer that died (``HorovodInternalError``) means roll back and re-form, not crash.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt, WorkerRemovedError

Result = TypeVar("Result")
_CARRIED = (HorovodInternalError, HostsUpdatedInterrupt, WorkerRemovedError)


def carried_error(error: BaseException) -> BaseException | None:
    """The Shoal exception a TensorFlow op error carries, rebuilt with its message; None for any other error."""
    import tensorflow as tf

    if not isinstance(error, tf.errors.OpError):
        return None
    text = str(error.message)
    for kind in _CARRIED:
        for cls in _with_subclasses(kind):  # the engine raises subclasses (EngineStoppedError)
            marker = f"{cls.__name__}: "
            if marker in text:
                message = text.split(marker, 1)[1].split("\n", 1)[0]
                if kind is HostsUpdatedInterrupt:
                    return HostsUpdatedInterrupt()
                return HorovodInternalError(message) if kind is HorovodInternalError else WorkerRemovedError(message)
    return None


def _with_subclasses(kind: type) -> list[type]:
    found = [kind]
    subclasses: list[type] = kind.__subclasses__()
    for sub in subclasses:
        found.extend(_with_subclasses(sub))
    return found


def surfacing(func: Callable[..., Result]) -> Callable[..., Result]:
    """``func``, raising the Shoal exception that a TensorFlow op error from it carries (other errors unchanged)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Result:
        try:
            return func(*args, **kwargs)
        except Exception as error:
            carried = carried_error(error)
            if carried is None:
                raise
            raise carried from error

    return wrapper
