"""Rendezvous through torch.distributed's TCPStore, with shoalrun's per-job secret checked on the way in."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

import torch.distributed as dist

from shoal.runtime.launch_env import LaunchInfo

_NONCE_KEY = "shoal/auth/nonce"
_DIGEST_KEY = "shoal/auth/digest"


def secret_digest(secret: str, nonce: str) -> str:
    """HMAC-SHA256 of ``nonce`` keyed by the job secret: proves the secret without sending it."""
    return hmac.new(secret.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def secret_namespace(secret: str | None) -> str:
    """Key prefix derived from the secret, so a process that lacks it cannot even find the job's keys."""
    if secret is None:
        return "shoal/open"
    return "shoal/" + hashlib.sha256(secret.encode()).hexdigest()[:16]


def host_store(addr: str, port: int, secret: str, timeout_s: float, listen_fd: int | None = None) -> dist.TCPStore:
    """Start the job's TCPStore server (shoalrun does this) and publish the secret challenge.

    Args:
        addr: address to listen on.
        port: port to listen on.
        secret: the per-job secret handed to the workers.
        timeout_s: how long store operations may wait.
        listen_fd: an already bound and listening socket to serve on, so the port cannot be taken meanwhile.

    Returns:
        The server-side store; keep it alive for the life of the job.
    """
    store = dist.TCPStore(
        addr,
        port,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )
    nonce = secrets.token_hex(16)
    store.set(_NONCE_KEY, nonce)
    store.set(_DIGEST_KEY, secret_digest(secret, nonce))
    return store


def connect_store(info: LaunchInfo, timeout_s: float) -> dist.Store:
    """Connect to (or, for rank 0 of a launcher without a store, host) the job's store, checking the secret.

    Raises:
        RuntimeError: when the store cannot be reached in time, or when this process does not hold the
            job's secret.
    """
    if info.size == 1 and info.store_addr is None:
        return dist.HashStore()
    assert info.store_addr is not None and info.store_port is not None  # LaunchInfo validates this
    is_master = info.rank == 0 and not info.store_hosted_by_launcher
    try:
        store = dist.TCPStore(
            info.store_addr,
            info.store_port,
            world_size=None if info.store_hosted_by_launcher else info.size,
            is_master=is_master,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as error:  # torch raises several types (DistNetworkError, RuntimeError, TimeoutError)
        raise RuntimeError(
            f"shoal: rank {info.rank} could not reach the rendezvous store at {info.store_addr}:{info.store_port} "
            f"within {timeout_s:.0f} s ({info.launcher}): {error}"
        ) from error
    if info.launcher == "shoalrun":
        check_secret(store, info.secret, timeout_s)
    return store


def check_secret(store: dist.Store, secret: str | None, timeout_s: float) -> None:
    """Refuse this process unless it holds the secret whose digest shoalrun published in the store."""
    if not secret:
        raise RuntimeError(
            "shoal: rendezvous refused: SHOAL_SECRET is not set in this process, so it cannot join a shoalrun job"
        )
    try:
        store.wait([_NONCE_KEY, _DIGEST_KEY], timedelta(seconds=timeout_s))
    except Exception as error:
        raise RuntimeError(f"shoal: the rendezvous store published no secret challenge: {error}") from error
    nonce = store.get(_NONCE_KEY).decode()
    expected = store.get(_DIGEST_KEY).decode()
    if not hmac.compare_digest(secret_digest(secret, nonce), expected):
        raise RuntimeError(
            "shoal: rendezvous refused: this process's SHOAL_SECRET does not match the job's secret "
            "(it was not started by this job's shoalrun)"
        )


def generation_store(store: dist.Store, secret: str | None, rank: int) -> tuple[dist.Store, int]:
    """Return a store scoped to this rank's next init generation, so init() after shutdown() starts clean.

    Every rank counts its own inits under its rank; ranks that init together therefore agree on the count.
    """
    namespace = secret_namespace(secret)
    generation = store.add(f"{namespace}/init_count/{rank}", 1)
    return dist.PrefixStore(f"{namespace}/gen{generation}/", store), generation


def prefix_store(prefix: str, store: dist.Store) -> dist.Store:
    """A view of ``store`` whose keys all live under ``prefix``."""
    return dist.PrefixStore(prefix, store)
