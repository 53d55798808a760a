"""Join this job's parameter-server group, once per process and ``hvd.init()``, and leave it at ``shutdown()``.

Group ranks 0..P-1 are the workers' clients and P..P+S-1 the servers. With dedicated servers (the ``NUM_SERVERS``
knob = S > 0, docs/knobs.md) the group lives in the job's rendezvous store, which the server processes reach too.
Co-located (S = P), every worker also hosts server i as rank P+i, in a second gloo group object of its own, served by
a background thread; the group is then scoped to this ``hvd.init()``'s store, so a later ``init()`` starts clean.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from shoal.comm.p2p import PeerGroup, arrive_and_wait, connect_job_store
from shoal.comm.store import prefix_store
from shoal.config import JobAddress, engine_setting, env_name, worker_setting
from shoal.log import get_logger
from shoal.ps.client import PSClient, exiting_on_error
from shoal.ps.config import PSConfig
from shoal.ps.consistency import PullRecorder
from shoal.ps.server import ShardServer, WorkerLostError
from shoal.runtime import context


class _Connection:
    """What this process holds of the group: its client, and in co-located mode its server and that thread."""

    def __init__(
        self, client: PSClient, store: Any, server: ShardServer | None, thread: threading.Thread | None, generation: int
    ) -> None:
        self.client = client
        self.store = store
        self.server = server
        self.thread = thread
        self.generation = generation


_PART = "ps.connection"
"""The process context's part holding this init()'s connection to the servers."""
_lock = threading.Lock()
_hook_registered = False
_served_generations: set[int] = set()
"""The init() generations that used dedicated servers in this process (they serve only one)."""


def connect(config: PSConfig) -> tuple[PSClient, Any]:
    """This process's client (joining the group on first use; every worker must get here) and the group's store."""
    global _hook_registered
    with _lock:
        current = context.current()
        connection: _Connection | None = current.part(_PART)
        if connection is None:
            if not _hook_registered:
                context.register_shutdown_hook(close)
                _hook_registered = True
            connection = _join(config, current)
            current.set_part(_PART, connection)
        return connection.client, connection.store


def _join(config: PSConfig, current: Any) -> _Connection:
    worker, workers = current.topology.rank, current.topology.size
    timeout_s = worker_setting("start_timeout")
    if config.dedicated:
        if _served_generations:
            raise ValueError(
                "the dedicated parameter servers served this job's first hvd.init() and left at its shutdown(); "
                f"a later init() cannot use them (use co-located servers, {env_name('NUM_SERVERS')} unset, to re-init)"
            )
        _served_generations.add(current.generation)
        servers = config.num_servers
        address = JobAddress.from_env(os.environ)
        if address is None:
            raise ValueError(
                f"dedicated parameter servers ({env_name('NUM_SERVERS')} = {servers}) need the job's rendezvous store, "
                f"but {env_name('RENDEZVOUS_ADDR')} and {env_name('RENDEZVOUS_PORT')} are not both set"
            )
        store = connect_job_store(address.addr, address.port, address.secret, timeout_s)
        group = PeerGroup(store, worker, workers + servers)
        arrive_and_wait(store, "arrived", workers + servers, timeout_s, f"worker {worker}")
        client = PSClient(group, worker, workers, servers, dedicated=True)
        return _Connection(client, store, None, None, current.generation)
    store = prefix_store("ps/", current.store)
    server_group = PeerGroup(store, workers + worker, 2 * workers)
    client_group = PeerGroup(store, worker, 2 * workers)
    arrive_and_wait(store, "arrived", 2 * workers, timeout_s, f"worker {worker}", ranks=2)
    server = ShardServer(server_group, workers, worker, store, PullRecorder())
    client = PSClient(client_group, worker, workers, workers, dedicated=False)

    def serve() -> None:
        try:
            server.serve()
        except WorkerLostError as error:
            client.fail(f"{server.name} stopped: {error}")

    thread = threading.Thread(target=serve, name=f"shoal-ps-server{worker}", daemon=True)
    thread.start()
    return _Connection(client, store, server, thread, current.generation)


def local_server() -> ShardServer | None:
    """The server shard this process hosts (co-located mode), e.g. to read its pull recorder in a test."""
    current = context.peek()
    connection: _Connection | None = None if current is None else current.part(_PART)
    return connection.server if connection is not None else None


def close() -> None:
    """Leave the group: goodbye to every server; a co-located server keeps serving until every worker left."""
    current = context.peek()
    with _lock:
        connection: _Connection | None = None if current is None else current.parts.pop(_PART, None)
    if connection is None:
        return
    connection.client.close()
    if connection.thread is not None and connection.client.error is None and not exiting_on_error():
        # A co-located server keeps serving until every worker has left; peers still training may take long, so
        # the wait is bounded (and the thread is a daemon: it cannot keep the process alive past its exit).
        limit_s = float(engine_setting("collective_timeout_s"))
        connection.thread.join(limit_s)
        if connection.thread.is_alive():
            get_logger().error(
                "shoal.ps: this worker's co-located server still serves workers that have not left after %.0f s "
                "(%s); leaving anyway, and they will see it go",
                limit_s,
                env_name("COLLECTIVE_TIMEOUT_SECONDS"),
            )
    if connection.client.error is not None:
        get_logger().warning("shoal.ps: left the parameter-server group after: %s", connection.client.error)
