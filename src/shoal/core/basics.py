"""Process identity and capability queries: the ``horovod.torch`` basics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shoal.comm import process_group
from shoal.core.process_sets import ProcessSet, add_process_set
from shoal.runtime import context


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialize Shoal from the launcher's environment (shoalrun, torchrun, mpirun, srun, or none).

    Args:
        comm: Horovod accepts an MPI communicator here; Shoal always uses the launcher's world and only
            accepts None.
        process_sets: as in Horovod: None; a list of ``ProcessSet`` objects to register now, in order, on every
            rank (keep them to pass to collectives; duplicates are refused); or ``"dynamic"`` (nothing now,
            ``add_process_set()`` later, which Shoal always allows).

    Raises:
        NotImplementedError: when ``comm`` is given.
        ValueError: a process set is invalid or given twice (Shoal is shut down again then).
    """
    if comm is not None:
        raise NotImplementedError("shoal.torch.init(comm=...) is not supported: Shoal takes its world from the launcher")
    if isinstance(process_sets, str) and process_sets != "dynamic":
        raise ValueError(f"process_sets must be a list of ProcessSet objects or 'dynamic', got {process_sets!r}")
    static: list[ProcessSet] = [] if process_sets is None or isinstance(process_sets, str) else list(process_sets)
    already = context.is_initialized()
    context.init()
    if already:
        return
    try:
        for process_set in static:
            add_process_set(process_set)
    except BaseException:
        context.shutdown()
        raise


def shutdown() -> None:
    """Shut Shoal down; ``init()`` may be called again afterwards, with a new world if the environment says so."""
    context.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return context.is_initialized()


def rank() -> int:
    """This process's rank among all processes."""
    return context.current().topology.rank


def size() -> int:
    """Number of processes in the job."""
    return context.current().topology.size


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return context.current().topology.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return context.current().topology.local_size


def cross_rank() -> int:
    """Index of this host among the hosts that have a process at this ``local_rank``."""
    return context.current().topology.cross_rank


def cross_size() -> int:
    """Number of hosts that have a process at this ``local_rank``."""
    return context.current().topology.cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    return context.current().topology.is_homogeneous


def mpi_threads_supported() -> bool:
    """Shoal never runs collectives through MPI, so MPI thread support is never in use."""
    context.current()
    return False


def mpi_built() -> bool:
    """True when the installed torch has the MPI backend."""
    return process_group.mpi_available()


def mpi_enabled() -> bool:
    """Shoal's collectives never go through MPI (mpirun only launches), so this is False."""
    return False


def gloo_built() -> bool:
    """True when the installed torch has gloo."""
    return process_group.gloo_available()


def gloo_enabled() -> bool:
    """True when gloo carries CPU collectives, which is always the case when it is built."""
    return process_group.gloo_available()


def nccl_built() -> int:
    """NCCL version code (e.g. 21805) when torch was built with NCCL, else 0, as Horovod answers."""
    return process_group.nccl_version_code()


def ddl_built() -> bool:
    """IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """True when the installed torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """True when the installed torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None
