"""init() under every launcher's environment: plain process, torchrun, mpirun (real and OMPI env), Slurm env, ssh."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SHOALRUN, clean_env, free_port, needs_netns
from shoal.runner.spawners import forwarded_env

# One write per line, so that launchers which forward raw output chunks (mpirun) cannot interleave lines.
PRINT_TOPOLOGY = (
    "import sys, shoal.torch as hvd; hvd.init(); "
    "values = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()); "
    "sys.stdout.write(' '.join(map(str, values)) + chr(10)); sys.stdout.flush()"
)


def run_all(envs: list[dict[str, str]], timeout: float = 60) -> list[str]:
    """Start one plain python per env at once (as a launcher would) and return each one's stdout."""
    processes = [
        subprocess.Popen([sys.executable, "-c", PRINT_TOPOLOGY], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for env in envs
    ]
    outputs = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=timeout)
            assert process.returncode == 0, err.decode()
            outputs.append(out.decode().strip())
    finally:
        for process in processes:
            process.kill()
    return outputs


def test_plain_process_is_size_one() -> None:
    assert run_all([clean_env()]) == ["0 1 0 1 0 1"]


def test_real_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "print_topology.py"
    script.write_text(PRINT_TOPOLOGY + "\n")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    result = subprocess.run([*command, str(script)], env=clean_env(), capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:-1]) == ["0 2 0 2 0 1", "1 2 1 2 0 1"]


STORE_KIND = (
    "import sys, shoal.torch as hvd, torch; from shoal.runtime import context; hvd.init(); "
    "line = f'{hvd.rank()} {type(context.current().job_store).__name__} {hvd.allreduce(torch.ones(1), op=hvd.Sum).item()}'; "
    "sys.stdout.write(line + chr(10)); sys.stdout.flush()"
)


@pytest.mark.parametrize("secret", ["", "0123456789abcdef"])
def test_torchrun_authenticates_the_store_when_shoal_secret_is_set(tmp_path: Path, secret: str) -> None:
    script = tmp_path / "store_kind.py"
    script.write_text(STORE_KIND + "\n")
    env = clean_env()
    if secret:
        env["SHOAL_SECRET"] = secret
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    result = subprocess.run([*command, str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    kind = "StoreView" if secret else "TCPStore"  # Shoal's authenticated store, or torch's open one
    assert sorted(result.stdout.split("\n")[:-1]) == [f"0 {kind} 2.0", f"1 {kind} 2.0"]
    warned = result.stderr.count("is unauthenticated (torchrun without SHOAL_SECRET)")
    assert warned == (0 if secret else 1), result.stderr  # said once, by rank 0, when there is no secret


def test_openmpi_environment() -> None:
    job = str(time.time_ns())
    envs = []
    for rank in range(2):
        env = clean_env()
        env.update(
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()) if rank == 0 else "",
            OMPI_MCA_ess_base_jobid=job,
        )
        envs.append(env)
    envs[1]["MASTER_PORT"] = envs[0]["MASTER_PORT"]
    assert run_all(envs) == ["0 2 0 2 0 1", "1 2 1 2 0 1"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_real_mpirun() -> None:
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-c", PRINT_TOPOLOGY]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:-1]) == ["0 2 0 2 0 1", "1 2 1 2 0 1"]


def test_slurm_environment() -> None:
    port = str(free_port())
    envs = []
    for rank in range(2):
        env = clean_env()
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_STEP_NODELIST="localhost",
            SLURM_JOB_ID="1",
            MASTER_PORT=port,
        )
        envs.append(env)
    assert run_all(envs) == ["0 2 0 2 0 1", "1 2 1 2 0 1"]


def test_two_host_run_over_ssh_from_a_venv_with_a_bare_python(loopback_sshd: tuple[int, Path]) -> None:
    """The remote worker is the bare word ``python``: only the forwarded PATH makes it this venv's interpreter (the
    ssh login's own PATH has no ``python`` with torch), as horovodrun forwards the caller's environment."""
    port, key = loopback_sshd
    env = clean_env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    env["SHOAL_TEST_MARK"] = "forwarded"
    env["MY_OWN_SETTING"] = "kept"
    env["CUDA_VISIBLE_DEVICES"] = "7"  # this host's devices; never a remote host's
    code = (
        PRINT_TOPOLOGY + "; import os; g = os.environ.get; "
        "print(g('SHOAL_TEST_MARK'), g('MY_OWN_SETTING'), g('CUDA_VISIBLE_DEVICES'), sys.prefix, os.getcwd(), flush=True)"
    )
    args = [
        "-np",
        "2",
        "-H",
        "localhost:1,127.0.0.2:1",
        "-p",
        str(port),
        "-i",
        str(key),
        "--start-timeout",
        "60",
        "--ssh-strict-host-key-checking",
        "no",
    ]  # a throwaway sshd whose port (and key) change every run
    result = subprocess.run([*SHOALRUN, *args, "python", "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    # Two hosts, one rank each: local rank 0 on both, so the cross communicator spans both hosts.
    assert lines[0] == "[0]<stdout>:0 2 0 1 0 2" and lines[2] == "[1]<stdout>:1 2 0 1 1 2"
    assert lines[1] == f"[0]<stdout>:forwarded kept 7 {sys.prefix} {os.getcwd()}"
    assert lines[3] == f"[1]<stdout>:forwarded kept None {sys.prefix} {os.getcwd()}"


def test_remote_workers_get_the_environment_but_no_shell_functions_devices_or_secret() -> None:
    environ = {
        "PATH": "/venv/bin:/usr/bin",
        "VIRTUAL_ENV": "/venv",
        "LD_LIBRARY_PATH": "/opt/lib",
        "MY_SETTING": "1",
        "BASH_FUNC_module%%": "() { :; }",
        "OLDPWD": "/elsewhere",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SHOAL_SECRET": "old",
        "HOROVOD_SECRET_KEY": "old",
        "SSH_AUTH_SOCK": "/tmp/agent",
        "HOME": "/home/here",
        "XDG_RUNTIME_DIR": "/run/user/0",
        "NOT_ASKED": "here",
    }
    env = forwarded_env(environ, ["EXTRA=2", "NOT_ASKED", "ABSENT"])
    assert env == {
        "PATH": "/venv/bin:/usr/bin",
        "VIRTUAL_ENV": "/venv",
        "LD_LIBRARY_PATH": "/opt/lib",
        "MY_SETTING": "1",
        "NOT_ASKED": "here",
        "EXTRA": "2",
        "PYTHONUNBUFFERED": "1",
    }


@needs_netns
def test_two_emulated_hosts_in_network_namespaces() -> None:
    code = PRINT_TOPOLOGY + "; import torch; print('sum', hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist(), flush=True)"
    command = [
        sys.executable,
        "-m",
        "shoal.bench.netns",
        "--hosts",
        "2",
        "--ranks-per-host",
        "2",
        "--rate",
        "1gbit",
        "--",
        sys.executable,
        "-c",
        code,
    ]
    with subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    lines = [line.split(":", 1)[1] for line in stdout.splitlines() if line.startswith("[")]
    topology = sorted(line for line in lines if not line.startswith("sum"))
    # rank size local_rank local_size cross_rank cross_size: two hosts of two ranks each
    assert topology == ["0 4 0 2 0 2", "1 4 1 2 0 2", "2 4 0 2 1 2", "3 4 1 2 1 2"]
    assert [line for line in lines if line.startswith("sum")] == ["sum [4.0, 4.0, 4.0]"] * 4
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    tag = f"sh{process.pid % 100000}"  # this run's names (EmulatedHosts.tag); other tests' runs may be up now
    assert f"{tag}h0" not in namespaces and f"{tag}h1" not in namespaces  # torn down


@needs_netns
@pytest.mark.alone  # compares two measured bandwidths: a test beside it can slow the intra-host one below the link's
def test_calibration_measures_each_link_class_when_hosts_hold_several_ranks() -> None:
    command = [
        sys.executable,
        "-m",
        "shoal.bench.netns",
        "--hosts",
        "2",
        "--ranks-per-host",
        "2",
        "--rate",
        "1gbit",
        "--",
        sys.executable,
        "-m",
        "shoal.bench.plan",
        "--model",
        "mlp",
    ]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    line = r"(intra-host|inter-host) link \(gloo allreduce\): latency [\d.]+ ms, ([\d.]+ GB/s|unbounded)"
    rates = dict(re.findall(line, result.stdout))
    assert set(rates) == {"intra-host", "inter-host"}, result.stdout
    # An intra-host line fitted with no cost per byte (latency-bound at these sizes, on a loaded machine) is unbounded.
    speed = {link: math.inf if rate == "unbounded" else float(rate.split()[0]) for link, rate in rates.items()}
    assert speed["inter-host"] < speed["intra-host"], (rates, result.stdout[-3000:])  # the shaped 1 Gbit/s link: slower
    assert speed["inter-host"] < 0.2, rates  # 1 Gbit/s is 0.125 GB/s


def test_check_build_reports_each_host_over_ssh(loopback_sshd: tuple[int, Path]) -> None:
    port, key = loopback_sshd
    args = [
        "--check-build",
        "-H",
        "localhost,127.0.0.2",
        "-p",
        str(port),
        "-i",
        str(key),
        "--ssh-strict-host-key-checking",
        "no",
    ]
    result = subprocess.run([*SHOALRUN, *args], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "host localhost: this machine" in result.stdout
    assert re.search(r"host 127\.0\.0\.2: reachable over ssh, Shoal \S+, torch \S+: same versions", result.stdout)
