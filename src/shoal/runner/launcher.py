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
from shoal.runner.supervise import TERMINATE_GRACE_S, StaticSupervisor, Supervisor, say_verbose
from shoal.runner.worker_env import worker_env
from shoal.runtime.slurm import NodeListError, allocation


class Job:
    """A whole shoalrun job; ``run()`` returns shoalrun's exit code. Its workers start through its ``spawner``
    (processes here, over ssh or as Slurm steps by default; Ray actors, Spark slots), and its ``supervisor`` decides
    which run and when the job ends (static by default; the elastic driver)."""

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
        supervisor: Supervisor | None = None,
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
            supervisor: which workers run and when the job ends (default: a ``StaticSupervisor``, every rank at once).
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
        self.supervisor = supervisor or StaticSupervisor()

    @property
    def store(self) -> Any:
        """The job's store (the plain-Python view), once it is up; else None."""
        return self._store

    def workers_on(self, hostnames: set[str]) -> int:
        """How many workers this job runs on the hosts ``hostnames`` (one machine's: its spawner says which)."""
        return self.supervisor.workers_on(self, hostnames)

    def verbose(self, message: str) -> None:
        """Say ``message`` on stderr with ``--verbose``."""
        say_verbose(self.config, message)

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

    def job_env(self, slot: SlotInfo | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The Shoal environment of one process (``worker_env``): the rendezvous, the secret and the knobs, then the
        rank's identity (``slot``; none for a server) and extras; without them, what every process of the job gets."""
        settings = self.config.worker_env()
        if self.config.horovod_compat:
            settings["PYTHONPATH"] = os.pathsep.join(p for p in (HOROVOD_SHIM_PATH, os.environ.get("PYTHONPATH")) if p)
        return worker_env(JobAddress(self.rendezvous_addr, self.rendezvous_port, self.secret), settings, slot, extra)

    def spawn(
        self,
        slot: SlotInfo,
        extra: dict[str, str] | None = None,
        server_index: int | None = None,
        command: list[str] | None = None,
    ) -> Worker:
        """Start one process through the spawner: a rank's worker, or a dedicated server (``server_index``)."""
        env = self.job_env(slot if server_index is None else None, {**self.extra_env, **(extra or {})})
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
        """SIGTERM every worker tree (after the supervisor's word), then SIGKILL whatever is left after the grace
        period."""
        self.supervisor.ending(self)
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
            return self.supervisor.launch(self)
        except LaunchError as error:
            return self.fail(str(error))
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

    def wait_for_store(self) -> bool:
        """Wait until the store is up (the store thread is done); False where it could not be hosted."""
        self._store_thread.join()
        return self._store_error is None

    def fail(self, message: str) -> int:
        """Report why the job ends, end every worker, and return exit code 1."""
        print(f"shoalrun: {message}", file=sys.stderr, flush=True)
        self.terminate_all()
        return 1

    def interrupted(self) -> int | None:
        """The exit code when a signal or the store ended the job (every worker is then terminated), else None."""
        if self._stop_signal is not None:
            name = signal.Signals(self._stop_signal).name
            print(f"shoalrun: received {name}; terminating all workers", file=sys.stderr, flush=True)
            self.terminate_all()
            return 128 + self._stop_signal
        if self._store_error is not None:
            return self.fail(f"cannot host the rendezvous store: {self._store_error}")
        return None

    def _remove_shared_memory(self) -> None:
        """Workers unlink their segments once attached; this catches one that died while setting up."""
        from shoal.comm.names import job_token, remove_job_segments

        removed = remove_job_segments(job_token(self.secret))
        if removed:
            self.verbose(f"removed leftover shared-memory segments: {', '.join(removed)}")

    @staticmethod
    def drain_output_of(worker: Worker) -> None:
        """Let a worker's output reach the terminal (up to 1 s per stream) before the job says what became of it."""
        for pump in worker.pumps:
            pump.join(timeout_s=1.0)


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
