"""The digits example written for elastic training: workers may die or join, and training goes on.

Run: ``shoalrun -np 3 --min-np 2 python examples/elastic_digits.py``, then ``kill -9`` one worker: the others
restore their last commit, re-form at size 2 and finish; ``kill -TERM`` one instead (a preemption notice) and it
leaves at the next commit, with nothing rolled back. With ``--host-discovery-script`` new slots join at the next
commit and receive rank 0's state. ``--local-every H`` trains with local steps (one host is one worker, the hosts
meet every H steps; ``lost_inner_steps`` counts the steps of hosts that left before meeting). Ends with one JSON line:
{"example": "elastic_digits", "world": .., "test_accuracy": .., "committed_steps": .., "resets": .., "restores": ..,
"executed_steps": .., "lost_inner_steps": .., "epochs": [..]}. ``restores`` and
``executed_steps`` are rank 0's own (executed minus committed is the steps it redid); ``epochs`` lists, per epoch,
the distinct samples processed and how many were recorded (equal when no committed step was lost or applied twice).
A worker that leaves the job instead (a preemption notice, its host gone) prints {"example": "elastic_digits",
"left": true, "committed_steps": .., "restores": .., "executed_steps": ..} and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from digits import DigitsNet, evaluate, load_data  # the model, data and evaluation of examples/digits.py
from torch.utils.data import DataLoader

import shoal.torch as hvd
from shoal.torch.optimizer import rounds_of  # local steps' outer rounds, for the report


def main() -> None:
    parser = argparse.ArgumentParser(description="Elastic training of a CNN on sklearn digits with Shoal.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.03, help="learning rate for one worker; scaled by world size")
    parser.add_argument("--commit-every", type=int, default=4, help="commit the state every this many steps")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep this long per step (a slower model)")
    parser.add_argument("--log-every", type=int, default=10, help="rank 0 prints progress every this many steps")
    parser.add_argument(
        "--wait-for-world",
        type=int,
        default=0,
        metavar="N",
        help="after each commit, while fewer than N workers are in the job, wait for workers to join (to show a job "
        "that grows back; default 0: never wait)",
    )
    parser.add_argument(
        "--local-every",
        type=int,
        default=0,
        metavar="H",
        help="local steps (far-apart hosts, docs/far.md): each host trains on its own and the hosts meet every H "
        "steps; the outer state is part of the elastic state (default 0: synchronous data parallel)",
    )
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    train_set, test_set = load_data()
    model = DigitsNet()

    def workers() -> int:  # the ranks whose gradients each step averages: the job's, or with local steps a host's
        return hvd.local_size() if args.local_every else hvd.size()

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * workers(), momentum=0.9)
    if args.local_every:
        local = {"comm": "local", "local_steps": hvd.LocalSteps(every=args.local_every, codec="fp32")}
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), **local)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=0)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0, epoch_log=[])
    resets = 0
    restores = 0  # rollbacks to the last commit (a failed collective); a preemption notice causes none
    executed_steps = 0  # steps this process ran, rolled back or not: executed - committed = steps redone
    report_commit = False
    committed_restore = state.restore

    def counting_restore() -> None:
        nonlocal restores
        restores += 1
        committed_restore()

    state.restore = counting_restore  # type: ignore[method-assign]

    def on_reset() -> None:
        nonlocal resets, report_commit
        resets += 1
        report_commit = True
        for group in optimizer.param_groups:  # keep lr proportional to the batch each step averages
            group["lr"] = args.lr * workers()
        print(f"reset {resets}: now rank {hvd.rank()} of {hvd.size()}", flush=True)

    state.register_reset_callbacks([on_reset])
    print(f"worker pid {os.getpid()} starts as rank {hvd.rank()} of {hvd.size()}", flush=True)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> float:
        nonlocal report_commit, executed_steps
        # Runs after every sync: all workers, newcomers included, now hold rank 0's weights.
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        print(f"synced at step {state.step} as rank {hvd.rank()} of {hvd.size()}: weights checksum {checksum!r}", flush=True)
        rounds = rounds_of(optimizer)
        if rounds is not None:  # the outer state a newcomer received: the round's start and the outer momentum
            outer = [float(t.double().sum()) for s in rounds.outer.state.values() for t in s.values() if torch.is_tensor(t)]
            start = float(rounds.start.double().sum())
            print(f"outer state as rank {hvd.rank()} of {hvd.size()}: start {start!r} momentum {outer!r}", flush=True)
        while state.epoch < args.epochs:
            loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
            model.train()
            for batch_index, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.sampler.record_batch(batch_index, args.batch_size)
                state.step += 1
                executed_steps += 1
                if args.step_delay:
                    time.sleep(args.step_delay)
                if hvd.rank() == 0 and state.step % args.log_every == 0:
                    print(f"step {state.step} epoch {state.epoch} world {hvd.size()} at {time.time():.3f}", flush=True)
                if state.step % args.commit_every == 0:
                    state.commit()
                    if report_commit:  # how long recovery took: compare with the time of the failure
                        print(f"first commit after reset {resets}: step {state.step} at {time.time():.3f}", flush=True)
                        report_commit = False
                    while hvd.size() < args.wait_for_world:  # a host update ends this wait with a reset
                        state.check_host_updates()
                        time.sleep(0.05)
            state.epoch_log.append(
                {
                    "epoch": state.epoch,
                    "distinct": len(state.sampler.processed_indices),
                    "recorded": state.sampler.processed_count,
                    "world": hvd.size(),
                }
            )
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return evaluate(model, test_set)

    try:
        test_accuracy = train(state)
    except SystemExit as leaving:  # elastic.run ends a worker left out of the job (a notice, its host gone) with 0
        if not leaving.code:  # what it hands over: its last commit, and whether any step was redone before it
            left = {"committed_steps": state.step, "restores": restores, "executed_steps": executed_steps}
            print(json.dumps({"example": "elastic_digits", "left": True, **left}), flush=True)
        raise
    if hvd.rank() == 0:
        summary = {
            "example": "elastic_digits",
            "world": hvd.size(),
            "test_accuracy": round(test_accuracy, 4),
            "committed_steps": state.step,
            "resets": resets,
            "restores": restores,
            "executed_steps": executed_steps,
            "lost_inner_steps": rounds.lost_steps if (rounds := rounds_of(optimizer)) is not None else 0,
            "train_samples": len(train_set),
            "epochs": state.epoch_log,
        }
        print(json.dumps(summary), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
