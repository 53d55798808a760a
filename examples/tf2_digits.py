"""Train a small CNN on scikit-learn's digits with TensorFlow 2 and a GradientTape loop, on Shoal.

Run: ``shoalrun -np 2 python examples/tf2_digits.py`` (or ``python examples/tf2_digits.py`` as a single process).
Horovod's TensorFlow 2 recipe with one changed import: shard the data by rank, wrap the tape in
``hvd.DistributedGradientTape``, broadcast the variables from rank 0 after the first step, scale the learning rate
by the number of ranks. Ends with one JSON line from rank 0: {"example": "tf2_digits", "world": ..,
"test_accuracy": ..}.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import shoal.tensorflow as hvd
from shoal.bench.digits import load_digits, train_test_split  # scikit-learn's data and split, without its import


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits as (N, 8, 8, 1) float32 in [0, 1], split 80/20 with a fixed seed (as examples/digits.py)."""
    pixels, target = load_digits()
    images = (pixels / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(images, target, test_size=0.2, seed=0)
    return x_train, x_test, y_train, y_test


def build_model() -> tf.keras.Model:
    return tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 1)),
            tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            tf.keras.layers.MaxPooling2D(2),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(10),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a CNN on sklearn digits with TensorFlow 2 and Shoal.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank; scaled by world size")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tf.random.set_seed(0)
    x_train, x_test, y_train, y_test = load_data()
    shard = slice(hvd.rank(), None, hvd.size())  # this rank's share of the training set
    dataset = tf.data.Dataset.from_tensor_slices((x_train[shard], y_train[shard]))
    model = build_model()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tf.keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9)

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor, first: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first:  # after the first step the optimizer's slots exist: give every rank rank 0's state
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    first = True
    for epoch in range(args.epochs):
        losses = []
        for x, y in dataset.shuffle(len(x_train), seed=epoch).batch(args.batch_size):
            losses.append(float(train_step(x, y, first)))
            first = False
        mean_loss = hvd.allreduce(tf.constant(np.mean(losses), tf.float32), name="epoch.loss").numpy()
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: train loss {mean_loss:.4f}", flush=True)

    correct = tf.reduce_sum(tf.cast(tf.argmax(model(x_test[shard]), 1) == y_test[shard], tf.float32))
    totals = hvd.allreduce(tf.stack([correct, float(len(y_test[shard]))]), op=hvd.Sum, name="eval.correct").numpy()
    if hvd.rank() == 0:
        summary = {"example": "tf2_digits", "world": hvd.size(), "test_accuracy": round(float(totals[0] / totals[1]), 4)}
        print(json.dumps(summary), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
