"""Train a small CNN on scikit-learn's digits with Keras 3's ``model.fit``, on Shoal.

Run: ``shoalrun -np 2 python examples/keras_digits.py`` (or ``python examples/keras_digits.py`` alone). Horovod's
Keras recipe with one changed import: wrap the optimizer in ``hvd.DistributedOptimizer``, scale the learning rate
by the number of ranks and warm it up, broadcast rank 0's variables when training starts, average the metrics
over the ranks, and give each rank its share of the data. Works on the TensorFlow backend (the default) and on the
torch backend (``KERAS_BACKEND=torch``). Ends with one JSON line from rank 0: {"example": "keras_digits", "world": ..,
"backend": .., "test_accuracy": ..}.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import shoal.keras as hvd
from shoal.bench.digits import load_digits, train_test_split  # scikit-learn's data and split, without its import


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 8x8 digits as (x_train, x_test, y_train, y_test), pixels in [0, 1], the same split on every rank."""
    pixels, target = load_digits()
    images = (pixels / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(images, target, test_size=0.2, seed=0)
    return x_train, x_test, y_train, y_test


def build_model() -> keras.Model:
    """A small CNN that reaches >= 0.95 test accuracy in a few epochs."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a CNN on sklearn digits with Keras and Shoal.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank; scaled by world size")
    parser.add_argument("--checkpoint", default="checkpoints/keras_digits.keras", help="where rank 0 saves the model")
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(0)
    x_train, x_test, y_train, y_test = load_data()
    shard = slice(hvd.rank(), None, hvd.size())
    model = build_model()
    scaled_lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=scaled_lr, momentum=0.9))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,  # Shoal's collectives are Python ops, not XLA ones
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2),
    ]
    model.fit(
        x_train[shard],
        y_train[shard],
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,
    )
    _, accuracy = model.evaluate(x_test[shard], y_test[shard], verbose=0)
    accuracy = float(hvd.allreduce(accuracy, name="test_accuracy"))
    if hvd.rank() == 0:
        os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
        model.save(args.checkpoint)
        summary = {
            "example": "keras_digits",
            "world": hvd.size(),
            "backend": hvd.backend(),
            "test_accuracy": round(accuracy, 4),
        }
        print(json.dumps(summary), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
