"""Keras 2 (``tf_keras``) or Keras 3: which one an object belongs to, and the few calls that differ between them.

Most TensorFlow code written for Horovod is Keras 2 code: ``tf_keras``, which ``tf.keras`` is when
``TF_USE_LEGACY_KERAS=1``. Shoal serves both. What it is given decides: an optimizer, a model or a variable of
``tf_keras`` takes the Keras 2 path, anything else Keras 3. What is built before any model exists (a callback, a
``SyncBatchNormalization`` layer) follows ``tf.keras``.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np


def is_keras2(obj: Any) -> bool:
    """True for an object (an optimizer, model, layer) of Keras 2 (``tf_keras``)."""
    return any(cls.__module__.startswith("tf_keras") for cls in type(obj).__mro__)


def keras2_module() -> Any:
    """The ``tf_keras`` module.

    Raises:
        ImportError: ``tf_keras`` is not installed (``pip install tf_keras``), with that hint.
    """
    try:
        import tf_keras
    except ImportError as error:
        raise ImportError("Keras 2 needs the tf_keras package: pip install tf_keras (matching TensorFlow's version)") from error
    return tf_keras


def tf_keras_is_keras2() -> bool:
    """True when ``tf.keras`` is Keras 2 (``TF_USE_LEGACY_KERAS=1`` with ``tf_keras`` installed)."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")


def optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables: a property in Keras 3, a method in Keras 2 (``opt.variables()``)."""
    variables = optimizer.variables
    if callable(variables) and not isinstance(variables, list):
        variables = variables()
    return list(variables)


def build_optimizer(optimizer: Any, trainable: list[Any]) -> None:
    """Create the optimizer's slot variables now, so that they can be broadcast before the first step."""
    if is_keras2(optimizer):
        if hasattr(optimizer, "_create_all_weights"):  # a legacy optimizer (OptimizerV2)
            optimizer._create_all_weights(trainable)
        else:
            optimizer.build(trainable)
    elif not optimizer.built:
        optimizer.build(trainable)


def to_numpy(value: Any) -> np.ndarray:
    """A variable's or tensor's value as a numpy array of its own (Keras 2 or 3, any backend)."""
    if hasattr(value, "numpy") and not _is_keras3_variable(value):
        return np.array(value.numpy())
    import keras

    return np.array(keras.ops.convert_to_numpy(value))


def _is_keras3_variable(value: Any) -> bool:
    return any(cls.__module__.startswith("keras.") for cls in type(value).__mro__)


def is_variable(value: Any) -> bool:
    """True for a Keras 3 variable or a TensorFlow variable (Keras 2's)."""
    if _is_keras3_variable(value) and hasattr(value, "assign"):
        return True
    try:
        import tensorflow as tf
    except ImportError:
        return False
    return isinstance(value, tf.Variable)


def saved_by_keras2(filepath: str) -> bool:
    """Whether a saved model was written by Keras 2: a SavedModel directory, or a ``.keras``/``.h5`` file whose
    recorded ``keras_version`` is 2.x."""
    if os.path.isdir(filepath):
        return True
    if zipfile.is_zipfile(filepath):
        import json

        with zipfile.ZipFile(filepath) as archive:
            names = set(archive.namelist())
            meta = "metadata.json" if "metadata.json" in names else None
            if meta is None:
                return False
            version = str(json.loads(archive.read(meta)).get("keras_version", ""))
        return version.startswith("2.")
    try:
        import h5py
    except ImportError:
        return False
    with h5py.File(filepath, "r") as handle:
        version = handle.attrs.get("keras_version", b"")
    return (version.decode() if isinstance(version, bytes) else str(version)).startswith("2.")
