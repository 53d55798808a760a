"""An elastic job whose every step uses only unnamed requests: allreduce, allgather, barrier and SyncBatchNorm.

Unnamed requests are named by per-session counters; after a re-form, survivors and newcomers must count alike or
their requests never pair up. Each step checks its results against a reference computed from every rank's input
and prints ``step S world W ok`` (or raises). Run under shoalrun with --host-discovery-script; the test grows it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import shoal.torch as hvd


def check_step(bn: hvd.SyncBatchNorm, step: int) -> None:
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    assert total.tolist() == [float(size)] * 3, total
    ranks = hvd.allgather(torch.tensor([rank]))
    assert ranks.tolist() == list(range(size)), ranks
    hvd.barrier()
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(100 * step + rank), requires_grad=True)
    y = bn(x)
    y.sum().backward()
    every = hvd.allgather(x.detach(), name=f"sbn.inputs.{step}")  # the global batch, for the reference
    reference = F.batch_norm(every, None, None, bn.weight.detach(), bn.bias.detach(), training=True, eps=bn.eps)
    torch.testing.assert_close(y.detach(), reference[4 * rank : 4 * rank + 4], rtol=1e-4, atol=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    bn = hvd.SyncBatchNorm(2)
    state = hvd.elastic.TorchState(model=bn, step=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.step < args.steps:
            check_step(bn, state.step)
            print(f"step {state.step} world {hvd.size()} rank {hvd.rank()} ok", flush=True)
            state.step += 1
            time.sleep(args.step_delay)
            state.commit()

    train(state)
    print(f"done world {hvd.size()} rank {hvd.rank()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
