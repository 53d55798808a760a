"""How a job starts one worker: the job builds a ``WorkerSpec`` and hands it to its spawner.

``ProcessSpawner`` starts a process on this machine (under an argv prefix for an emulated host), over ssh, or as a
one-task Slurm step on another node of the job's allocation; static and elastic jobs take it. Ray's actor spawner
(``shoal.ray.elastic``) and Spark's slot spawner (``shoal.spark.elastic``) serve the elastic driver: they start
``shoal.runner.task`` workers (a function job) once the job's store is up.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shoal.config import LaunchConfig, env_name, read_setting
from shoal.runner.forkserver import ForkServer, ForkServerError, Namespace
from shoal.runner.hosts import SlotInfo, is_local_host
from shoal.runner.output import OutputPump
from shoal.runner.preload import preload_modules, python_command
from shoal.runner.worker_env import child_env, start_worker
from shoal.runtime.slurm import NodeListError, allocation

_NOT_FORWARDED_PREFIXES = ("BASH_FUNC_", "SSH_", "XDG_")
_NOT_FORWARDED_NAMES = frozenset(
    {"OLDPWD", "CUDA_VISIBLE_DEVICES", env_name("SECRET"), "HOROVOD_SECRET_KEY", "HOSTNAME", "PWD", "SHLVL", "_"}
    | {"HOME", "USER", "LOGNAME", "MAIL", "DISPLAY", "DBUS_SESSION_BUS_ADDRESS", "KRB5CCNAME"}
)


class LaunchError(RuntimeError):
    """shoalrun could not start a worker."""


@dataclass(frozen=True)
class WorkerSpec:
    """One process a job wants started: the same for every spawner."""

    slot: SlotInfo
    """Where it runs (the host) and, for a worker of a static job, its rank."""
    env: dict[str, str]
    """Its Shoal environment (``worker_env``): the job's address and settings, the rank's identity, extras."""
    command: list[str]
    label: str
    """How messages name it: ``rank N``, ``parameter server I``."""
    tag: int | str
    """Its output lines' prefix (``[N]``)."""
    log_name: str
    """Its directory under ``--output-filename`` (``rank.N``, ``server.I``)."""
    visible: bool = True
    """Whether its output is shown (``--ranks``)."""
    server_index: int | None = None
    """Set for a dedicated parameter server (``--num-servers``), which is not a Horovod rank."""


class JobContext(Protocol):
    """What a spawner may ask of the job it starts workers for."""

    config: LaunchConfig
    secret: str

    @property
    def store(self) -> Any:
        """The job's store (the plain-Python view), once it is up; else None."""

    def verbose(self, message: str) -> None:
        """Say ``message`` when the job is verbose."""

    def workers_on(self, hostnames: set[str]) -> int:
        """How many workers the job runs (at most, for an elastic job) on the hosts ``hostnames``."""


@dataclass
class Worker:
    """One running worker process (local, the ssh or srun client for a remote one, or a stand-in that polls one
    living elsewhere)."""

    slot: SlotInfo
    process: subprocess.Popen[bytes]
    pumps: list[OutputPump] = field(default_factory=list)
    server_index: int | None = None
    """Set for a dedicated parameter server (``--num-servers``), which is not a Horovod rank."""

    @property
    def label(self) -> str:
        """How shoalrun's messages name it."""
        return process_label(self.slot, self.server_index)

    @property
    def returncode(self) -> int | None:
        """The exit status so far (negative: killed by that signal)."""
        return self.process.poll()

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to the worker's whole process group; closing stdin also ends a remote tree."""
        if self.process.stdin is not None and sig == signal.SIGTERM:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class PolledProcess:
    """``Popen.wait`` for a worker whose process lives elsewhere (a Ray actor's, a Spark slot's): subclasses give
    ``poll()`` and ``returncode``."""

    returncode: int | None

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(type(self).__name__, timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def process_label(slot: SlotInfo, server_index: int | None) -> str:
    """``rank N`` for a worker, ``parameter server I`` for a dedicated server."""
    return f"rank {slot.rank}" if server_index is None else f"parameter server {server_index}"


class Spawner:
    """How a job starts its workers. The job calls ``attach`` once, ``spawn`` per process and ``close`` when it has
    ended."""

    job: JobContext

    def attach(self, job: JobContext) -> None:
        """Take the job this spawner starts workers for (before its first ``spawn``)."""
        self.job = job

    def remote(self, hostname: str) -> bool:
        """Whether a worker on ``hostname`` reaches the job's store over the network (else loopback would do)."""
        return not is_local_host(hostname)

    def spawn(self, spec: WorkerSpec) -> Worker:
        """Start ``spec``'s process and return it as the job supervises it.

        Raises:
            LaunchError: it could not be started.
        """
        raise NotImplementedError

    def close(self) -> None:
        """The job has ended: release what the spawner still holds (its workers are gone already)."""


class ProcessSpawner(Spawner):
    """A worker as a process: here, under an argv prefix for an emulated host, over ssh, or a Slurm step."""

    def __init__(
        self, local_prefixes: dict[str, list[str]] | None = None, namespaces: dict[str, Namespace] | None = None
    ) -> None:
        """``local_prefixes``: hosts to start on this machine anyway, each under an argv prefix; other hosts are local
        or reached over ssh (or srun). ``namespaces``: hosts emulated in network namespaces (``shoal.bench.netns``),
        each under its ``Namespace.prefix``; a preload server (``--preload-server``) forks their fork servers into
        them."""
        self.namespaces = namespaces or {}
        self.local_prefixes = {**(local_prefixes or {}), **{host: ns.prefix() for host, ns in self.namespaces.items()}}
        self._sink_lock = threading.Lock()
        self._said_threads = False
        self._servers: dict[tuple[str, ...], ForkServer | None] = {}
        """Each host's fork server (``--preload``), by its argv prefix; None where its workers start afresh."""
        self._servers_lock = threading.Lock()

    def is_local(self, hostname: str) -> bool:
        """Whether ``hostname``'s workers start on this machine."""
        return hostname in self.local_prefixes or is_local_host(hostname)

    def remote(self, hostname: str) -> bool:
        # An emulated host's workers live in another network namespace: they reach the store through its gateway.
        return hostname in self.local_prefixes or not is_local_host(hostname)

    @functools.cached_property
    def _slurm_nodes(self) -> frozenset[str]:
        """The Slurm allocation's nodes, read once (``scontrol`` may expand the node list) at the first remote spawn."""
        return allocation_nodes(os.environ)

    def _threads_per_worker(self, hostname: str) -> int:
        """Cores ÷ local workers: N ranks each using every core would fight over them (torchrun does the same)."""
        # Every host emulated on this machine shares its cores.
        same = set(self.local_prefixes) if hostname in self.local_prefixes else {hostname}
        local_workers = max(1, self.job.workers_on(same))
        threads = max(1, (os.cpu_count() or 1) // local_workers)
        if not self._said_threads:
            self._said_threads = True
            print(
                f"shoalrun: OMP_NUM_THREADS={threads} for each local worker ({os.cpu_count()} cores / {local_workers} "
                "workers); set OMP_NUM_THREADS to choose another",
                file=sys.stderr,
                flush=True,
            )
        return threads

    def spawn(self, spec: WorkerSpec) -> Worker:
        host, config = spec.slot.hostname, self.job.config
        local = self.is_local(host)
        if local:
            env = child_env(spec.env, self._threads_per_worker(host))  # (its launcher pid: shoalrun's)
            argv = [*self.local_prefixes.get(host, []), *spec.command]
            stdin: int = subprocess.DEVNULL
        else:
            # The environment (the secret included) travels over the client's standard input, never on a command line
            # that every local user can read in /proc/<pid>/cmdline; shoal.runner.remote reads it before starting.
            remote_env = {**forwarded_env(os.environ, config.forward_env), **spec.env}
            remote_cmd = (
                f"cd {shlex.quote(os.getcwd())} && exec {shlex.quote(sys.executable)} -m shoal.runner.remote "
                f"--env-from-stdin -- {shlex.join(spec.command)}"
            )
            argv = remote_argv(config, host, remote_cmd, self._slurm_nodes)
            env = dict(os.environ)
            stdin = subprocess.PIPE
        shown = argv if local else [*argv[:-1], "<remote command>"]
        self.job.verbose(f"{spec.label} on {host}: {shlex.join(shown)}")
        process: Any = self._forked(host, spec, env) if local else None
        try:
            process = process or start_worker(argv, env, stream=True, stdin=stdin, bound=False)
        except OSError as error:
            raise LaunchError(f"cannot start {spec.label} on {host}: {error}") from error
        if stdin == subprocess.PIPE:
            assert process.stdin is not None
            process.stdin.write((json.dumps(remote_env) + "\n").encode())
            process.stdin.flush()
        worker = Worker(slot=spec.slot, process=process, server_index=spec.server_index)
        for stream_name, stream, sink in (
            ("stdout", process.stdout, sys.stdout.buffer),
            ("stderr", process.stderr, sys.stderr.buffer),
        ):
            assert stream is not None
            log_path = None
            if config.output_filename:
                log_dir = Path(config.output_filename) / spec.log_name
                log_dir.mkdir(parents=True, exist_ok=True)
                log_path = log_dir / stream_name
            pump = OutputPump(
                stream, sink, self._sink_lock, spec.tag, stream_name, log_path, config.prefix_timestamp, spec.visible
            )
            pump.start()
            worker.pumps.append(pump)
        return worker

    def _forked(self, host: str, spec: WorkerSpec, env: dict[str, str]) -> Any:
        """``spec``'s worker forked from its host's fork server (started at the host's first worker), or None when it
        is to start afresh (``shoal.runner.forkserver`` says when)."""
        command = python_command(spec.command, env)
        if command is None or self.job.config.preload == "none":
            return None
        prefix = tuple(self.local_prefixes.get(host, []))
        with self._servers_lock:
            if prefix not in self._servers:
                self._servers[prefix] = None
                modules = preload_modules(self.job.config.preload, command, env)
                if modules:
                    self._servers[prefix] = self._server(host, modules, env, prefix)
            server = self._servers[prefix]
        if server is None or not server.accepts(env):
            return None
        try:
            return server.fork(command, env)
        except ForkServerError as error:
            self.job.verbose(f"{spec.label} starts afresh: {error}")
            return None

    def _server(self, host: str, modules: tuple[str, ...], env: dict[str, str], prefix: tuple[str, ...]) -> Any:
        """``host``'s fork server: forked from the preload server where one is named and serves this job, else
        started; None when neither can be had (its workers start afresh)."""
        config = self.job.config
        preload_server = config.preload_server or read_setting(LaunchConfig, "preload_server")
        namespace = self.namespaces.get(host)
        if preload_server and (not prefix or namespace is not None):
            try:
                server = ForkServer(
                    modules, env, timeout=config.start_timeout, preload_server=preload_server, namespace=namespace
                )
                self.job.verbose(f"workers on {host} fork from a server forked by {preload_server}")
                return server
            except ForkServerError as error:
                self.job.verbose(f"workers on {host} get a fork server of their own: {error}")
        try:
            server = ForkServer(modules, env, prefix, timeout=config.start_timeout)
            self.job.verbose(f"workers on {host} fork from a server that imported {', '.join(modules)}")
            return server
        except ForkServerError as error:
            self.job.verbose(f"workers on {host} start afresh: {error}")
            return None

    def close(self) -> None:
        for server in self._servers.values():
            if server is not None:
                server.close()
        self._servers.clear()


def forwarded_env(environ: Mapping[str, str], requested: list[str]) -> dict[str, str]:
    """What remote workers get from shoalrun's environment: all of it, as horovodrun forwards it (``PATH``,
    ``VIRTUAL_ENV``, ``LD_LIBRARY_PATH`` and the user's own settings), except exported shell functions
    (``BASH_FUNC_*``), ``OLDPWD``, ``CUDA_VISIBLE_DEVICES`` (each host has its own devices), any secret (the job
    sends its own), and what describes this shell's session and user on this host rather than the job
    (``HOSTNAME``, ``PWD``, ``SHLVL``, ``_``, ``SSH_*``, ``XDG_*``, ``HOME``, ``USER``, ``LOGNAME``, ``MAIL``,
    ``DISPLAY``, ``DBUS_SESSION_BUS_ADDRESS``, ``KRB5CCNAME``); then each ``-x NAME`` (its value here) or
    ``-x NAME=VALUE``."""
    env = {k: v for k, v in environ.items() if not k.startswith(_NOT_FORWARDED_PREFIXES) and k not in _NOT_FORWARDED_NAMES}
    env.setdefault("PYTHONUNBUFFERED", "1")
    for item in requested:
        name, equals, value = item.partition("=")  # names were checked when the flags were parsed
        if equals:
            env[name] = value
        elif name in environ:
            env[name] = environ[name]
    return env


def ssh_argv(config: LaunchConfig, hostname: str, remote_cmd: str) -> list[str]:
    """The ssh command that runs ``remote_cmd`` on ``hostname`` with shoalrun's ssh flags."""
    # Keep-alives make a vanished host end its ssh client (so shoalrun sees the worker fail) within ~15 s.
    argv = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"StrictHostKeyChecking={config.ssh_strict_host_key_checking}",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
    ]
    if config.ssh_port:
        argv += ["-p", str(config.ssh_port)]
    if config.ssh_identity_file:
        argv += ["-i", config.ssh_identity_file]
    return [*argv, "--", hostname, remote_cmd]  # "--": a host name can never be read as an ssh option


def allocation_nodes(env: Mapping[str, str]) -> frozenset[str]:
    """The nodes of the Slurm allocation ``env`` describes; none outside one, or when its node list cannot be read
    (its workers then go over ssh like any other host's)."""
    try:
        slurm = allocation(env)
    except NodeListError:
        return frozenset()
    return frozenset(host for host, _ in slurm.nodes) if slurm is not None else frozenset()


def remote_argv(config: LaunchConfig, hostname: str, remote_cmd: str, slurm_nodes: frozenset[str]) -> list[str]:
    """How a worker on another host starts: a one-task Slurm step there (``srun``) when the host is one of
    ``slurm_nodes``, the nodes of the allocation shoalrun runs in (they need no ssh, and Slurm then signals, accounts
    and cleans up the worker), else ssh."""
    srun = shutil.which("srun")
    if srun is None or hostname not in slurm_nodes:
        return ssh_argv(config, hostname, remote_cmd)
    # --overlap: the step shares the allocation's CPUs with the batch script (shoalrun) and the other workers' steps;
    # --kill-on-bad-exit and --quiet: the worker's exit is the step's, and srun adds no lines of its own.
    return [
        srun,
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={hostname}",
        "--kill-on-bad-exit=1",
        "--quiet",
        f"--chdir={os.getcwd()}",
        "/bin/sh",
        "-c",
        remote_cmd,
    ]
