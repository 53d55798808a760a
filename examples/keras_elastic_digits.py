"""Elastic Keras: the digits CNN trained with ``model.fit`` while workers may die or join.

Run: ``shoalrun -np 2 --min-np 1 python examples/keras_elastic_digits.py``, then ``kill -9`` one worker: the other
restores the last commit, re-forms alone and finishes. Horovod's elastic Keras recipe with one changed import:
``hvd.elastic.KerasState`` holds the model and optimizer, ``CommitStateCallback``, ``UpdateBatchStateCallback`` and
``UpdateEpochStateCallback`` keep it current, and ``hvd.elastic.run`` restarts ``fit`` for the remaining epochs after
a reset (the learning rate follows the new world size). Works on the TensorFlow and the torch Keras backends. Ends
with one JSON line from rank 0: {"example": "keras_elastic_digits", "world": .., "backend": .., "test_accuracy": ..,
"epochs": .., "resets": ..}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from keras_digits import build_model, load_data  # the data and model of examples/keras_digits.py

import shoal.keras as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description="Elastic training of a CNN on sklearn digits with Keras and Shoal.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one worker; scaled by world size")
    parser.add_argument("--batches-per-commit", type=int, default=4)
    parser.add_argument("--batch-delay", type=float, default=0.0, help="sleep this long per batch (a slower model)")
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(0)
    x_train, x_test, y_train, y_test = load_data()
    model = build_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,
    )
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    resets = 0

    def on_state_reset() -> None:
        nonlocal resets
        resets += 1
        model.optimizer.learning_rate.assign(args.lr * hvd.size())
        print(f"reset {resets}: now rank {hvd.rank()} of {hvd.size()}", flush=True)

    state.register_reset_callbacks([on_state_reset])

    def progress(epoch: int, logs: dict[str, float] | None) -> None:
        if hvd.rank() == 0:
            print(f"epoch {state.epoch} done, world {hvd.size()}, loss {(logs or {}).get('loss', 0.0):.4f}", flush=True)

    callbacks = [
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.callbacks.MetricAverageCallback(),
        keras.callbacks.LambdaCallback(on_batch_end=lambda batch, logs: time.sleep(args.batch_delay), on_epoch_end=progress),
    ]
    print(f"worker pid {os.getpid()} starts as rank {hvd.rank()} of {hvd.size()}", flush=True)

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        shard = slice(hvd.rank(), None, hvd.size())  # this worker's share of the data at the current size
        state.model.fit(
            x_train[shard],
            y_train[shard],
            batch_size=args.batch_size,
            epochs=args.epochs - state.epoch,
            callbacks=callbacks,
            verbose=0,
        )

    train(state)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        summary = {
            "example": "keras_elastic_digits",
            "world": hvd.size(),
            "backend": hvd.backend(),
            "test_accuracy": round(float(accuracy), 4),
            "epochs": state.epoch,
            "resets": resets,
        }
        print(json.dumps(summary), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
