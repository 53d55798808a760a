"""TensorFlow training throughput: Shoal (``shoal.tensorflow.DistributedGradientTape`` under shoalrun) against
TensorFlow's own ``tf.distribute.MultiWorkerMirroredStrategy``, same workers, Keras model, optimizer, data and seed,
in one invocation. Both run the same custom training step in a ``tf.function`` (Keras 3's ``model.fit`` does not run
under a multi-worker strategy here: its data adapter fails on the strategy's per-replica batches).

``python -m shoal.bench.train_tf --workers 2`` runs, for each model (``digits``: the Keras digits CNN; ``mlp``: an
MLP of about 10M parameters), ``--rounds`` rounds of: the Shoal job (``shoalrun -np N``), then the
MultiWorkerMirroredStrategy job (N processes with ``TF_CONFIG`` on loopback ports); each times ``--steps`` training
steps after ``--warmup`` untimed ones, at ``--batch-size`` samples per worker; the best round of each is kept.
The last line is JSON: ``{"bench": "train_tf", "workers", "models": {name: {"shoal_ips", "tf_ips", "ratio"}},
"shoal_ips", "tf_ips", "ratio"}`` (the top-level figures are the first model's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from shoal.bench import rank0_result
from shoal.testing import free_port

SHOALRUN = [sys.executable, "-m", "shoal.runner"]
MODELS = ("digits", "mlp")


def _model(name: str) -> tuple[Any, tuple[int, ...]]:
    import keras

    if name == "digits":
        layers = [
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
        ]
        return keras.Sequential([keras.Input((8, 8, 1)), *layers, keras.layers.Dense(10)]), (8, 8, 1)
    layers = [keras.layers.Dense(2048, activation="relu") for _ in range(3)]  # 784*2048 + 2*2048^2 + ...: ~10M
    return keras.Sequential([keras.Input((784,)), *layers, keras.layers.Dense(10)]), (784,)


def _data(shape: tuple[int, ...], batch: int, seed: int) -> tuple[Any, Any]:
    import numpy as np

    generator = np.random.default_rng(seed)
    return generator.random((batch, *shape), dtype=np.float32), generator.integers(0, 10, batch)


def _timed_steps(step: Any, steps: int, warmup: int) -> float:
    """Seconds for ``steps`` calls of ``step`` after ``warmup`` untimed ones (which trace it)."""
    for _ in range(warmup):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - started


def _shoal_worker(args: argparse.Namespace) -> None:
    import keras
    import tensorflow as tf

    import shoal.tensorflow as hvd

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    model, shape = _model(args.model)
    optimizer = keras.optimizers.SGD(learning_rate=0.01)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables + list(optimizer.variables), root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = _data(shape, args.batch_size, hvd.rank())
    features, labels = tf.constant(x), tf.constant(y)

    @tf.function
    def train_step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    seconds = _timed_steps(train_step, args.steps, args.warmup)
    slowest = float(hvd.allreduce(tf.constant(seconds), op=hvd.Max, name="bench.train_tf.seconds").numpy())
    if hvd.rank() == 0:
        print(json.dumps({"ips": hvd.size() * args.batch_size * args.steps / slowest}), flush=True)
    hvd.shutdown()


def _tf_worker(args: argparse.Namespace) -> None:
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports.split(",")]},
            "task": {"type": "worker", "index": args.index},
        }
    )
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model, shape = _model(args.model)
        optimizer = keras.optimizers.SGD(learning_rate=0.01)
    x, y = _data(shape, args.batch_size * workers, args.index)  # the global batch; each replica takes its part
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().with_options(options)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    with strategy.scope():
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @tf.function
    def train_step() -> None:
        def replica_step(inputs: Any) -> None:
            features, labels = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(replica_step, args=(next(iterator),))

    seconds = _timed_steps(train_step, args.steps, args.warmup)
    if args.index == 0:
        print(json.dumps({"ips": workers * args.batch_size * args.steps / seconds}), flush=True)


def _run_tf(args: argparse.Namespace, model: str, flags: list[str]) -> float:
    ports = ",".join(str(free_port()) for _ in range(args.workers))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "shoal.bench.train_tf", "--worker", "tf", "--model", model, "--ports", ports, *flags]
    processes = [
        subprocess.Popen([*command, "--index", str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(args.workers)
    ]
    try:
        outputs = [p.communicate(timeout=args.timeout) for p in processes]
    finally:
        for process in processes:
            process.kill()
    if any(p.returncode != 0 for p in processes):
        raise SystemExit(f"the MultiWorkerMirroredStrategy job failed:\n{outputs[0][1][-3000:]}")
    return float(json.loads(outputs[0][0].strip().splitlines()[-1])["ips"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Keras throughput: Shoal against tf.distribute.MultiWorkerMirroredStrategy.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per worker per step (default 64)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps of the untimed fit before (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating Shoal/TensorFlow runs; the best kept")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launched job")
    parser.add_argument("--worker", choices=["shoal", "tf"], help=argparse.SUPPRESS)
    parser.add_argument("--model", default="digits", help=argparse.SUPPRESS)
    parser.add_argument("--ports", default="", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "shoal":
        _shoal_worker(args)
        return
    if args.worker == "tf":
        _tf_worker(args)
        return
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    flags = ["--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    results: dict[str, dict[str, float]] = {}
    for model in models:
        shoal_runs, tf_runs = [], []
        for _ in range(args.rounds):
            # The worker imports TensorFlow inside a function: preload it, as for a script that imports it at its top.
            shoal_command = [*SHOALRUN, "--preload", "tensorflow", "-np", str(args.workers), sys.executable, "-m"]
            shoal_command += ["shoal.bench.train_tf", "--worker", "shoal", "--model", model, *flags]
            shoal_runs.append(float(rank0_result(shoal_command, args.timeout, "the Shoal job")["ips"]))
            tf_runs.append(_run_tf(args, model, flags))
        shoal_ips, tf_ips = max(shoal_runs), max(tf_runs)
        results[model] = {"shoal_ips": round(shoal_ips, 1), "tf_ips": round(tf_ips, 1), "ratio": round(shoal_ips / tf_ips, 3)}
        line = f"{model}, {args.workers} workers: Shoal {shoal_ips:.1f} samples/s, "
        print(line + f"MultiWorkerMirroredStrategy {tf_ips:.1f} samples/s, ratio {shoal_ips / tf_ips:.2f}", flush=True)
    first = results[models[0]]
    print(json.dumps({"bench": "train_tf", "workers": args.workers, "batch_size": args.batch_size, "models": results, **first}))


if __name__ == "__main__":
    main()
