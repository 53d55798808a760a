"""How a job starts its workers and watches them to the end: its supervisor.

A ``Job`` (``launcher.py``) hosts the store and starts processes through its spawner; its ``Supervisor`` decides which
workers run and when the job ends. ``StaticSupervisor`` is shoalrun's default: every rank at once (and the dedicated
parameter servers), and the first failure ends the job. The elastic driver (``elastic_driver.ElasticSupervisor``)
keeps a job going while workers die and hosts come and go.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shoal.runner.static_watch import StaticWatch

if TYPE_CHECKING:
    from shoal.config import LaunchConfig
    from shoal.runner.launcher import Job
    from shoal.runner.spawners import Worker

TERMINATE_GRACE_S = 2.0
"""After SIGTERM, how long workers get before SIGKILL; the whole tree is gone well within 5 s."""
SERVER_EXIT_GRACE_S = 5.0
"""Once every worker finished, how long dedicated parameter servers get to leave on their own."""


class Supervisor(Protocol):
    """Which workers a job runs and when it ends."""

    def launch(self, job: Job) -> int:
        """Start the workers and supervise them to the end; returns shoalrun's exit code."""

    def workers_on(self, job: Job, hostnames: set[str]) -> int:
        """The most workers ``job`` runs at once on the hosts ``hostnames`` (one machine's)."""

    def ending(self, job: Job) -> None:
        """``job`` is about to end every worker."""


def say_verbose(config: LaunchConfig, message: str) -> None:
    """Say ``message`` on stderr with ``--verbose``."""
    if config.verbose:
        print(f"shoalrun: {message}", file=sys.stderr, flush=True)


def describe_status(code: int) -> str:
    """A process's exit status in words: ``exited with code 3``, ``was killed by signal SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class StaticSupervisor:
    """Every rank at once, and the dedicated parameter servers; the first failed worker ends the job, and a worker
    whose heartbeat stays silent is named in seconds and fails the job at the ceiling (``StaticWatch``)."""

    def launch(self, job: Job) -> int:
        for slot in job.slots:
            job.workers.append(job.spawn(slot))
        _spawn_servers(job)
        watch = StaticWatch(job.secret)
        while True:
            interrupted = job.interrupted()
            if interrupted is not None:
                return interrupted
            failed = next((w for w in job.workers if w.returncode not in (None, 0)), None)
            if failed is not None:
                code = failed.returncode
                assert code is not None
                others = [w for w in job.workers if w is not failed and w.returncode is None]
                job.drain_output_of(failed)
                print(
                    f"shoalrun: {failed.label} on host {failed.slot.hostname} {describe_status(code)}"
                    + ("; terminating the other workers" if others else ""),
                    file=sys.stderr,
                    flush=True,
                )
                job.terminate_all()
                return 128 - code if code < 0 else code
            if all(w.returncode == 0 for w in job.workers if w.server_index is None):
                return end_servers([w for w in job.workers if w.server_index is not None], job.verbose)
            silent = watch.check(job.store, job.workers, time.monotonic())
            if silent is not None:
                return job.fail(f"rank {silent.slot.rank} on host {silent.slot.hostname} stayed silent; ending the job")
            time.sleep(0.05)

    def workers_on(self, job: Job, hostnames: set[str]) -> int:
        return sum(1 for s in job.slots if s.hostname in hostnames)

    def ending(self, job: Job) -> None:
        """Nothing to say first: the workers are ended at once."""


def _spawn_servers(job: Job) -> None:
    """Start ``--num-servers`` dedicated parameter servers, spread over the job's hosts in turn."""
    count = job.config.num_servers
    if not count:
        return
    from shoal.ps.launch import server_processes

    hosts = list(dict.fromkeys(slot.hostname for slot in job.slots))
    for index, (argv, env) in enumerate(server_processes(count, len(job.slots), job.job_env())):
        slot = next(s for s in job.slots if s.hostname == hosts[index % len(hosts)])
        job.workers.append(job.spawn(slot, env, server_index=index, command=argv))


def end_servers(servers: list[Worker], verbose: Callable[[str], None]) -> int:
    """Every worker finished: servers leave on their own once all said goodbye; SIGTERM any that linger. Returns
    shoalrun's exit code."""
    deadline = time.monotonic() + SERVER_EXIT_GRACE_S
    while time.monotonic() < deadline and any(s.returncode is None for s in servers):
        time.sleep(0.05)
    lingering = [s for s in servers if s.returncode is None]
    for server in lingering:
        verbose(f"{server.label} is still waiting after every worker finished; ending it")
        server.signal_tree(signal.SIGTERM)
    for server in lingering:
        try:
            server.process.wait(timeout=TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            server.signal_tree(signal.SIGKILL)
    failed = next((s for s in servers if s not in lingering and s.returncode not in (None, 0)), None)
    if failed is not None and failed.returncode is not None:
        print(f"shoalrun: {failed.label} {describe_status(failed.returncode)}", file=sys.stderr, flush=True)
        return 1
    return 0
