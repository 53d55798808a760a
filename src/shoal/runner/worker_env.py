"""One worker's environment and process, however it is started: shoalrun's local and ssh workers, Ray actors, and
Spark's barrier tasks and elastic slots all build them here."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

from shoal.config import LAUNCHER_PID_ENV
from shoal.config.worker import JobAddress, SlotInfo
from shoal.runtime.watchdog import die_with_parent


def worker_env(
    address: JobAddress,
    settings: Mapping[str, str],
    slot: SlotInfo | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The Shoal variables of one process of a job, later ones winning: the job's address (rendezvous and secret),
    its settings (``LaunchConfig.worker_env()``), the rank's identity (``slot``; None for a parameter server, which
    has no rank), then the caller's own."""
    env = address.to_env()
    env.update(settings)
    if slot is not None:
        env.update(slot.to_env())
    env.update(extra or {})
    return env


def child_env(variables: Mapping[str, str | None], threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a worker started on this machine: ``base`` (this process's by default), unbuffered
    output, ``variables`` laid over it (a None value removes that variable), ``OMP_NUM_THREADS`` when still unset,
    and this process's pid as the launcher's, so that the worker ends itself if this process is killed."""
    env = dict(os.environ if base is None else base)
    env.setdefault("PYTHONUNBUFFERED", "1")
    for name, value in variables.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env.setdefault("OMP_NUM_THREADS", str(max(1, threads)))
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    return env


def start_worker(
    argv: Sequence[str], env: Mapping[str, str], stream: bool, stdin: int = subprocess.DEVNULL, bound: bool = True
) -> subprocess.Popen[bytes]:
    """Start a worker in a session (and process group) of its own, so that it and everything it starts can be
    signalled and ended together. ``stream``: pipe its stdout and stderr (else it inherits this process's).
    ``bound``: on Linux the worker is killed when the thread that started it dies (for starters that run inside
    another framework's task or actor, whose thread ends with it)."""
    pipe = subprocess.PIPE if stream else None
    return subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=stdin,
        stdout=pipe,
        stderr=pipe,
        start_new_session=True,
        preexec_fn=die_with_parent if bound else None,
    )
