"""``horovod.torch.mpi_ops``: the same names at the module path Horovod scripts import them from."""

from typing import Any

import shoal.torch as _hvd

NAMES = (
    "Adasum",
    "Average",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
)
"""Horovod's ``mpi_ops`` names; each resolves, on access, to ``shoal.torch``'s own object."""


def __getattr__(name: str) -> Any:
    """Each name is ``shoal.torch``'s own object (``mpi_ops.allreduce is hvd.allreduce``)."""
    if name in NAMES:
        return getattr(_hvd, name)
    raise AttributeError(f"module 'shoal.torch.mpi_ops' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(NAMES)
