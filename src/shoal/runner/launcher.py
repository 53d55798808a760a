"""shoalrun's job: host the rendezvous store, start every worker through a spawner, and end them together.

``ProcessSpawner`` (``runner/spawners.py``) starts local slots directly, each in its own session so that the whole
tree (grandchildren included) can be signalled at once, and remote slots through the system OpenSSH client (or a
Slurm step), wrapped by ``shoal.runner.remote``.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from shoal.compat import HOROVOD_SHIM_PATH
from shoal.config import LaunchConfig
from shoal.config.worker import JobAddress
from shoal.runner.hosts import (
    HostSlots,
    HostSpecError,
    SlotInfo,
    assign_slots,
    check_hostname,
    parse_hostfile,
    parse_hosts,
)
from shoal.runner.rendezvous_address import pick_rendezvous_address
from shoal.runner.spawners import LaunchError, ProcessSpawner, Spawner, Worker, WorkerSpec, process_label
from shoal.runner.static_watch import StaticWatch
from shoal.runner.worker_env import worker_env
from shoal.runtime.slurm import NodeListError, allocation

TERMINATE_GRACE_S = 2.0
"""After SIGTERM, how long workers get before SIGKILL; the whole tree is gone well within 5 s."""
SERVER_EXIT_GRACE_S = 5.0
"""Once every worker finished, how long dedicated parameter servers get to leave on their own."""


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Job:
    """A whole shoalrun job; ``run()`` returns shoalrun's exit code. Its workers start through its ``spawner``
    (processes here, over ssh or as Slurm steps by default; Ray actors, Spark slots)."""

    def __init__(
        self,
        config: LaunchConfig,
        slots: list[SlotInfo],
        spawner: Spawner | None = None,
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
            spawner: how workers start (default: a ``ProcessSpawner``, local or over ssh/srun).
            rendezvous_addr: the address workers use to reach the store, overriding the automatic choice.
            extra_env: more environment for every worker.
            bind_all: listen on every interface even when all ``slots`` are local (hosts may join later).
            on_store: called with the job's store as soon as it exists (before any worker can read it).
            on_finish: called with the job's store once every worker has ended, before the store is dropped.
        """
        self._on_store, self._on_finish = on_store, on_finish
        self.config = config
        self.slots = slots
        self.spawner = spawner or ProcessSpawner()
        self.spawner.attach(self)
        self.extra_env = extra_env or {}
        self.secret = secrets.token_hex(16)
        remote_hosts = [s.hostname for s in slots if self.spawner.remote(s.hostname)]
        self.all_local = not remote_hosts and not bind_all
        self.rendezvous_addr = rendezvous_addr or pick_rendezvous_address(remote_hosts, config.network_interface)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # The store listens only on the address the workers are told (loopback for an all-local job), not on every
        # interface of the machine.
        self._listener.bind(("127.0.0.1" if self.all_local else self.rendezvous_addr, 0))
        self._listener.listen(128)
        self.rendezvous_port = self._listener.getsockname()[1]
        self.workers: list[Worker] = []
        self._store: Any = None
        self._store_error: BaseException | None = None
        self._store_thread = threading.Thread(target=self._host_store, name="shoalrun-store", daemon=True)
        self._stop_signal: int | None = None
        self._watch = StaticWatch(self.secret)
        """The workers' heartbeats: a stopped or cut-off worker is named in seconds and fails the job at the
        ceiling (``static_watch``)."""

    @property
    def store(self) -> Any:
        """The job's store (the plain-Python view), once it is up; else None."""
        return self._store

    def workers_on(self, hostnames: set[str]) -> int:
        """How many workers this job runs on the hosts ``hostnames`` (one machine's: its spawner says which)."""
        return sum(1 for s in self.slots if s.hostname in hostnames)

    def verbose(self, message: str) -> None:
        """Say ``message`` on stderr with ``--verbose``."""
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

    def _spawn(
        self,
        slot: SlotInfo,
        extra: dict[str, str] | None = None,
        server_index: int | None = None,
        command: list[str] | None = None,
    ) -> Worker:
        """Start one process through the spawner: a rank's worker, or a dedicated server (``server_index``)."""
        env = self._job_env(slot if server_index is None else None, {**self.extra_env, **(extra or {})})
        # Output prefix [N] and log directory rank.N for a worker (N zero-padded to the widest rank, as horovodrun
        # does); [server.I] and server.I for a server.
        width = len(str(max(len(self.slots) - 1, 0)))
        log_name = f"rank.{slot.rank:0{width}d}" if server_index is None else f"server.{server_index}"
        shown = self.config.ranks_filter
        spec = WorkerSpec(
            slot=slot,
            env=env,
            command=command or self.config.command,
            label=process_label(slot, server_index),
            tag=slot.rank if server_index is None else log_name,
            log_name=log_name,
            visible=server_index is not None or shown is None or slot.rank in shown,
            server_index=server_index,
        )
        return self.spawner.spawn(spec)

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
            self.verbose(f"rendezvous at {self.rendezvous_addr}:{self.rendezvous_port}")
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
                try:
                    if self._store is not None:
                        self._store.close()  # stops the server: every worker has ended
                    self._store = None
                    if self._listener.fileno() != -1:  # the store never took it over
                        self._listener.close()
                    self._remove_shared_memory()
                finally:
                    self.spawner.close()  # (Ray's actors end even when collecting a result raised)

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
            self.verbose(f"removed leftover shared-memory segments: {', '.join(removed)}")

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
                return end_servers([w for w in self.workers if w.server_index is not None], self.verbose)
            silent = self._watch.check(self._store, self.workers, time.monotonic())
            if silent is not None:
                return self._fail(f"rank {silent.slot.rank} on host {silent.slot.hostname} stayed silent; ending the job")
            time.sleep(0.05)

    @staticmethod
    def _drain_output_of(worker: Worker) -> None:
        for pump in worker.pumps:
            pump.join(timeout_s=1.0)


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
        print(f"shoalrun: {failed.label} {_describe_status(failed.returncode)}", file=sys.stderr, flush=True)
        return 1
    return 0


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
