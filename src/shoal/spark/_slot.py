"""The executor side of ``shoal.spark.run_elastic``: a Spark task that is a slot for elastic workers.

Each slot is the one task of its own Spark job, so a slot that dies (its executor lost, its Python worker killed)
fails only its own job. The task registers its host in the job's store, then waits for the driver's commands:
command ``n`` is a worker's environment; the task starts ``python -m shoal.runner.task`` with it (in a session of
its own, dying with the task), forwards the signals the driver sends, and reports the worker's exit code. It ends
when the driver writes the job's ``end`` key.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from shoal.spark._task import TaskSettings

POLL_S = 0.1
END_KEY = "slots/end"


def slot_key(slot: int, *parts: object) -> str:
    return "/".join(["slots", str(slot), *map(str, parts)])


def _orphaned(parent: int) -> bool:
    """True once the task's parent (the executor's Python daemon) is gone: the executor was lost."""
    return os.getppid() != parent


def _wait_for_command(store: Any, slot: int, index: int, parent: int) -> bytes | None:
    """Command ``index``, or None once the job ends (or the executor is gone)."""
    key = slot_key(slot, "cmd", index)
    while not _orphaned(parent):
        if store.check([key]):
            return bytes(store.get(key))
        if store.check([END_KEY]):
            return None
        time.sleep(POLL_S)
    return None


def _start_worker(settings: TaskSettings, command: dict[str, str]) -> subprocess.Popen[bytes]:
    from shoal.runner.worker_env import child_env, start_worker

    env = child_env({**settings.env, **command}, _task_cpus())  # the user's variables, then the driver's for the rank
    return start_worker([settings.executable or sys.executable, "-m", "shoal.runner.task"], env, settings.stream_output)


def _task_cpus() -> int:
    from pyspark import TaskContext

    context = TaskContext.get()
    return max(1, int(context.cpus())) if context is not None else 1


def _serve(store: Any, slot: int, index: int, process: subprocess.Popen[bytes], parent: int) -> int:
    """Forward the driver's signals for command ``index`` until the worker exits; its exit code (the worker is
    ended when the executor is gone)."""
    sent = 0
    count_key = slot_key(slot, "sigs", index)
    while process.poll() is None:
        if _orphaned(parent):
            return -int(signal.SIGKILL)  # the caller ends the worker's group
        if store.check([count_key]):
            for number in range(sent, int(store.add(count_key, 0))):
                try:
                    os.killpg(process.pid, int(store.get(slot_key(slot, "sig", index, number))))
                except ProcessLookupError:
                    pass
                sent = number + 1
        time.sleep(POLL_S)
    return int(process.returncode)


def run_slot(settings: TaskSettings, slot: int) -> Iterator[int]:
    """The body of a slot's task; yields the number of workers it ran."""
    from pyspark import TaskContext

    from shoal.comm.store import connect_job_store
    from shoal.runner.task import task_prefix
    from shoal.spark._task import _end_group, start_pumps

    context = TaskContext.get()
    if context is not None and context.attemptNumber() > 0:
        # Spark re-ran the task (its executor was lost): this slot's workers are gone, so the attempt ends at once
        # and the driver puts a new slot in its place, rather than replaying commands meant for the first attempt.
        yield 0
        return
    parent = os.getppid()
    store = connect_job_store(
        settings.addr, settings.port, settings.secret, settings.start_timeout, task_prefix(settings.secret)
    )
    store.set(slot_key(slot, "host"), socket.gethostname())
    index = 0
    while (raw := _wait_for_command(store, slot, index, parent)) is not None:
        label, command = pickle.loads(raw)
        process = _start_worker(settings, command)
        pumps = start_pumps(process, store, label) if settings.stream_output else []
        try:
            code = _serve(store, slot, index, process, parent)
            for pump in pumps:
                pump.join(timeout=5)
        finally:
            _end_group(process)
        store.set(slot_key(slot, "exit", index), str(code))
        index += 1
    yield index


def signal_number(sig: int) -> bytes:
    """A signal as the driver writes it for a slot."""
    return str(int(signal.Signals(sig))).encode()
