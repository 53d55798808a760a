"""Create and destroy the torch.distributed world, and the small object collectives used at start-up."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.comm.collectives import allgather_bytes, connect_timeout, lift_timeout


def select_backend() -> str:
    """gloo for CPU tensors, plus NCCL for CUDA tensors where CUDA and NCCL are both present."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_world(store: dist.Store, rank: int, size: int, timeout_s: float, connect_timeout_s: float | None = None) -> str:
    """Join the default process group through ``store``; returns the backend string used.

    ``connect_timeout_s``: how long to wait for a member's connection, when shorter than ``timeout_s``
    (``collectives.connect_timeout``): for members that are all known to be running, such as an elastic round's.
    """
    backend = select_backend()
    bound = connect_timeout(timeout_s, connect_timeout_s)
    timeout = timedelta(seconds=bound if bound is not None else timeout_s)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size, timeout=timeout)
    if bound is not None:
        lift_timeout(None, timeout_s)
    return backend


def destroy_world() -> None:
    """Leave the default process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def world_uses_nccl() -> bool:
    """Whether this process's default group has an NCCL backend (a CUDA job)."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()


def allgather_json(value: Any) -> list[Any]:
    """Gather one JSON-serialisable value from every rank of the default group, in rank order (no pickle)."""
    messages = allgather_bytes(json.dumps(value).encode(), dist.get_world_size(), None)
    return [json.loads(message) for message in messages]


def gloo_available() -> bool:
    """True when this torch build has gloo."""
    return dist.is_gloo_available()


def nccl_version_code() -> int:
    """NCCL's version as Horovod reports it (e.g. 21805 for 2.18.5), or 0 when NCCL is absent."""
    if not dist.is_nccl_available():
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except (RuntimeError, AttributeError, TypeError):  # a CUDA build on a host whose driver cannot load NCCL
        return 0
    return major * 10000 + minor * 100 + patch


def mpi_available() -> bool:
    """True when this torch build has the MPI backend."""
    return dist.is_mpi_available()
