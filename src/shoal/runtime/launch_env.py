"""Work out who started this process and where the rendezvous is, from the environment alone.

Supported launchers, tried in this order: shoalrun (a ``SlotInfo`` identity), torchrun (``TORCHELASTIC_RUN_ID`` or
``RANK`` + ``WORLD_SIZE`` + ``MASTER_ADDR``; named ``kubernetes`` in a Kubeflow PyTorchJob pod without torchrun),
OpenMPI's mpirun (``OMPI_COMM_WORLD_*``), PMI-based MPIs (``PMI_RANK``/``PMIX_RANK``), Slurm's srun
(``SLURM_PROCID``; node lists such as ``gpu[01-04]-ib`` expanded by ``shoal.runtime.slurm``), and a plain process
(size 1).
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.comm.ports import free_port
from shoal.config.worker import JobAddress, SlotInfo, job_secret
from shoal.runtime.slurm import hostnames

__all__ = ["LaunchInfo", "SlotInfo", "detect_launch", "first_slurm_host"]


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process."""

    launcher: str
    """One of ``shoalrun``, ``torchrun``, ``kubernetes`` (a PyTorchJob pod without torchrun), ``mpirun``, ``slurm``,
    ``single``."""
    rank: int
    """Global rank of this process."""
    size: int
    """Number of processes in the job."""
    host_key: str
    """Identifies this process's host; ranks with the same key share a host (and shared memory)."""
    local_rank: int | None = None
    """Rank within the host, when the launcher says; otherwise derived from the ranks sharing ``host_key``."""
    store_addr: str | None = None
    """Address of the TCPStore used for rendezvous; None for a single process."""
    store_port: int | None = None
    """Port of that TCPStore."""
    store_hosted_by_launcher: bool = False
    """True when the launcher (shoalrun, torchrun's agent) hosts the store, so every rank is a client."""
    secret: str | None = None
    """The per-job secret that shoalrun hands out; checked at rendezvous."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"{self.launcher}: world size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"{self.launcher}: rank {self.rank} is outside [0, {self.size})")
        if self.size > 1 and (self.store_addr is None or self.store_port is None):
            raise ValueError(f"{self.launcher}: a job of size {self.size} needs a rendezvous address and port")


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(f"environment variable {name} is required by this launcher but is not set")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if env.get(name) not in (None, "") else None


DERIVED_PORTS = range(20000, 32768)
"""Where a derived rendezvous port lies: below Linux's ephemeral range (32768-60999 by default), from which the kernel
hands out the local ports of outgoing connections and of sockets bound to port 0, so no such socket holds it. With
[20000, 40000), a plain mpirun job's port in CI was another job's store (EADDRINUSE, then a ping to a stranger)."""


def _derived_port(token: str) -> int:
    """A port in ``DERIVED_PORTS`` that every rank derives from the same job token, for launchers that give none."""
    digest = hashlib.sha256(token.encode()).digest()
    return DERIVED_PORTS.start + int.from_bytes(digest[:4], "big") % len(DERIVED_PORTS)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as ``gpu[01-04]-ib,cpu3`` (``scontrol`` when on the PATH)."""
    return hostnames(nodelist)[0]


def _from_shoalrun(env: Mapping[str, str], slot: SlotInfo) -> LaunchInfo:
    address = JobAddress.from_env(env)
    return LaunchInfo(
        launcher="shoalrun",
        rank=slot.rank,
        size=slot.size,
        local_rank=slot.local_rank if slot.local_rank >= 0 else None,
        host_key=slot.hostname or socket.gethostname(),
        store_addr=address.addr if address else None,
        store_port=address.port if address else None,
        store_hosted_by_launcher=True,
        secret=job_secret(env),
    )


def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo:
    # Kubeflow's PyTorchJob without torchrun in the container sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT per pod
    # (one rank a pod, the master pod is rank 0 and hosts the store); with torchrun, TORCHELASTIC_RUN_ID is set.
    in_pod = "KUBERNETES_SERVICE_HOST" in env and "TORCHELASTIC_RUN_ID" not in env
    return LaunchInfo(
        launcher="kubernetes" if in_pod else "torchrun",
        rank=_int(env, "RANK"),
        size=_int(env, "WORLD_SIZE"),
        local_rank=_optional_int(env, "LOCAL_RANK"),
        host_key=socket.gethostname(),
        store_addr=env.get("MASTER_ADDR"),
        store_port=_optional_int(env, "MASTER_PORT"),
        store_hosted_by_launcher=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        secret=job_secret(env),
    )


def _mpi_rendezvous(env: Mapping[str, str], size: int, local_size: int | None, token: str) -> tuple[str, int]:
    """Rendezvous for MPI launchers: MASTER_ADDR/PORT if exported, else mpi4py, else a single-host default."""
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], _int(env, "MASTER_PORT")
    try:
        from mpi4py import MPI  # type: ignore[import-not-found]
    except ImportError:
        MPI = None
    if MPI is not None:
        comm = MPI.COMM_WORLD
        address = None
        if comm.Get_rank() == 0:
            address = (socket.gethostname(), free_port(""))
        addr, port = comm.bcast(address, root=0)
        return str(addr), int(port)
    if local_size is not None and local_size == size:
        return "127.0.0.1", _derived_port(token)
    raise ValueError(
        "mpirun started ranks on several hosts but no rendezvous address is known: export MASTER_ADDR and "
        "MASTER_PORT (mpirun -x MASTER_ADDR=... -x MASTER_PORT=...) or install mpi4py"
    )


def _from_openmpi(env: Mapping[str, str]) -> LaunchInfo:
    size = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_size = _optional_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    token = env.get("OMPI_MCA_ess_base_jobid") or env.get("OMPI_MCA_orte_hnp_uri") or env.get("PMIX_NAMESPACE", "")
    addr, port = _mpi_rendezvous(env, size, local_size, "ompi:" + token)
    return LaunchInfo(
        launcher="mpirun",
        rank=_int(env, "OMPI_COMM_WORLD_RANK"),
        size=size,
        local_rank=_optional_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        host_key=socket.gethostname(),
        store_addr=addr,
        store_port=port,
        secret=job_secret(env),
    )


def _from_pmi(env: Mapping[str, str]) -> LaunchInfo:
    rank_name, size_name = ("PMI_RANK", "PMI_SIZE") if "PMI_RANK" in env else ("PMIX_RANK", "PMI_SIZE")
    size = _int(env, size_name)
    local_size = _optional_int(env, "MPI_LOCALNRANKS")
    addr, port = _mpi_rendezvous(env, size, local_size, "pmi:" + env.get("PMI_ID", env.get("PMIX_NAMESPACE", "")))
    return LaunchInfo(
        launcher="mpirun",
        rank=_int(env, rank_name),
        size=size,
        local_rank=_optional_int(env, "MPI_LOCALRANKID"),
        host_key=socket.gethostname(),
        store_addr=addr,
        store_port=port,
        secret=job_secret(env),
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    job_token = f"slurm:{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
    port = _optional_int(env, "MASTER_PORT") or _derived_port(job_token)
    return LaunchInfo(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID"),
        size=_int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"),
        local_rank=_optional_int(env, "SLURM_LOCALID"),
        host_key=env.get("SLURMD_NODENAME") or socket.gethostname(),
        store_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
        store_port=port,
        secret=job_secret(env),
    )


def detect_launch(env: Mapping[str, str]) -> LaunchInfo:
    """Return what the launcher that started this process said, or a size-1 job when there was none."""
    slot = SlotInfo.from_env(env)
    if slot is not None:
        return _from_shoalrun(env, slot)
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env):
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_openmpi(env)
    if "PMI_RANK" in env or ("PMIX_RANK" in env and "PMI_SIZE" in env):
        return _from_pmi(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return LaunchInfo(launcher="single", rank=0, size=1, local_rank=0, host_key=socket.gethostname())
