"""Synthetic training benchmark, the equivalent of Horovod's ``pytorch_synthetic_benchmark.py``.

Run: ``shoalrun -np 2 python examples/synthetic_benchmark.py --model cnn``. Prints img/sec per worker for each
iteration, the mean with a 95% interval, and the total; ends with one JSON line: {"example":
"synthetic_benchmark", "world": .., "img_sec_per_worker": .., "img_sec_per_worker_ci95": .., "total_img_sec": ..}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit

import torch
import torch.nn.functional as F

import shoal.torch as hvd
from shoal.predict.models import build


def main() -> None:
    parser = argparse.ArgumentParser(description="Shoal synthetic benchmark")
    parser.add_argument("--model", choices=["cnn", "mlp", "transformer"], default="cnn")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    parser.add_argument("--num-warmup-batches", type=int, default=2, help="warm-up batches, not timed")
    parser.add_argument("--num-batches-per-iter", type=int, default=3, help="batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=5, help="benchmark iterations")
    parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression during allreduce")
    parser.add_argument("--bf16-allreduce", action="store_true", help="bf16 compression during allreduce")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model, make_input = build(args.model)
    compression = hvd.Compression.none
    if args.fp16_allreduce:
        compression = hvd.Compression.fp16
    elif args.bf16_allreduce:
        compression = hvd.Compression.bf16
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    generator = torch.Generator().manual_seed(hvd.rank())
    data = make_input(args.batch_size, generator)
    target = torch.randint(0, 10, (args.batch_size,), generator=generator)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(message: str) -> None:
        if hvd.rank() == 0:
            print(message, flush=True)

    log(f"Model: {args.model}\nBatch size: {args.batch_size}\nNumber of workers: {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    rates = []
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{iteration}: {rate:.1f} img/sec per worker")
        rates.append(rate)
    mean = statistics.mean(rates)
    ci95 = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    # The total counts every worker's own measured rate, averaged over ranks.
    per_worker = hvd.allreduce(torch.tensor(mean), name="img_sec").item()
    log(f"Img/sec per worker: {mean:.1f} +-{ci95:.1f}")
    log(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * per_worker:.1f} +-{hvd.size() * ci95:.1f}")
    summary = {
        "example": "synthetic_benchmark",
        "world": hvd.size(),
        "img_sec_per_worker": round(mean, 1),
        "img_sec_per_worker_ci95": round(ci95, 1),
        "total_img_sec": round(hvd.size() * per_worker, 1),
    }
    log(json.dumps(summary))
    hvd.shutdown()


if __name__ == "__main__":
    main()
