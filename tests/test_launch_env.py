"""Launcher detection and topology, from environment dictionaries (no processes)."""

from __future__ import annotations

import socket

import pytest

from shoal.comm import ports
from shoal.runtime.launch_env import _derived_port, detect_launch, first_slurm_host
from shoal.runtime.topology import build_topology

pytestmark = pytest.mark.check  # the quick tier: make check


def test_plain_process_is_a_world_of_one() -> None:
    info = detect_launch({})
    assert (info.launcher, info.rank, info.size, info.store_addr) == ("single", 0, 1, None)


def test_shoalrun_env() -> None:
    env = {
        "SHOAL_RANK": "1",
        "SHOAL_SIZE": "2",
        "SHOAL_LOCAL_RANK": "1",
        "SHOAL_HOSTNAME": "h",
        "SHOAL_RENDEZVOUS_ADDR": "10.0.0.1",
        "SHOAL_RENDEZVOUS_PORT": "1234",
        "SHOAL_SECRET": "s",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.host_key) == ("shoalrun", 1, 2, 1, "h")
    assert (info.store_addr, info.store_port, info.store_hosted_by_launcher, info.secret) == (
        "10.0.0.1",
        1234,
        True,
        "s",
    )


def test_torchrun_env_with_agent_store() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "m",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank) == ("torchrun", 3, 4, 1)
    assert (info.store_addr, info.store_port, info.store_hosted_by_launcher) == ("m", 29500, True)


def test_openmpi_env_on_one_host_derives_the_same_port_on_every_rank() -> None:
    base = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "77"}
    infos = [detect_launch({**base, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)}) for r in (0, 1)]
    assert [i.launcher for i in infos] == ["mpirun", "mpirun"]
    assert infos[0].store_port == infos[1].store_port
    assert infos[0].store_addr == "127.0.0.1"
    assert not infos[0].store_hosted_by_launcher


def test_openmpi_env_prefers_exported_master_address() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "999"}
    assert (detect_launch(env).store_addr, detect_launch(env).store_port) == ("n1", 999)


def test_openmpi_multi_host_without_address_is_a_clear_error() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    try:
        import mpi4py  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("mpi4py is installed, so MPI itself supplies the rendezvous address")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_launch(env)


def test_pmi_env() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank) == ("mpirun", 1, 2, 1)


def test_slurm_env() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[03-06]",
        "SLURM_JOB_ID": "42",
        "SLURMD_NODENAME": "gpu05",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.host_key) == ("slurm", 5, 8, 1, "gpu05")
    assert info.store_addr == "gpu03"
    assert 20000 <= (info.store_port or 0) < 32768  # below the kernel's ephemeral ports


def test_derived_ports_lie_below_the_ephemeral_range_and_spread_over_it() -> None:
    ports = {_derived_port(f"ompi:{job}") for job in range(2000)}
    assert min(ports) >= 20000 and max(ports) < 32768 and len(ports) > 1800


@pytest.mark.parametrize(("nodelist", "first"), [("n1", "n1"), ("n[1-3]", "n1"), ("gpu[07,09-10],cpu1", "gpu07"), ("a,b", "a")])
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_inconsistent_env_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside"):
        detect_launch({"SHOAL_RANK": "2", "SHOAL_SIZE": "2", "SHOAL_RENDEZVOUS_ADDR": "a", "SHOAL_RENDEZVOUS_PORT": "1"})
    with pytest.raises(ValueError, match="integer"):
        detect_launch({"SHOAL_RANK": "x", "SHOAL_SIZE": "2"})
    with pytest.raises(ValueError, match="rendezvous"):
        detect_launch({"SHOAL_RANK": "0", "SHOAL_SIZE": "2"})


def test_topology_two_hosts_uneven() -> None:
    hosts = ["a", "a", "a", "b"]
    topologies = [build_topology(r, hosts, [None] * 4) for r in range(4)]
    assert [(t.local_rank, t.local_size, t.cross_rank, t.cross_size) for t in topologies] == [
        (0, 3, 0, 2),
        (1, 3, 0, 1),
        (2, 3, 0, 1),
        (0, 1, 1, 2),
    ]
    assert not topologies[0].is_homogeneous
    assert topologies[3].local_peers() == [3]
    assert topologies[0].cross_peers() == [0, 3]


def test_topology_uses_launcher_local_ranks_and_checks_them() -> None:
    topology = build_topology(0, ["h", "h"], [1, 0])
    assert topology.local_rank == 1 and topology.is_homogeneous
    with pytest.raises(ValueError, match="local ranks"):
        build_topology(0, ["h", "h"], [0, 0])


def test_hostname_default() -> None:
    assert detect_launch({}).host_key == socket.gethostname()


def test_a_port_announced_before_its_store_is_outside_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A released bind(0) port is the kernel's to hand out again at once (CI found another job's store on one):
    free_port() chooses below the ephemeral range, or above it when the range starts low, and checks the bind."""
    low, high = ports._ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert not low <= port <= high
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 50000))
    assert all(50000 < ports.free_port() <= 65535 for _ in range(20))
