"""Run a function on N ranks over gloo on localhost: the helper every distributed test in Shoal uses.

``run_ranks(fn, size)`` hosts a rendezvous store in the calling process, starts ``size`` worker processes with the
same environment shoalrun would give them, calls ``fn(*args)`` in each and returns the per-rank results. A rank
that raises, exits non-zero or dies from a signal fails the call with every rank's story; a run that exceeds its
timeout is killed (each worker's whole process group) and fails too. Nothing is left running.

Workers come from a forkserver that has already imported torch, so each start costs milliseconds, not seconds.
``fn`` must be importable by name (a module-level function).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.comm.ports import free_port as free_port  # for tests and benchmarks that announce a port first
from shoal.config.worker import JobAddress, SlotInfo

_FAILURE_GRACE_S = 10.0
"""Once one rank failed, how long the others get to finish (or fail) on their own before they are killed."""

_context: Any = None


@dataclass
class RankOutcome:
    """What one rank did."""

    rank: int
    result: Any = None
    error: str | None = None
    """The formatted traceback, when ``fn`` raised."""
    exitcode: int | None = None
    """Process exit code; negative for a signal; None if it had to be killed after the timeout."""


class MultiRankError(AssertionError):
    """One or more ranks failed; the message holds each rank's traceback or exit status."""

    def __init__(self, message: str, outcomes: list[RankOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "shoal.torch"]
"""What the forkserver imports once, so that no rank pays for it: torch, and torch._dynamo, which torch imports
lazily the first time an optimizer is built (a second of CPU per rank otherwise). ``shoal.testing_freeze`` comes
after them all: it freezes their objects for the garbage collector, so that a rank's full collections (the engine
runs one at shutdown) skip them: 0.2-0.4 s less per shutdown with torch._dynamo or TensorFlow loaded."""


def preload(*modules: str) -> None:
    """Import ``modules`` once in the forkserver every rank is forked from (e.g. ``"tensorflow"``, five seconds of
    CPU per rank otherwise). Call before the first ``run_ranks``; ranks that need a fresh interpreter (another Keras
    backend than the preloaded one) pass ``fresh=True``.

    Raises:
        RuntimeError: the forkserver has already started.
    """
    if _context is not None:
        raise RuntimeError("shoal.testing.preload() must come before the first run_ranks()")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([*_PRELOAD, "shoal.testing_freeze"])
    return _context


def _rank_main(fn: Callable[..., Any], args: Sequence[Any], env: Mapping[str, str], conn: Any) -> None:
    os.setsid()  # our own process group, so that a kill reaches anything the rank starts
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        # Plain pickle, not multiprocessing's: once torch.multiprocessing is imported (Lightning does), tensors would
        # travel as shared-memory handles that die with this process before the parent reads them.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        conn.close()
        os._exit(1)
    finally:
        import shoal.torch as hvd

        if hvd.is_initialized():
            hvd.shutdown()
    conn.close()


def rank_env(rank: int, size: int, addr: str, port: int, secret: str) -> dict[str, str]:
    """The environment shoalrun gives rank ``rank`` of a single-host job of ``size``."""
    return {**JobAddress(addr, port, secret).to_env(), **SlotInfo("localhost", rank, size, rank, size, 0, 1).to_env()}


def _kill_group(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(
    processes: list[Any], connections: list[Any], timeout_s: float, failure_grace_s: float
) -> tuple[list[RankOutcome], set[int], float | None]:
    """Wait for every rank's outcome until the timeout (or the grace after a first failure); returns the outcomes,
    the ranks still running, and when the first failure was seen."""
    size = len(processes)
    outcomes = [RankOutcome(rank) for rank in range(size)]
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    pending = set(range(size))
    while pending:
        now = time.monotonic()
        limit = deadline if first_failure is None else min(deadline, first_failure + failure_grace_s)
        if now >= limit:
            break
        ready = multiprocessing.connection.wait(
            [connections[r] for r in pending] + [processes[r].sentinel for r in pending], timeout=limit - now
        )
        for rank in list(pending):
            if connections[rank] in ready:
                try:
                    status, payload = pickle.loads(connections[rank].recv_bytes())
                except EOFError:
                    status, payload = "died", None
                if status == "ok":
                    outcomes[rank].result = payload
                elif status == "error":
                    outcomes[rank].error = payload
                processes[rank].join(timeout=10)
            elif processes[rank].sentinel in ready and not connections[rank].poll():
                processes[rank].join()
            else:
                continue
            outcomes[rank].exitcode = processes[rank].exitcode
            pending.discard(rank)
            failed = outcomes[rank].error is not None or outcomes[rank].exitcode != 0
            if failed and first_failure is None:
                first_failure = time.monotonic()
    return outcomes, pending, first_failure


def run_ranks(
    fn: Callable[..., Any],
    size: int,
    args: Sequence[Any] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
    rank_env_overrides: Mapping[int, Mapping[str, str]] | None = None,
    failure_grace_s: float = _FAILURE_GRACE_S,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``size`` ranks and return the results in rank order.

    Args:
        fn: a module-level function; it typically calls ``shoal.torch.init()`` itself.
        size: number of ranks (1 to 4 on a 2-core machine).
        args: positional arguments for ``fn``, the same on every rank.
        env: extra environment for every rank (for example engine knobs).
        timeout_s: hard limit for the whole run; past it every rank is killed and the call fails.
        rank_env_overrides: extra environment for particular ranks (to give one rank a wrong secret, say).
        failure_grace_s: once a rank failed, how long the others may still run before they are killed.
        fresh: start each rank in a new interpreter instead of forking the preloaded server (slower; for ranks
            whose environment must be read at import, such as another ``KERAS_BACKEND`` than the preloaded one).

    Returns:
        ``fn``'s return value on each rank.

    Raises:
        MultiRankError: when any rank raised, exited non-zero, died or ran past the timeout.
    """
    from shoal.comm.store import host_store

    context = multiprocessing.get_context("spawn") if fresh else _forkserver()
    secret = secrets.token_hex(16)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    # The store takes ownership of the listening socket and closes it with close().
    store = host_store("127.0.0.1", port, secret, timeout_s, listen_fd=listener.detach())
    processes = []
    connections = []
    for rank in range(size):
        rank_environment = rank_env(rank, size, "127.0.0.1", port, secret)
        rank_environment.update(env or {})
        rank_environment.update((rank_env_overrides or {}).get(rank, {}))
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_rank_main, args=(fn, tuple(args), rank_environment, sender), daemon=False)
        process.start()
        sender.close()
        processes.append(process)
        connections.append(receiver)
    try:
        outcomes, pending, first_failure = _collect(processes, connections, timeout_s, failure_grace_s)
    finally:
        for process in processes:
            _kill_group(process.pid)
            process.join(timeout=5)
        for connection in connections:
            connection.close()
        store.close()
        from shoal.comm.shm import job_token, remove_job_segments

        remove_job_segments(job_token(secret))
    failures = [o for o in outcomes if o.error is not None or o.exitcode != 0]
    if failures or pending:
        lines = [f"{len(failures) or len(pending)} of {size} ranks failed:"]
        for outcome in outcomes:
            if outcome.rank in pending and first_failure is not None:
                lines.append(
                    f"--- rank {outcome.rank}: still running {failure_grace_s:.0f} s after another rank failed; killed"
                )
            elif outcome.rank in pending:
                lines.append(f"--- rank {outcome.rank}: still running after the timeout ({timeout_s:.0f} s); killed")
            elif outcome.error is not None:
                lines.append(f"--- rank {outcome.rank} raised:\n{outcome.error}")
            elif outcome.exitcode != 0:
                lines.append(f"--- rank {outcome.rank} exited with code {outcome.exitcode}")
        raise MultiRankError("\n".join(lines), outcomes)
    return [o.result for o in outcomes]
