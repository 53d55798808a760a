"""Errors between Shoal and TensorFlow: Horovod's TensorFlow classes for Shoal's errors, and Shoal's exceptions
back out of TensorFlow's op errors.

A collective that fails raises what Horovod's TensorFlow ops raise (``as_tf_error``): a cross-rank mismatch or use
before ``init()`` is a ``tf.errors.FailedPreconditionError``, a bad root rank or bad splits a
``tf.errors.InvalidArgumentError``, an op Horovod does not run a ``tf.errors.AbortedError``. The neutral kind comes
from ``shoal.core.rules.classify``; only the class is TensorFlow's.

A collective inside a ``tf.function`` runs in a ``tf.py_function``; an exception it raises reaches the caller as a
``tf.errors.OpError`` (``UnknownError``) whose message names the original class. Elastic training must see the
original: a peer that died (``HorovodInternalError``) means roll back and re-form, not crash.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from shoal.core.rules import ErrorKind, classify
from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt, WorkerRemovedError

Result = TypeVar("Result")
_CARRIED = (HorovodInternalError, HostsUpdatedInterrupt, WorkerRemovedError)


_TF_CLASSES = {
    ErrorKind.MISMATCH: "FailedPreconditionError",
    ErrorKind.NOT_INITIALIZED: "FailedPreconditionError",
    ErrorKind.INVALID_ARGUMENT: "InvalidArgumentError",
    ErrorKind.UNSUPPORTED_OPERATION: "AbortedError",
    ErrorKind.JOB_BROKEN: "UnknownError",
}
"""Horovod's TensorFlow classes by kind (its ops report use before ``init()`` as a precondition error too, and a broken
job as an ``UnknownError`` in every mode, which its ``elastic.run`` turns into ``HorovodInternalError``: so does
Shoal's, through ``surfacing``). An unsupported dtype keeps its Python class, TypeError (Horovod's op refuses the
dtype where it is built)."""


def as_tf_error(error: BaseException) -> BaseException:
    """``error`` as Horovod's TensorFlow raises it: a ``tf.errors`` class with the same message, or ``error`` itself."""
    import tensorflow as tf

    kind = classify(error)
    name = _TF_CLASSES.get(kind) if kind is not None else None
    if name is None:
        return error
    # A broken job's text names its Shoal class, so that elastic training finds it again (carried_error).
    text = f"{type(error).__name__}: {error}" if kind == ErrorKind.JOB_BROKEN else str(error)
    return getattr(tf.errors, name)(None, None, text)


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
