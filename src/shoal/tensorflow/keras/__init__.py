"""``import shoal.tensorflow.keras as hvd``: Horovod's ``horovod.tensorflow.keras``, i.e. ``shoal.keras`` with
Keras 3 on the TensorFlow backend (TensorFlow 2.16+ ships Keras 3 as ``tf.keras``)."""

from __future__ import annotations

import keras

if keras.backend.backend() != "tensorflow":
    raise ImportError(
        f"shoal.tensorflow.keras needs Keras's TensorFlow backend (KERAS_BACKEND={keras.backend.backend()}); "
        "use shoal.keras for the others"
    )

from shoal.keras import *  # noqa: F403
from shoal.keras import __all__, callbacks, elastic  # noqa: F401
