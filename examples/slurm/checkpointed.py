"""Training that survives Slurm's requeue, preemption and time limit: checkpoint on the signal, then requeue.

Slurm warns a job before it ends it: SIGTERM to every task when the job is requeued (``scontrol requeue``, a
preemption with ``PreemptMode=REQUEUE``) or cancelled, then SIGKILL ``KillWait`` seconds later (30 by default); with
``#SBATCH --signal=USR1@60``, SIGUSR1 about 60 s before the time limit. Every rank here takes SIGTERM and SIGUSR1 as a
request to stop. The ranks agree on the step to stop after (the request flag is allreduced with ``hvd.Max`` after
every step, so one rank's signal stops them all at the same step), rank 0 saves the checkpoint, and every rank exits
0. Started again (the requeued job), it loads the checkpoint and goes on from the next step, so each step is
committed once.

The data of step ``i`` is a function of ``i`` alone: a global batch of ``size x --batch-size`` samples drawn from a
generator seeded with ``i``, rank ``r`` taking the ``r``-th slice. Two ranks with ``--batch-size B`` and one process with
``--batch-size 2B`` therefore train on the same global batches, and their weights agree to float rounding.

Run: ``sbatch examples/slurm/checkpointed.sbatch`` (from the repository root). Arguments:
``--steps N --checkpoint PATH [--journal PATH] [--step-delay S]``. Rank 0 appends one line per committed step to the
journal (``<step> <SLURM_RESTART_COUNT>``) and ends with one JSON line:
{"example": "checkpointed", "world": .., "start_step": .., "end_step": .., "stopped_by": .., "restart": .., "loss": ..}.
"""

from __future__ import annotations

import signal

_requested: list[int] = []
"""The stop signals this rank has received."""


def _request_stop(signum: int, _frame: object) -> None:
    _requested.append(signum)


# Taken before anything else: Slurm's notice may come while torch is still being imported, and SIGUSR1's default
# action would end the process.
for _signum in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_signum, _request_stop)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import shoal.torch as hvd  # noqa: E402

FEATURES = 32


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole global batch of ``size`` samples: a noisy linear target, the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(size, FEATURES, generator=generator)
    target = x @ torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1) + 0.1 * torch.randn(size, 1, generator=generator)
    return x, target


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Write the checkpoint atomically: a job killed while saving keeps the previous one."""
    partial = path.with_name(path.name + ".partial")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, partial)
    os.replace(partial, path)


def main() -> None:
    parser = argparse.ArgumentParser(description="Checkpoint on Slurm's notice signals; resume when started again.")
    parser.add_argument("--steps", type=int, default=2000, help="train this many steps in all")
    parser.add_argument("--batch-size", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--checkpoint", type=Path, required=True, help="where rank 0 saves and every rank loads")
    parser.add_argument("--journal", type=Path, help="rank 0 appends '<step> <restart count>' per committed step")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep this long per step (a slower model)")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_step = 0
    if args.checkpoint.exists():  # every rank reads the same file: no broadcast needed
        saved = torch.load(args.checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_step = saved["step"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    journal = args.journal.open("a") if args.journal is not None and hvd.rank() == 0 else None

    step, stopped_by, loss = start_step, None, float("nan")
    while step < args.steps:
        x, target = global_batch(step, hvd.size() * args.batch_size)
        mine = slice(hvd.rank() * args.batch_size, (hvd.rank() + 1) * args.batch_size)
        optimizer.zero_grad()
        batch_loss = F.mse_loss(model(x[mine]), target[mine])
        batch_loss.backward()
        optimizer.step()
        step, loss = step + 1, float(batch_loss.detach())
        if journal is not None:
            journal.write(f"{step - 1} {restart}\n")
            journal.flush()
        if args.step_delay:
            time.sleep(args.step_delay)
        signalled = hvd.allreduce(torch.tensor([_requested[0] if _requested else 0]), op=hvd.Max, name="stop")
        if int(signalled) and step < args.steps:
            stopped_by = signal.Signals(int(signalled)).name
            break
    if hvd.rank() == 0:
        save(args.checkpoint, model, optimizer, step)
        summary = {
            "example": "checkpointed",
            "world": hvd.size(),
            "start_step": start_step,
            "end_step": step,
            "stopped_by": stopped_by,
            "restart": int(restart),
            "loss": round(loss, 6),
        }
        print(json.dumps(summary), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
