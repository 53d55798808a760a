"""Clusters: Slurm node lists and a simulated Slurm allocation running the sbatch example; Kubeflow PyTorchJob pods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, free_port
from shoal.runner.cli import parse_args
from shoal.runner.hosts import HostSpecError
from shoal.runner.launcher import build_slots, requested_hosts
from shoal.runner.spawners import allocation_nodes, remote_argv
from shoal.runtime.launch_env import detect_launch
from shoal.runtime.slurm import NodeListError, allocation, expand_counts, expand_nodelist, hostnames

FAKE_SRUN = Path(__file__).resolve().parent / "workers" / "fake_srun.py"


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu[01-04]-ib", ["gpu01-ib", "gpu02-ib", "gpu03-ib", "gpu04-ib"]),
        ("a[1,3-5],b2", ["a1", "a3", "a4", "a5", "b2"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("node-7, node-2", ["node-7", "node-2"]),
        ("x[1-2],x1", ["x1", "x2"]),
    ],
)
def test_slurm_node_lists_expand_as_slurm_does(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "a[1-", "a]", "a[3-1]", "a[x]", "a[]", "a,,b", "a[[1]]"])
def test_bad_slurm_node_lists_say_why(bad: str) -> None:
    with pytest.raises(NodeListError, match="Slurm node list"):
        expand_nodelist(bad)


def _fake_scontrol(bin_dir: Path, log: Path, answer: str | None) -> None:
    """An ``scontrol`` on the PATH that logs its calls and prints ``answer`` (None: fail as a broken one would)."""
    body = f'echo "$@" >> {log}\n' + (f"printf '%s\\n' {answer}\n" if answer is not None else "exit 1\n")
    script = bin_dir / "scontrol"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)


def test_scontrol_is_asked_first_and_the_built_in_parser_is_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "calls"
    _fake_scontrol(tmp_path, log, "alpha beta")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert hostnames("whatever[1-2]") == ["alpha", "beta"]  # Slurm's answer wins
    assert log.read_text().split() == ["show", "hostnames", "whatever[1-2]"]
    _fake_scontrol(tmp_path, log, None)
    assert hostnames("n[1-2]") == ["n1", "n2"]


@pytest.mark.parametrize(("text", "counts"), [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), (" 1 ,3(x1)", [1, 3])])
def test_slurm_tasks_per_node_expand(text: str, counts: list[int]) -> None:
    assert expand_counts(text) == counts


@pytest.mark.parametrize("bad", ["", "x", "2(x)", "2(3)", "2x3", "-1"])
def test_bad_slurm_tasks_per_node_say_why(bad: str) -> None:
    with pytest.raises(NodeListError, match="bad per-node count"):
        expand_counts(bad)


def test_shoalrun_takes_the_slurm_allocation_as_its_hosts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # the built-in node list parser, whatever this machine has
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    assert allocation(os.environ) is None
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3],gpu7")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3),4")
    found = allocation(os.environ)
    assert found is not None and found.tasks == 10 and found.describe() == "n1:2,n2:2,n3:2,gpu7:4"
    hosts = requested_hosts(parse_args(["python", "train.py"]))  # no -np: the allocation's tasks
    assert [(h.hostname, h.slots) for h in hosts] == [("n1", 2), ("n2", 2), ("n3", 2), ("gpu7", 4)]
    assert len(build_slots(parse_args(["-np", "5", "python", "train.py"]))) == 5
    with pytest.raises(HostSpecError, match=r"-np 11 is more than the 10 tasks of Slurm job 42's allocation"):
        requested_hosts(parse_args(["-np", "11", "python", "train.py"]))
    with pytest.raises(HostSpecError, match=r"-np 12 is more than"):  # an elastic job's --min-np counts too
        requested_hosts(parse_args(["--min-np", "12", "python", "train.py"]))
    assert [h.hostname for h in requested_hosts(parse_args(["-H", "a:1", "python", "t.py"]))] == ["a"]  # -H wins
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    with pytest.raises(NodeListError, match="gives 2 counts for the 4 nodes"):
        allocation(os.environ)
    # Inside an srun step, the step's nodes and tasks (the job's list and counts may cover more).
    monkeypatch.setenv("SLURM_STEP_NODELIST", "n2")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1")
    step_allocation = allocation(os.environ)
    assert step_allocation is not None and step_allocation.describe() == "n2:1"
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    monkeypatch.delenv("SLURM_STEP_TASKS_PER_NODE")
    # Outside an allocation a node of it is reached over ssh; inside, as a one-task Slurm step when srun exists.
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3),4")
    config = parse_args(["python", "train.py"])
    assert remote_argv(config, "n2", "true", allocation_nodes(os.environ))[0] == "ssh"
    bin_dir = tmp_path
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    step = remote_argv(config, "n2", "true", allocation_nodes(os.environ))
    assert step[0] == str(bin_dir / "srun") and "--nodelist=n2" in step and "--overlap" in step
    assert remote_argv(config, "elsewhere", "true", allocation_nodes(os.environ))[0] == "ssh"  # not a node of the allocation


def test_slurm_rendezvous_is_the_first_host_of_an_odd_node_list() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "gpu[07,09-10]-ib,cpu1", "SLURM_JOB_ID": "9"}
    assert detect_launch(env).store_addr == "gpu07-ib"


def test_sbatch_example_trains_under_a_simulated_slurm_allocation(tmp_path: Path) -> None:
    """examples/slurm/train.sbatch as sbatch would run it: two nodes (127.0.0.1 and 127.0.0.2, each its own host to
    Shoal), one task each, srun starting the tasks with Slurm's variables; the digits CNN reaches its accuracy bar."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_SRUN} "$@"\n')
    srun.chmod(0o755)
    log = tmp_path / "scontrol_calls"
    _fake_scontrol(bin_dir, log, "127.0.0.1 127.0.0.2")
    env = clean_env()
    env.update(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),  # `python`: this one
        SLURM_JOB_ID=str(os.getpid()),
        SLURM_JOB_NODELIST="127.0.0.[1-2]",
        SLURM_NNODES="2",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_CPUS_PER_TASK="1",
        MASTER_PORT=str(free_port()),
    )
    args = ["--epochs", "4", "--checkpoint", str(tmp_path / "digits.pt")]
    result = subprocess.run(
        ["bash", "examples/slurm/train.sbatch", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["world"] == 2
    assert summary["test_accuracy"] >= 0.95, summary
    assert "127.0.0.[1-2]" in log.read_text()  # the workers asked scontrol for the node list


# Kubeflow's training operator gives each PyTorchJob pod (no torchrun in the container) these variables.
def _pod_env(rank: int, world: int, port: int, secret: str) -> dict[str, str]:
    env = clean_env()
    env.update(
        KUBERNETES_SERVICE_HOST="10.96.0.1",
        KUBERNETES_SERVICE_PORT="443",
        MASTER_ADDR="127.0.0.1",  # the master pod's service name in a cluster
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        PYTHONUNBUFFERED="0",
        SHOAL_SECRET=secret,  # from a Kubernetes Secret (docs/kubernetes.md)
    )
    return env


def test_pytorchjob_pod_environment_is_detected() -> None:
    info = detect_launch(_pod_env(2, 4, 23456, "s3cret"))
    assert (info.launcher, info.rank, info.size, info.store_addr, info.store_port) == ("kubernetes", 2, 4, "127.0.0.1", 23456)
    assert info.store_hosted_by_launcher is False and info.secret == "s3cret"  # the master pod hosts the store
    with_torchrun = {**_pod_env(0, 2, 1, ""), "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"}
    assert detect_launch(with_torchrun).launcher == "torchrun"


CHECK_POD = (
    "import sys, torch, shoal.torch as hvd; from shoal.runtime import context; hvd.init(); "
    "total = hvd.allreduce(torch.ones(1) * (hvd.rank() + 1), op=hvd.Sum).item(); "
    "sys.stdout.write(f'{hvd.rank()} {hvd.size()} {context.current().launch.launcher} "
    "{type(context.current().job_store).__name__} {total}' + chr(10))"
)


def test_pytorchjob_pods_train_together_on_an_authenticated_store() -> None:
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", CHECK_POD],
            env=_pod_env(rank, 2, port, "0123456789abcdef"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=60) for p in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (_, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, err
    assert sorted(out.strip() for out, _ in outputs) == ["0 2 kubernetes StoreView 3.0", "1 2 kubernetes StoreView 3.0"]


def test_pytorchjob_manifest_runs_shoal_with_a_secret_and_one_rank_a_pod() -> None:
    yaml = pytest.importorskip("yaml", reason="pyyaml reads the manifest (pip install 'shoal[config]')")
    documents = list(yaml.safe_load_all((REPO / "docs" / "kubernetes" / "pytorchjob.yaml").read_text()))
    kinds = {d["kind"]: d for d in documents}
    assert set(kinds) == {"Secret", "PyTorchJob"}
    specs = kinds["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    for role in ("Master", "Worker"):
        container = specs[role]["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the operator finds the port and sets MASTER_ADDR through this name
        assert container["command"][:2] == ["python", "examples/digits.py"]
        secret_env = next(e for e in container["env"] if e["name"] == "SHOAL_SECRET")
        assert secret_env["valueFrom"]["secretKeyRef"]["name"] == kinds["Secret"]["metadata"]["name"]
