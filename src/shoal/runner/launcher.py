"""shoalrun's job: host the rendezvous store, start every worker, copy their output, and end them together.

Local slots are spawned directly, each in its own session so that the whole tree (grandchildren included) can be
signalled at once. Remote slots go through the system OpenSSH client, wrapped by ``shoal.runner.remote``.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.compat import HOROVOD_SHIM_PATH
from shoal.config import LaunchConfig, env_name
from shoal.config.worker import JobAddress
from shoal.runner.hosts import (
    HostSlots,
    HostSpecError,
    SlotInfo,
    assign_slots,
    check_hostname,
    is_local_host,
    parse_hostfile,
    parse_hosts,
)
from shoal.runner.output import OutputPump
from shoal.runner.rendezvous_address import pick_rendezvous_address
from shoal.runner.worker_env import child_env, start_worker, worker_env
from shoal.runtime.slurm import NodeListError, allocation

TERMINATE_GRACE_S = 2.0
"""After SIGTERM, how long workers get before SIGKILL; the whole tree is gone well within 5 s."""
SERVER_EXIT_GRACE_S = 5.0
"""Once every worker finished, how long dedicated parameter servers get to leave on their own."""

_NOT_FORWARDED_PREFIXES = ("BASH_FUNC_", "SSH_", "XDG_")
_NOT_FORWARDED_NAMES = frozenset(
    {"OLDPWD", "CUDA_VISIBLE_DEVICES", env_name("SECRET"), "HOROVOD_SECRET_KEY", "HOSTNAME", "PWD", "SHLVL", "_"}
    | {"HOME", "USER", "LOGNAME", "MAIL", "DISPLAY", "DBUS_SESSION_BUS_ADDRESS", "KRB5CCNAME"}
)


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


@dataclass
class Worker:
    """One running worker process (local, or the ssh client for a remote one)."""

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


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Job:
    """A whole shoalrun job; ``run()`` returns shoalrun's exit code."""

    def __init__(
        self,
        config: LaunchConfig,
        slots: list[SlotInfo],
        local_prefixes: dict[str, list[str]] | None = None,
        rendezvous_addr: str | None = None,
        extra_env: dict[str, str] | None = None,
        bind_all: bool = False,
        on_store: Callable[[Any], None] | None = None,
        on_finish: Callable[[Any], None] | None = None,
    ) -> None:
        """A job over ``slots``.

        Args:
            config: the job, as shoalrun's flags, ``shoal.run`` or a driver describe it.
            slots: where every rank runs.
            local_prefixes: hosts to start on this machine anyway, each under an argv prefix (the network-namespace
                emulator uses ``ip netns exec <ns>``); other hosts are local or reached over ssh.
            rendezvous_addr: the address workers use to reach the store, overriding the automatic choice.
            extra_env: more environment for every worker.
            bind_all: listen on every interface even when all ``slots`` are local (hosts may join later).
            on_store: called with the job's store as soon as it exists (before any worker can read it).
            on_finish: called with the job's store once every worker has ended, before the store is dropped.
        """
        self._on_store, self._on_finish = on_store, on_finish
        self._said_threads = False
        self.shown_ranks: set[int] | None = config.ranks_filter
        self.config = config
        self.slots = slots
        self.local_prefixes = local_prefixes or {}
        self.extra_env = extra_env or {}
        self.secret = secrets.token_hex(16)
        self.all_local = all(self._is_local(s.hostname) for s in slots) and not self.local_prefixes and not bind_all
        remote_hosts = [s.hostname for s in slots if not self._is_local(s.hostname)]
        self.rendezvous_addr = rendezvous_addr or pick_rendezvous_address(remote_hosts, config.network_interface)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # The store listens only on the address the workers are told (loopback for an all-local job), not on every
        # interface of the machine.
        self._listener.bind(("127.0.0.1" if self.all_local else self.rendezvous_addr, 0))
        self._listener.listen(128)
        self.rendezvous_port = self._listener.getsockname()[1]
        self.workers: list[Worker] = []
        self._sink_lock = threading.Lock()
        self._store: Any = None
        self._store_error: BaseException | None = None
        self._store_thread = threading.Thread(target=self._host_store, name="shoalrun-store", daemon=True)
        self._stop_signal: int | None = None

    @functools.cached_property
    def _slurm_nodes(self) -> frozenset[str]:
        """The Slurm allocation's nodes, read once (``scontrol`` may expand the node list) at the first remote spawn."""
        return allocation_nodes(os.environ)

    def _is_local(self, hostname: str) -> bool:
        return hostname in self.local_prefixes or is_local_host(hostname)

    def _same_machine(self, hostname: str) -> set[str]:
        """The host names whose workers share ``hostname``'s cores: itself, or every host emulated on this machine
        (``local_prefixes``: shoal.bench.netns's namespaces)."""
        return set(self.local_prefixes) if hostname in self.local_prefixes else {hostname}

    def _workers_on(self, hostname: str) -> int:
        """How many workers this job runs on ``hostname``'s machine (at most, for an elastic job)."""
        same = self._same_machine(hostname)
        return sum(1 for s in self.slots if s.hostname in same)

    def _threads_per_worker(self, hostname: str) -> int:
        """Cores ÷ local workers: N ranks each using every core would fight over them (torchrun does the same)."""
        local_workers = max(1, self._workers_on(hostname))
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

    def _verbose(self, message: str) -> None:
        if self.config.verbose:
            print(f"shoalrun: {message}", file=sys.stderr, flush=True)

    def _host_store(self) -> None:
        # shoalrun never imports torch (seconds of CPU the workers need at start-up): its view of the store is the
        # plain-Python one.
        try:
            from shoal.comm.auth_store import AuthStoreServer

            # The server takes ownership of the listening socket and closes it when it is closed.
            server = AuthStoreServer(self.secret, self.rendezvous_addr, self.rendezvous_port, listen_fd=self._listener.detach())
            self._store = server.local_view(self.config.start_timeout)
            if self._on_store is not None:
                self._on_store(self._store)
        except BaseException as error:  # reported by the supervisor loop, which ends the job
            self._store_error = error

    def _job_env(self, slot: SlotInfo | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The Shoal environment of one process (``worker_env``): the rendezvous, the secret and the knobs, then the
        rank's identity (``slot``; none for a server) and extras; without them, what every process of the job gets."""
        settings = self.config.worker_env()
        if self.config.horovod_compat:
            settings["PYTHONPATH"] = os.pathsep.join(p for p in (HOROVOD_SHIM_PATH, os.environ.get("PYTHONPATH")) if p)
        return worker_env(JobAddress(self.rendezvous_addr, self.rendezvous_port, self.secret), settings, slot, extra)

    def _worker_env(self, slot: SlotInfo, extra: dict[str, str] | None, server_index: int | None) -> dict[str, str]:
        """The Shoal environment of one process: the job's, its rank's (not for a server), then extras."""
        return self._job_env(slot if server_index is None else None, {**self.extra_env, **(extra or {})})

    def _spawn(
        self,
        slot: SlotInfo,
        worker_env: dict[str, str] | None = None,
        server_index: int | None = None,
        command: list[str] | None = None,
    ) -> Worker:
        extra = self._worker_env(slot, worker_env, server_index)
        command = command or self.config.command
        if self._is_local(slot.hostname):
            env = child_env(extra, self._threads_per_worker(slot.hostname))  # (its launcher pid: shoalrun's)
            argv = [*self.local_prefixes.get(slot.hostname, []), *command]
            stdin: int = subprocess.DEVNULL
        else:
            # The environment (the secret included) travels over ssh's standard input, never on a command line that
            # every local user can read in /proc/<pid>/cmdline; shoal.runner.remote reads it before starting.
            remote_env = {**forwarded_env(os.environ, self.config.forward_env), **extra}
            remote_cmd = (
                f"cd {shlex.quote(os.getcwd())} && exec {shlex.quote(sys.executable)} -m shoal.runner.remote "
                f"--env-from-stdin -- {shlex.join(command)}"
            )
            argv = remote_argv(self.config, slot.hostname, remote_cmd, self._slurm_nodes)
            env = dict(os.environ)
            stdin = subprocess.PIPE
        shown = argv if self._is_local(slot.hostname) else [*argv[:-1], "<remote command>"]
        label = process_label(slot, server_index)
        self._verbose(f"{label} on {slot.hostname}: {shlex.join(shown)}")
        try:
            process = start_worker(argv, env, stream=True, stdin=stdin, bound=False)
        except OSError as error:
            raise LaunchError(f"cannot start {label} on {slot.hostname}: {error}") from error
        if stdin == subprocess.PIPE:
            assert process.stdin is not None
            process.stdin.write((json.dumps(remote_env) + "\n").encode())
            process.stdin.flush()
        worker = Worker(slot=slot, process=process, server_index=server_index)
        # Output prefix [N] and log directory rank.N for a worker (N zero-padded to the widest rank, as horovodrun
        # does); [server.I] and server.I for a server.
        width = len(str(max(len(self.slots) - 1, 0)))
        directory = f"rank.{slot.rank:0{width}d}" if server_index is None else f"server.{server_index}"
        tag: int | str = slot.rank if server_index is None else directory
        for stream_name, stream, sink in (
            ("stdout", process.stdout, sys.stdout.buffer),
            ("stderr", process.stderr, sys.stderr.buffer),
        ):
            assert stream is not None
            log_path = None
            if self.config.output_filename:
                rank_dir = Path(self.config.output_filename) / directory
                rank_dir.mkdir(parents=True, exist_ok=True)
                log_path = rank_dir / stream_name
            visible = server_index is not None or self.shown_ranks is None or slot.rank in self.shown_ranks
            pump = OutputPump(stream, sink, self._sink_lock, tag, stream_name, log_path, self.config.prefix_timestamp, visible)
            pump.start()
            worker.pumps.append(pump)
        return worker

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop_signal = signum

    def terminate_all(self) -> None:
        """SIGTERM every worker tree, then SIGKILL whatever is left after the grace period."""
        for worker in self.workers:
            worker.signal_tree(signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < deadline and any(w.returncode is None for w in self.workers):
            time.sleep(0.05)
        for worker in self.workers:
            worker.signal_tree(signal.SIGKILL)  # also reaches grandchildren left in a finished leader's group
        for worker in self.workers:
            try:
                worker.process.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                pass

    def _drain_output(self) -> None:
        for worker in self.workers:
            for pump in worker.pumps:
                pump.join(timeout_s=2.0)

    def run(self) -> int:
        """Start everything, supervise, and return shoalrun's exit code. In the main thread, SIGINT, SIGTERM and
        SIGHUP end the job (every worker); from another thread (a library's caller) those stay the caller's."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self._verbose(f"rendezvous at {self.rendezvous_addr}:{self.rendezvous_port}")
            self._store_thread.start()
            return self._launch()
        except LaunchError as error:
            return self._fail(str(error))
        finally:
            self._drain_output()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # A job can end before the store thread has finished importing torch and starting the store; letting
            # the interpreter exit under it aborts the process from C++. Wait for it, then drop the store.
            if self._store_thread.ident is not None:
                self._store_thread.join(timeout=60)
            try:
                if self._on_finish is not None and self._store is not None:
                    self._on_finish(self._store)
            finally:
                if self._store is not None:
                    self._store.close()  # stops the server: every worker has ended
                self._store = None
            if self._listener.fileno() != -1:  # the store never took it over
                self._listener.close()
            self._remove_shared_memory()

    def _launch(self) -> int:
        """Start the workers (and servers) and supervise them to the end; returns shoalrun's exit code."""
        for slot in self.slots:
            self.workers.append(self._spawn(slot))
        self._spawn_servers()
        return self._supervise()

    def _fail(self, message: str) -> int:
        """Report why the job ends, end every worker, and return exit code 1."""
        print(f"shoalrun: {message}", file=sys.stderr, flush=True)
        self.terminate_all()
        return 1

    def _interrupted(self) -> int | None:
        """The exit code when a signal or the store ended the job (every worker is then terminated), else None."""
        if self._stop_signal is not None:
            name = signal.Signals(self._stop_signal).name
            print(f"shoalrun: received {name}; terminating all workers", file=sys.stderr, flush=True)
            self.terminate_all()
            return 128 + self._stop_signal
        if self._store_error is not None:
            return self._fail(f"cannot host the rendezvous store: {self._store_error}")
        return None

    def _spawn_servers(self) -> None:
        """Start ``--num-servers`` dedicated parameter servers, spread over the job's hosts in turn."""
        count = self.config.num_servers
        if not count:
            return
        from shoal.ps.launch import server_processes

        hosts = list(dict.fromkeys(slot.hostname for slot in self.slots))
        for index, (argv, env) in enumerate(server_processes(count, len(self.slots), self._job_env())):
            slot = next(s for s in self.slots if s.hostname == hosts[index % len(hosts)])
            self.workers.append(self._spawn(slot, env, server_index=index, command=argv))

    def _remove_shared_memory(self) -> None:
        """Workers unlink their segments once attached; this catches one that died while setting up."""
        from shoal.comm.names import job_token, remove_job_segments

        removed = remove_job_segments(job_token(self.secret))
        if removed:
            self._verbose(f"removed leftover shared-memory segments: {', '.join(removed)}")

    def _supervise(self) -> int:
        while True:
            interrupted = self._interrupted()
            if interrupted is not None:
                return interrupted
            failed = next((w for w in self.workers if w.returncode not in (None, 0)), None)
            if failed is not None:
                code = failed.returncode
                assert code is not None
                others = [w for w in self.workers if w is not failed and w.returncode is None]
                self._drain_output_of(failed)
                print(
                    f"shoalrun: {failed.label} on host {failed.slot.hostname} {_describe_status(code)}"
                    + ("; terminating the other workers" if others else ""),
                    file=sys.stderr,
                    flush=True,
                )
                self.terminate_all()
                return 128 - code if code < 0 else code
            if all(w.returncode == 0 for w in self.workers if w.server_index is None):
                return self._end_servers()
            time.sleep(0.05)

    def _end_servers(self) -> int:
        """Every worker finished: servers leave on their own once all said goodbye; SIGTERM any that linger."""
        servers = [w for w in self.workers if w.server_index is not None]
        deadline = time.monotonic() + SERVER_EXIT_GRACE_S
        while time.monotonic() < deadline and any(s.returncode is None for s in servers):
            time.sleep(0.05)
        lingering = [s for s in servers if s.returncode is None]
        for server in lingering:
            self._verbose(f"{server.label} is still waiting after every worker finished; ending it")
            server.signal_tree(signal.SIGTERM)
        for server in lingering:
            try:
                server.process.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                server.signal_tree(signal.SIGKILL)
        failed = next((s for s in servers if s not in lingering and s.returncode not in (None, 0)), None)
        if failed is not None and failed.returncode is not None:
            print(f"shoalrun: {failed.label} {_describe_status(failed.returncode)}", file=sys.stderr, flush=True)
            return 1
        return 0

    @staticmethod
    def _drain_output_of(worker: Worker) -> None:
        for pump in worker.pumps:
            pump.join(timeout_s=1.0)


class LaunchError(RuntimeError):
    """shoalrun could not start a worker."""


def build_slots(config: LaunchConfig) -> list[SlotInfo]:
    """Hosts from -H or --hostfile (default localhost), filled in order with -np ranks."""
    hosts = requested_hosts(config)
    num_proc = config.num_proc if config.num_proc is not None else sum(h.slots for h in hosts)
    return assign_slots(hosts, num_proc)


def requested_hosts(config: LaunchConfig) -> list[HostSlots]:
    """The hosts given by -H or --hostfile; else, inside a Slurm allocation (``salloc``, ``sbatch``), its nodes with
    their tasks as slots; else ``localhost`` with -np slots.

    Raises:
        HostSpecError: a bad host list, or -np larger than the Slurm allocation.
    """
    if config.hosts:
        return parse_hosts(config.hosts, config.slots_per_host or 1)
    if config.hostfile:
        return parse_hostfile(config.hostfile, config.slots_per_host or 1)
    try:
        slurm = allocation(os.environ)
    except NodeListError as error:
        raise HostSpecError(f"cannot read the Slurm allocation: {error}") from None
    if slurm is not None:
        wanted = max(config.num_proc or 0, config.min_np or 0)
        if wanted > slurm.tasks:
            raise HostSpecError(
                f"-np {wanted} is more than the {slurm.tasks} tasks of Slurm job {slurm.job_id}'s allocation "
                f"({slurm.describe()}); ask salloc/sbatch for more tasks (-n, or -N with --ntasks-per-node), lower "
                "-np, or name the hosts with -H"
            )
        return [HostSlots(check_hostname(host, f"Slurm job {slurm.job_id}'s node list"), count) for host, count in slurm.nodes]
    assert config.num_proc is not None, "checked by LaunchConfig.check()"
    return [HostSlots("localhost", config.num_proc)]


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
