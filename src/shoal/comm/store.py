"""Rendezvous: the job's authenticated store (``auth_store``), or torch's TCPStore when no job secret exists."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shoal.comm import torch_store
from shoal.comm.auth_store import AuthStoreServer, StoreAuthError
from shoal.comm.names import secret_namespace as secret_namespace  # re-exported for the workers
from shoal.comm.torch_store import StoreView
from shoal.config import env_name
from shoal.log import get_logger

_AUTH_ADDRESS_KEY = "shoal/auth_store_address"
"""Under torchrun's agent store: where rank 0 serves the job's authenticated store."""
_warned_open = False
_job_stores: dict[tuple[str, int, str | None, int], dist.Store] = {}
"""The job's store, by address: it outlives init()/shutdown() (a rank-0-hosted store would otherwise close under
peers still using it, and its port could not be bound again), as shoalrun's and torchrun's stores do."""


def host_store(addr: str, port: int, secret: str, timeout_s: float, listen_fd: int | None = None) -> StoreView:
    """Start the job's authenticated store (shoalrun and the test harness do this).

    Args:
        addr: address to listen on (ignored with ``listen_fd``).
        port: port to listen on (ignored with ``listen_fd``).
        secret: the per-job secret handed to the workers.
        timeout_s: how long this process's own store operations may wait.
        listen_fd: an already bound and listening socket to serve on, so the port cannot be taken meanwhile.

    Returns:
        This process's view of the store; ``close()`` stops the server.
    """
    return torch_store.local_store(AuthStoreServer(secret, addr, port, listen_fd=listen_fd), timeout_s)


def connect_job_store(addr: str, port: int, secret: str | None, timeout_s: float, prefix: str = "") -> dist.Store:
    """A client of the job's authenticated store (the job's processes other than its host), keys under ``prefix``."""
    if not secret:
        raise RuntimeError(
            f"shoal: rendezvous refused: {env_name('SECRET')} is not set in this process, so it cannot join a shoalrun job"
        )
    try:
        return torch_store.connect(addr, port, secret, timeout_s, prefix)
    except StoreAuthError as error:
        raise RuntimeError(f"shoal: {error}") from error


def connect_store(info: Any, timeout_s: float) -> dist.Store:
    """Connect to (or, for rank 0 of a launcher without a store, host) the job's store.

    With a job secret (always under shoalrun; under torchrun, mpirun or srun when the same ``SECRET``, see
    docs/security.md, is set in every rank's environment) the store is authenticated. Without one, torch's TCPStore
    is used and the first ``init()`` warns that anyone who reaches the port can read and steer the job.

    Raises:
        RuntimeError: when the store cannot be reached in time, or when this process does not hold the
            job's secret.
    """
    if info.size == 1 and info.store_addr is None:
        return dist.HashStore()
    assert info.store_addr is not None and info.store_port is not None  # LaunchInfo validates this
    key = (info.store_addr, info.store_port, info.secret, info.rank if info.rank == 0 else -1)
    store = _job_stores.get(key)
    if store is None:
        store = _job_stores[key] = _connect_store(info, timeout_s)
    return store


def _connect_store(info: Any, timeout_s: float) -> dist.Store:
    where = f"{info.store_addr}:{info.store_port}"
    try:
        if info.launcher == "shoalrun" or (info.secret and info.store_hosted_by_launcher is False):
            return _secret_store(info, timeout_s)
        if info.secret:  # torchrun's agent hosts an open store: it only tells the ranks where rank 0 serves ours
            return _behind_torchrun_store(info, timeout_s)
        _warn_unauthenticated(info)
        return dist.TCPStore(
            info.store_addr,
            info.store_port,
            world_size=None if info.store_hosted_by_launcher else info.size,
            is_master=info.rank == 0 and not info.store_hosted_by_launcher,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as error:  # OSError: rank 0 cannot bind the port (another process holds it)
        if str(error).startswith("shoal:"):
            raise
        raise RuntimeError(
            f"shoal: rank {info.rank} could not reach the rendezvous store at {where} within {timeout_s:.0f} s "
            f"({info.launcher}): {error}"
        ) from error


def _secret_store(info: Any, timeout_s: float) -> dist.Store:
    """shoalrun's store (every rank a client), or rank 0 hosting it at the launcher's rendezvous address."""
    if info.launcher != "shoalrun" and info.rank == 0:
        return host_store(info.store_addr, info.store_port, info.secret, timeout_s)
    return connect_job_store(info.store_addr, info.store_port, info.secret, timeout_s)


def _behind_torchrun_store(info: Any, timeout_s: float) -> dist.Store:
    agent = dist.TCPStore(
        info.store_addr, info.store_port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    if info.rank == 0:
        local = host_store(info.store_addr, 0, info.secret, timeout_s)
        assert local.server is not None
        agent.set(_AUTH_ADDRESS_KEY, f"{info.store_addr}:{local.server.port}")
        return local
    host, _, port = agent.get(_AUTH_ADDRESS_KEY).decode().rpartition(":")
    # The address comes from an open store; a forged one fails the mutual handshake instead of fooling us.
    return connect_job_store(host, int(port), info.secret, timeout_s)


def _warn_unauthenticated(info: Any) -> None:
    global _warned_open
    if not _warned_open and info.rank == 0:
        _warned_open = True
        get_logger().warning(
            "the rendezvous store at %s:%s is unauthenticated (%s without %s): anyone who reaches that port "
            "can read and steer this job. Set the same random %s in every rank's environment to "
            "authenticate it (see docs/security.md).",
            info.store_addr,
            info.store_port,
            info.launcher,
            env_name("SECRET"),
            env_name("SECRET"),
        )


def generation_store(store: dist.Store, secret: str | None, rank: int) -> tuple[dist.Store, int]:
    """Return a store scoped to this rank's next init generation, so init() after shutdown() starts clean.

    Every rank counts its own inits under its rank; ranks that init together therefore agree on the count.
    """
    namespace = secret_namespace(secret)
    generation = store.add(f"{namespace}/init_count/{rank}", 1)
    return prefix_store(f"{namespace}/gen{generation}/", store), generation


def prefix_store(prefix: str, store: dist.Store, abort: Callable[[], str | None] | None = None) -> dist.Store:
    """A view of ``store`` whose keys all live under ``prefix``.

    Shoal's own stores give a view of themselves, which keeps them referenced from Python (torch's PrefixStore
    holds only the C++ half of a Python store). With ``abort``, a wait for missing keys in Shoal's store asks it about
    once a second, and a reason it returns ends the wait (``KeyValueView.with_prefix``); torch's stores ignore it.
    """
    if isinstance(store, StoreView):
        return store.with_prefix(prefix, abort)
    return dist.PrefixStore(prefix, store)
