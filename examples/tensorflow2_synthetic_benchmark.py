"""Synthetic TensorFlow 2 training benchmark, the equivalent of Horovod's ``tensorflow2_synthetic_benchmark.py``.

Run: ``shoalrun -np 2 python examples/tensorflow2_synthetic_benchmark.py --model cnn``. A GradientTape step on
random data with ``hvd.DistributedGradientTape`` (inside ``tf.function``, or eagerly with ``--eager``); prints
img/sec per worker for each iteration, the mean with a 95% interval, and the total; ends with one JSON line:
{"example": "tensorflow2_synthetic_benchmark", "world": .., "img_sec_per_worker": .., "img_sec_per_worker_ci95": ..,
"total_img_sec": ..}. ``--model`` is ``mlp``, ``cnn`` or a ``keras.applications`` name (``ResNet50``, as Horovod's
default; weights are not downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import shoal.tensorflow as hvd


def build(name: str) -> tuple[tf.keras.Model, tuple[int, ...]]:
    """The model and one sample's input shape."""
    if name == "mlp":
        layers = [tf.keras.layers.Dense(1024, activation="relu"), tf.keras.layers.Dense(1024, activation="relu")]
        return tf.keras.Sequential([tf.keras.Input((784,)), *layers, tf.keras.layers.Dense(10)]), (784,)
    if name == "cnn":
        layers = [
            tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            tf.keras.layers.MaxPooling2D(2),
            tf.keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            tf.keras.layers.MaxPooling2D(2),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(256, activation="relu"),
        ]
        return tf.keras.Sequential([tf.keras.Input((32, 32, 3)), *layers, tf.keras.layers.Dense(10)]), (32, 32, 3)
    return getattr(tf.keras.applications, name)(weights=None, classes=10), (224, 224, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description="TensorFlow 2 synthetic benchmark on Shoal")
    parser.add_argument("--model", default="ResNet50", help="mlp, cnn or a keras.applications model name")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    parser.add_argument("--num-warmup-batches", type=int, default=3, help="warm-up batches, not timed")
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=5, help="benchmark iterations")
    parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression during allreduce")
    parser.add_argument("--eager", action="store_true", help="run the step eagerly instead of in tf.function")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ.get("OMP_NUM_THREADS", "0")))
    model, shape = build(args.model)
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    generator = np.random.default_rng(hvd.rank())
    data = tf.constant(generator.random((args.batch_size, *shape), dtype=np.float32))
    target = tf.constant(generator.integers(0, 10, args.batch_size))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(first: bool) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first:  # every rank starts from rank 0's weights and optimizer state
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)

    run = step if args.eager else tf.function(step)

    def log(message: str) -> None:
        if hvd.rank() == 0:
            print(message, flush=True)

    log(f"Model: {args.model}\nBatch size: {args.batch_size}\nNumber of workers: {hvd.size()}")
    run(True)
    timeit.timeit(lambda: run(False), number=args.num_warmup_batches)
    rates = []
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(lambda: run(False), number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{iteration}: {rate:.1f} img/sec per worker")
        rates.append(rate)
    mean = statistics.mean(rates)
    ci95 = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    per_worker = float(hvd.allreduce(tf.constant(mean), name="img_sec").numpy())  # every worker's own rate, averaged
    log(f"Img/sec per worker: {mean:.1f} +-{ci95:.1f}")
    log(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * per_worker:.1f} +-{hvd.size() * ci95:.1f}")
    summary = {
        "example": "tensorflow2_synthetic_benchmark",
        "world": hvd.size(),
        "img_sec_per_worker": round(mean, 1),
        "img_sec_per_worker_ci95": round(ci95, 1),
        "total_img_sec": round(hvd.size() * per_worker, 1),
    }
    log(json.dumps(summary))
    hvd.shutdown()


if __name__ == "__main__":
    main()
