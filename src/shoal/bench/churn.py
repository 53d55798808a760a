"""What churn costs: an elastic job under seeded random failures, notices and host changes, against a static job.

``python -m shoal.bench.churn --workers 3 --minutes 5 --mean-interval 30`` trains the digits CNN (scikit-learn's
digits; needs ``pip install 'shoal[examples]'``) for ``--minutes`` twice, under shoalrun, in one invocation:

1. a static job of ``--workers`` workers (``shoalrun -H ...``);
2. an elastic job over the same hosts (``--host-discovery-script``, ``--min-np 1``, ``--blacklist-cooldown-range``)
   while, at random times (exponential gaps of mean ``--mean-interval`` seconds, from ``--seed``), one of these
   happens: a worker is SIGKILLed (``kill``), a worker gets SIGTERM, a preemption notice (``term``), a host leaves
   the discovery output (``remove``). A removed host comes back (``return``) after its own exponential delay, of
   mean ``--return-after`` seconds (default ``--mean-interval``), as a preempted machine is replaced.

The hosts are this machine under several local names (``localhost``, ``127.0.0.1``, its host name), so the workers
form separate hosts that talk over loopback TCP; each worker uses one thread. Progress (events, shoalrun's
re-forms, rank 0's steps) is printed as it goes. The last line is JSON:
``{"bench": "churn", "goodput_ratio", "events", "recovery_s", "steps_redone", "steps_redone_by_kind", "lost_steps",
"leftover_processes", "accuracy", "static_accuracy", ...}``:

- ``goodput_ratio``: committed samples per second of training, churned ÷ static;
- ``capacity_ratio``: the workers the churned job had over time (``mean_world``) ÷ ``--workers``: the share of the
  machine churn left it, whatever the framework does; ``goodput_ratio`` well below it is the framework's cost;
- ``recovery_s``: per kind, the mean seconds from an event to the first commit of the job re-formed after it;
- ``steps_redone``: steps run again after a rollback (each attributed to the event before it);
- ``lost_steps``: committed steps missing from, or repeated in, the committed log 0..N-1 (must be 0);
- ``leftover_processes``: workers alive 10 s after the job ended (must be 0);
- ``global_batches``: the samples per step the churned job trained with, every size seen. Without ``--balanced``
  it follows the world (``--batch-size`` per worker, learning rate rescaled at each reset); with ``--balanced`` both
  jobs use ``hvd.BalancedLoader`` with a global batch of ``--batch-size`` x ``--workers`` and one learning rate, and
  this is one size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.runner.preload import FRAMEWORK_MODULES

# The workers import torch in functions, which --preload auto does not see: each (and each replacement) forks anyway.
SHOALRUN = [sys.executable, "-m", "shoal.runner", "--preload", ",".join(FRAMEWORK_MODULES["torch"])]
KINDS = ("kill", "term", "remove", "return")
DRAWN = ("kill", "term", "remove")
"""The kinds drawn at random times; each ``remove`` schedules its host's ``return``."""
_PID_LINE = re.compile(r"churn worker pid (\d+) host (\S+)")
_JOINED_LINE = re.compile(r"churn worker pid (\d+) joined")
_REFORM_LINE = re.compile(r"shoalrun: re-forming the job with \d+ workers \((.*)\); reset \d+")
_REASONS = {
    "kill": re.compile(r"worker \S+ failed"),
    "term": re.compile(r"worker \S+ is leaving after"),
    "remove": re.compile(r"a host left the discovery output"),
    "return": re.compile(r"new workers are ready to join"),
}
"""How shoalrun names the re-form each kind of event causes."""


# ----- the training, in every worker -----


def _digits() -> tuple[Any, Any]:
    from shoal.bench.digits import load_digits_tensors

    return load_digits_tensors()


def _worker_job(args: argparse.Namespace, train_set: Any) -> tuple[Any, Any, Any, Any]:
    """The worker's model, DistributedOptimizer, BalancedLoader (or None) and elastic state. Balanced: one global
    batch of --batch-size x --workers whatever the world, so the learning rate never changes."""
    import torch
    from torch import nn

    import shoal.torch as hvd

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )
    lr = args.lr * (args.workers if args.balanced else hvd.size())
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    balanced = None
    if args.balanced:
        balanced = hvd.BalancedLoader(train_set, args.batch_size * args.workers, args.micro_batch_size, seed=0)
        extra: dict[str, Any] = {"loader": balanced}
    else:
        extra = {"sampler": hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=0)}
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), loader=balanced)
    state = hvd.elastic.TorchState(
        model=model, optimizer=optimizer, epoch=0, step=0, samples=0, log=[], deadline=0.0, batches=[], **extra
    )
    return model, optimizer, balanced, state


def _worker(args: argparse.Namespace) -> None:
    """Train for ``args.seconds`` (agreed at commits), logging every step run and every commit to ``args.log``."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import shoal.torch as hvd
    from shoal.config import env_name

    torch.set_num_threads(1)
    print(f"churn worker pid {os.getpid()} host {os.environ.get(env_name('HOSTNAME'), '?')}", flush=True)
    hvd.init()
    train_set, test_set = _digits()
    model, optimizer, balanced, state = _worker_job(args, train_set)
    state.deadline = time.time() + args.seconds  # the first sync keeps rank 0's: every worker stops together
    log = open(args.log, "a", buffering=1)  # kept open for the whole run; lines are appended

    def on_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    if not args.balanced:
        state.register_reset_callbacks([on_reset])

    def stop_now() -> bool:
        late = torch.tensor([1.0 if time.time() >= state.deadline else 0.0])
        return bool(hvd.allreduce(late, op=hvd.Max, name="churn.stop").item() > 0)

    said = [0.0]

    @hvd.elastic.run
    def train(state: Any) -> None:
        print(f"churn worker pid {os.getpid()} joined at step {state.step} as rank {hvd.rank()} of {hvd.size()}", flush=True)
        while True:
            for samples in _steps(state):
                state.log.append(state.step)
                state.step += 1
                state.samples += samples
                if samples not in state.batches:
                    state.batches.append(samples)
                if args.step_delay:
                    time.sleep(args.step_delay)
                if state.step % args.commit_every == 0:
                    state.commit()
                    if hvd.rank() == 0:
                        log.write(f"commit {state.step} {time.time():.3f} {hvd.size()}\n")
                        if time.time() - said[0] >= 15:
                            said[0] = time.time()
                            print(f"churn progress: step {state.step}, {hvd.size()} workers", flush=True)
                    if stop_now():
                        return
            state.epoch += 1
            if not args.balanced:
                state.sampler.set_epoch(state.epoch)
            state.commit()

    def _steps(state: Any) -> Any:
        """Train the epoch's remaining steps; yields each step's global batch (samples over all workers)."""
        if balanced is not None:
            balanced.set_epoch(state.epoch)
            for step in balanced:
                if hvd.rank() == 0:
                    log.write(f"run {state.step} {time.time():.3f}\n")
                optimizer.zero_grad()
                for x, y in step:
                    F.cross_entropy(model(x), y).backward()
                optimizer.step()
                yield step.plan.total_samples
            return
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
        for batch_index, (x, y) in enumerate(loader):
            if hvd.rank() == 0:
                log.write(f"run {state.step} {time.time():.3f}\n")
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.sampler.record_batch(batch_index, args.batch_size)
            yield len(x) * hvd.size()

    train(state)
    model.eval()
    with torch.no_grad():
        x_test, y_test = test_set.tensors
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    if hvd.rank() == 0:
        committed = state.log
        expected = set(range(state.step))
        summary = {
            "committed_steps": state.step,
            "samples": state.samples,
            "missing_steps": len(expected - set(committed)),
            "repeated_steps": len(committed) - len(set(committed)),
            "accuracy": round(accuracy, 4),
            "world": hvd.size(),
            "global_batches": sorted(state.batches),
            "train_s": round(time.time() - (state.deadline - args.seconds), 3),  # since the job's first worker began
        }
        print("churn summary " + json.dumps(summary), flush=True)
    hvd.shutdown()


# ----- the benchmark driver -----


@dataclass
class Event:
    kind: str
    at: float
    """Wall-clock time."""
    target: str


@dataclass
class Run:
    """One shoalrun job: its process, its output lines and the worker pids it printed."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reforms: list[tuple[float, str]] = field(default_factory=list)
    """When shoalrun said it re-forms the job, and why."""
    hosts: dict[int, str] = field(default_factory=dict)
    """Worker pid -> the host it was started for."""
    joined: set[int] = field(default_factory=set)
    """Pids that joined the training (they hold its state)."""
    show: bool = True

    def read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            reform = _REFORM_LINE.match(line)
            if reform:
                self.reforms.append((time.time(), reform.group(1)))
            match = _PID_LINE.search(line)
            if match:
                self.hosts[int(match.group(1))] = match.group(2)
            match = _JOINED_LINE.search(line)
            if match:
                self.joined.add(int(match.group(1)))
            if self.show and (line.startswith("shoalrun:") or "churn summary" in line or "churn progress" in line):
                print(f"  {line}", flush=True)

    def live_pids(self) -> list[int]:
        return sorted(p for p in self.hosts if _alive(p))

    def summary(self) -> dict[str, Any]:
        for line in reversed(self.lines):
            if "churn summary " in line:
                summary: dict[str, Any] = json.loads(line.split("churn summary ", 1)[1])
                return summary
        raise RuntimeError("the job printed no summary; its last lines:\n" + "\n".join(self.lines[-30:]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


def local_hosts(workers: int) -> list[tuple[str, int]]:
    """This machine under distinct local names, with the workers spread over them: ``[(host, slots), ...]``."""
    names = list(dict.fromkeys(["localhost", "127.0.0.1", socket.gethostname()]))
    names = names[: max(1, min(len(names), workers))]
    base, extra = divmod(workers, len(names))
    return [(name, base + (1 if i < extra else 0)) for i, name in enumerate(names)]


def _start(command: list[str], show: bool) -> Run:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run = Run(process, show=show)
    threading.Thread(target=run.read, daemon=True).start()
    return run


def _worker_command(args: argparse.Namespace, log: Path) -> list[str]:
    command = [sys.executable, "-m", "shoal.bench.churn", "--worker", "--seconds", str(args.minutes * 60), "--log", str(log)]
    command += ["--batch-size", str(args.batch_size), "--step-delay", str(args.step_delay)]
    command += ["--commit-every", str(args.commit_every), "--lr", str(args.lr), "--workers", str(args.workers)]
    return [*command, "--micro-batch-size", str(args.micro_batch_size), *(["--balanced"] if args.balanced else [])]


def _wait(run: Run, limit_s: float) -> int:
    try:
        code = run.process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        run.process.terminate()
        run.process.wait(timeout=30)
        raise RuntimeError(f"the job ran past {limit_s:.0f} s; its last lines:\n" + "\n".join(run.lines[-30:])) from None
    time.sleep(0.5)  # let the reader take the last lines
    return code


def _churn(
    run: Run, hosts: list[tuple[str, int]], hosts_file: Path, args: argparse.Namespace, rng: random.Random
) -> list[Event]:
    """Inject events until the job ends; returns them in order."""
    events: list[Event] = []
    returns: list[tuple[float, tuple[str, int]]] = []  # when each removed host comes back
    leaving: set[int] = set()  # workers killed or given notice
    offered = list(hosts)
    started = time.time()
    planned: list[float] = []  # --events N: that many, at uniform random times within 10-80 % of the run
    if args.events is not None:
        planned = [*sorted(started + rng.uniform(0.1, 0.8) * args.minutes * 60 for _ in range(args.events)), math.inf]
        next_at = planned.pop(0)
    else:
        next_at = started + rng.expovariate(1.0 / args.mean_interval)
    while run.process.poll() is None:
        due = [item for item in returns if item[0] <= time.time()]
        if due:
            returns.remove(due[0])
            offered.append(due[0][1])
            events.append(_event("return", due[0][1][0], offered, hosts_file, started))
            continue
        if time.time() < next_at:
            time.sleep(0.1)
            continue
        live = run.live_pids()
        # Workers that hold the training state and stay: not given notice, not on a removed host (those leave).
        holders = [p for p in live if p in run.joined and p not in leaving and run.hosts[p] in dict(offered)]
        # Never take the last worker that holds the training state: the job could not go on from newcomers.
        removable = [h for h in offered if any(run.hosts[p] != h[0] and run.hosts[p] in dict(offered) for p in holders)]
        possible = [
            kind
            for kind in DRAWN
            if (kind in ("kill", "term") and len(holders) >= 2) or (kind == "remove" and len(offered) >= 2 and removable)
        ]
        if not possible:  # nothing may happen now (one worker holds the state)
            if args.events is None:  # a Poisson process skips this event; deferring would pile events onto the
                next_at = time.time() + rng.expovariate(1.0 / args.mean_interval)  # moment capacity comes back
            else:  # exactly --events of them: a bit later
                next_at = time.time() + 1.0
            continue
        if args.events is None:
            next_at = time.time() + rng.expovariate(1.0 / args.mean_interval)
        else:
            next_at = planned.pop(0) if planned else math.inf
        kind = rng.choice(possible)
        if kind in ("kill", "term"):
            pid = rng.choice(live)
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
            leaving.add(pid)
            target = f"pid {pid}"
        else:
            host = rng.choice(removable)
            offered.remove(host)
            leaving.update(p for p in live if run.hosts[p] == host[0])
            returns.append((time.time() + rng.expovariate(1.0 / args.return_after), host))
            target = host[0]
        events.append(_event(kind, target, offered, hosts_file, started))
    return events


def _event(kind: str, target: str, offered: list[tuple[str, int]], hosts_file: Path, started: float) -> Event:
    """Record (and print) an event; a host change rewrites the discovery output."""
    if kind in ("remove", "return"):
        hosts_file.write_text("".join(f"{name}:{slots}\n" for name, slots in offered))
    event = Event(kind, time.time(), target)
    print(f"churn: {event.at - started:6.1f} s  {kind:6s} {target}", flush=True)
    return event


def _read_log(path: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float, int]]]:
    runs: list[tuple[int, float]] = []
    commits: list[tuple[int, float, int]] = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["run"]:
            runs.append((int(parts[1]), float(parts[2])))
        elif parts[:1] == ["commit"]:
            commits.append((int(parts[1]), float(parts[2]), int(parts[3])))
    return runs, commits


def analyse(
    events: list[Event], reforms: list[tuple[float, str]], runs: list[tuple[int, float]], commits: list[tuple[int, float, int]]
) -> dict[str, Any]:
    """Recovery time and redone steps per kind of event, from shoalrun's re-forms and rank 0's log.

    An event's recovery ends at the first commit after the first re-form, before the next event, that shoalrun gave
    for that kind of event (an event that caused none, such as removing a host that had no worker, has no recovery
    time). A step run twice is a redone step, charged to the last event before its second run. ``mean_world`` is
    the number of workers over time, from one commit to the next.
    """
    recovery: dict[str, list[float]] = {kind: [] for kind in KINDS}
    used: set[int] = set()
    for index, event in enumerate(events):
        before = events[index + 1].at if index + 1 < len(events) else math.inf
        match = next(
            (
                i
                for i, (t, why) in enumerate(reforms)
                if event.at <= t < before and i not in used and _REASONS[event.kind].search(why)
            ),
            None,
        )
        if match is None:
            continue
        used.add(match)
        commit = next((t for _, t, _ in commits if t > reforms[match][0]), None)
        if commit is not None:
            recovery[event.kind].append(commit - event.at)
    redone: dict[str, int] = {kind: 0 for kind in KINDS}
    seen: set[int] = set()
    total_redone = 0
    for step, when in runs:
        if step in seen:
            total_redone += 1
            cause = next((e.kind for e in reversed(events) if e.at <= when), None)
            if cause is not None:
                redone[cause] += 1
        seen.add(step)
    span = commits[-1][1] - commits[0][1] if len(commits) > 1 else 0.0
    weighted = sum((b[1] - a[1]) * a[2] for a, b in itertools.pairwise(commits))
    return {
        "mean_world": round(weighted / span, 2) if span > 0 else None,
        "recovery_s": {kind: round(sum(v) / len(v), 2) for kind, v in recovery.items() if v},
        "steps_redone": total_redone,
        "steps_redone_by_kind": redone,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shoal.bench.churn", description="Goodput of an elastic job under churn, against a static job."
    )
    parser.add_argument("--workers", type=int, default=3, help="workers of both jobs (default 3)")
    parser.add_argument("--minutes", type=float, default=5.0, help="training time of each job (default 5)")
    parser.add_argument("--mean-interval", type=float, default=30.0, help="mean seconds between events (default 30)")
    parser.add_argument(
        "--events",
        type=int,
        default=None,
        help="exactly this many events, at random times (default: a Poisson process)",
    )
    parser.add_argument(
        "--return-after",
        type=float,
        default=None,
        help="mean seconds before a removed host comes back (default: --mean-interval)",
    )
    parser.add_argument("--seed", type=int, default=None, help="the events' seed (default: random, printed)")
    parser.add_argument("--cooldown", type=float, nargs=2, default=(5.0, 10.0), metavar=("MIN", "MAX"))
    parser.add_argument("--grace", type=float, default=10.0, help="--preemption-grace-seconds (default 10)")
    parser.add_argument("--batch-size", type=int, default=16, help="per-worker batch (default 16)")
    parser.add_argument("--step-delay", type=float, default=0.02, help="seconds of sleep per step (default 0.02)")
    parser.add_argument("--commit-every", type=int, default=4, help="steps per commit (default 4)")
    parser.add_argument("--lr", type=float, default=0.03, help="learning rate of one worker (default 0.03)")
    parser.add_argument(
        "--balanced",
        action="store_true",
        help="both jobs train with hvd.BalancedLoader: a global batch of --batch-size x --workers whatever the world "
        "(no learning-rate rescaling), shared out by speed",
    )
    parser.add_argument("--micro-batch-size", type=int, default=8, help="with --balanced: samples per micro-batch (default 8)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--log", default="", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.workers < 2 or args.minutes <= 0 or args.mean_interval <= 0 or (args.return_after or 1) <= 0:
        parser.error("need --workers >= 2, --minutes > 0, --mean-interval > 0 and --return-after > 0")
    if args.return_after is None:
        args.return_after = args.mean_interval
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    rng = random.Random(seed)
    hosts = local_hosts(args.workers)
    print(f"churn: seed {seed}; hosts {', '.join(f'{h}:{s}' for h, s in hosts)}; {args.minutes:g} min per job", flush=True)
    limit_s = args.minutes * 60 + 300
    with tempfile.TemporaryDirectory(prefix="shoal-churn-") as tmp:
        work = Path(tmp)
        spec = ",".join(f"{h}:{s}" for h, s in hosts)

        print("churn: static job", flush=True)
        static_log = work / "static.log"
        static = _start([*SHOALRUN, "-np", str(args.workers), "-H", spec, *_worker_command(args, static_log)], show=True)
        if _wait(static, limit_s) != 0:
            raise SystemExit("churn: the static job failed; its last lines:\n" + "\n".join(static.lines[-30:]))
        static_summary = static.summary()

        print("churn: elastic job under churn", flush=True)
        hosts_file = work / "hosts"
        hosts_file.write_text("".join(f"{h}:{s}\n" for h, s in hosts))
        script = work / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
        script.chmod(0o755)
        churn_log = work / "churn.log"
        flags = ["-np", str(args.workers), "--min-np", "1", "--max-np", str(args.workers)]
        flags += ["--host-discovery-script", str(script), "--blacklist-cooldown-range", *map(str, args.cooldown)]
        flags += ["--preemption-grace-seconds", str(args.grace), "--elastic-timeout", "120"]
        churned = _start([*SHOALRUN, *flags, *_worker_command(args, churn_log)], show=True)
        events = _churn(churned, hosts, hosts_file, args, rng)
        code = _wait(churned, limit_s)
        deadline = time.monotonic() + 10
        while churned.live_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        leftover = churned.live_pids()
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        if code != 0:
            raise SystemExit(f"churn: the elastic job exited {code}; its last lines:\n" + "\n".join(churned.lines[-30:]))
        churn_summary = churned.summary()
        runs, commits = _read_log(churn_log)

    analysis = analyse(events, churned.reforms, runs, commits)
    static_rate = static_summary["samples"] / static_summary["train_s"]
    churn_rate = churn_summary["samples"] / churn_summary["train_s"]
    result = {
        "bench": "churn",
        "workers": args.workers,
        "minutes": args.minutes,
        "mean_interval_s": args.mean_interval,
        "return_after_s": args.return_after,
        "seed": seed,
        "goodput_ratio": round(churn_rate / static_rate, 3),
        # The workers the job had over time, as a share of --workers: what churn took away whatever the framework.
        "capacity_ratio": round(analysis["mean_world"] / args.workers, 3) if analysis["mean_world"] else None,
        "static_samples_per_s": round(static_rate, 1),
        "churn_samples_per_s": round(churn_rate, 1),
        "events": {kind: sum(1 for e in events if e.kind == kind) for kind in KINDS},
        **analysis,
        "lost_steps": churn_summary["missing_steps"] + churn_summary["repeated_steps"],
        "leftover_processes": len(leftover),
        "accuracy": churn_summary["accuracy"],
        "static_accuracy": static_summary["accuracy"],
        "final_world": churn_summary["world"],
        "committed_steps": churn_summary["committed_steps"],
        "balanced": args.balanced,
        # Samples per step over all workers, every size seen in the churned job (one, with --balanced).
        "global_batches": churn_summary["global_batches"],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
