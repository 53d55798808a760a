"""Shoal under a real Slurm (``tests/slurm_cluster.py``: munged, slurmctld and slurmd on this machine): ``srun`` with
no shoalrun, shoalrun inside ``salloc`` and ``sbatch``, an elastic job's preemption notice, a requeued job that
resumes from its checkpoint, and a job that reaches its time limit. docs/slurm.md lists the same commands.

The cluster starts once for this module. Every Slurm wait is bounded; the tests skip only where the Slurm and munge
commands are not installed (.ci/run installs them)."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import REPO, SHOALRUN
from slurm_cluster import SlurmCluster, missing_commands

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.xdist_group("slurm"),  # one worker runs them all, against the one cluster its module fixture starts
    pytest.mark.skipif(
        os.geteuid() != 0 or bool(missing_commands()),
        reason=f"a real Slurm needs root and the slurm-wlm and munge packages (missing: {missing_commands()})",
    ),
]

PYTHON_BIN = str(Path(sys.executable).parent)
ONE_NODE = ["-N1", "-n2", "--ntasks-per-node=2", "--cpus-per-task=1"]
"""sbatch flags that override the example scripts' allocation (2 nodes x 2 tasks x 4 cores) to fit this one node."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _env(slurm: SlurmCluster, **extra: str) -> dict[str, str]:
    """The cluster's environment with this interpreter's ``python`` first on the PATH (for batch scripts)."""
    env = slurm.env(**extra)
    env["PATH"] = os.pathsep.join([PYTHON_BIN, env.get("PATH", "")])
    return env


def _json_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        start = line.find("{")
        if start >= 0:
            try:
                lines.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                pass
    return lines


def _tagged_processes(tag: str) -> list[int]:
    """Pids of live processes whose environment holds ``SHOAL_TEST_TAG=<tag>``."""
    needle = f"SHOAL_TEST_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _no_process_left(tag: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tagged_processes(tag), f"processes of the job are still running: {_tagged_processes(tag)}"


@pytest.mark.timeout(120)
def test_srun_without_shoalrun_takes_slurm_step_environment_and_trains(slurm: SlurmCluster, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    env = _env(slurm, SHOAL_TEST_TAG=tag)
    ranks = slurm.command(
        ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, str(REPO / "tests/workers/slurm_rank.py")],
        timeout_s=60,
        env=env,
        cwd=tmp_path,
    )
    assert ranks.returncode == 0, ranks.stderr
    seen = sorted(_json_lines(ranks.stdout), key=lambda line: line["rank"])
    assert [(s["launcher"], s["rank"], s["size"], s["local_rank"], s["local_size"]) for s in seen] == [
        ("slurm", 0, 2, 0, 2),
        ("slurm", 1, 2, 1, 2),
    ]
    assert all(s["sum"] == 1.0 and s["slurm_step"] == "0" for s in seen)

    digits = slurm.command(
        ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, str(REPO / "examples/digits.py")],
        timeout_s=90,
        env=env,
        cwd=tmp_path,
    )
    assert digits.returncode == 0, digits.stderr[-2000:]
    (summary,) = [line for line in _json_lines(digits.stdout) if line.get("example") == "digits"]
    assert summary["world"] == 2 and summary["test_accuracy"] >= 0.95, summary
    _no_process_left(tag)


@pytest.mark.timeout(120)
def test_shoalrun_in_salloc_uses_the_allocation(slurm: SlurmCluster, tmp_path: Path) -> None:
    env = _env(slurm)
    worker = [sys.executable, str(REPO / "tests/workers/slurm_rank.py")]
    done = slurm.command(["salloc", "-n", "2", *SHOALRUN, "-np", "2", *worker], timeout_s=60, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = sorted(_json_lines(done.stdout), key=lambda line: line["rank"])
    assert [(s["launcher"], s["rank"], s["size"], s["local_size"], s["sum"]) for s in seen] == [
        ("shoalrun", 0, 2, 2, 1.0),
        ("shoalrun", 1, 2, 2, 1.0),
    ]

    too_many = slurm.command(["salloc", "-n", "2", *SHOALRUN, "-np", "3", *worker], timeout_s=60, env=env, cwd=tmp_path)
    assert too_many.returncode == 2
    assert "-np 3 is more than the 2 tasks of Slurm job" in too_many.stderr
    assert "allocation (localhost:2)" in too_many.stderr

    # A node of the allocation that is another machine: its worker starts as a one-task Slurm step (srun), not ssh.
    # No -np: the allocation's two tasks are the slots.
    remote = [sys.executable, str(REPO / "tests/workers/slurm_remote_job.py"), "--verbose", *worker]
    done = slurm.command(["salloc", "-n", "2", *remote], timeout_s=60, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("srun --overlap --nodes=1 --ntasks=1 --nodelist=localhost") == 2, done.stderr
    seen = sorted(_json_lines(done.stdout), key=lambda line: line["rank"])
    assert [(s["rank"], s["size"], s["sum"]) for s in seen] == [(0, 2, 1.0), (1, 2, 1.0)]
    assert sorted(s["slurm_step"] for s in seen) == ["0", "1"], "each worker is a Slurm step of its own"


@pytest.mark.timeout(120)
def test_shoalrun_in_sbatch_script(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(
        f"#!/bin/bash\n#SBATCH -n 2\nset -euo pipefail\nshoalrun -np 2 python {REPO / 'tests/workers/slurm_rank.py'}\n"
    )
    job = slurm.sbatch(["-o", str(tmp_path / "out"), str(script)], cwd=tmp_path, env=_env(slurm))
    fields = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout_s=60)
    output = (tmp_path / "out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output
    seen = sorted(_json_lines(output), key=lambda line: line["rank"])
    assert [(s["launcher"], s["rank"], s["size"], s["sum"], s["slurm_job"]) for s in seen] == [
        ("shoalrun", 0, 2, 1.0, job),
        ("shoalrun", 1, 2, 1.0, job),
    ]


def _wait_for(path: Path, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not in {path} after {timeout_s:.0f} s:\n{content[-3000:]}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["--batch", "--full"], ids=["shoalrun", "every-process"])
def test_elastic_job_leaves_at_a_commit_on_usr1(slurm: SlurmCluster, tmp_path: Path, who: str) -> None:
    """``scancel --batch --signal=USR1`` reaches shoalrun alone (as ``sbatch --signal=B:USR1@60`` does): it gives the
    whole job notice. ``--full`` reaches every process: each worker's own notice, and shoalrun's."""
    out = tmp_path / "out"
    job = slurm.sbatch(
        [*ONE_NODE, "-o", str(out), "examples/slurm/elastic.sbatch", "--epochs", "200", "--step-delay", "0.01"],
        cwd=REPO,  # the script runs from the repository root, as docs/slurm.md says
        env=_env(slurm),
    )
    _wait_for(out, "<stdout>:step 20 ", timeout_s=60)
    signalled = slurm.command(["scancel", who, "--signal=USR1", job])
    assert signalled.returncode == 0, signalled.stderr
    fields = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout_s=60)
    output = out.read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
    assert "shoalrun: every worker left at a commit after SIGUSR1" in output
    left = [line for line in _json_lines(output) if line.get("left")]
    assert len(left) == 2, output[-3000:]
    assert all(line["restores"] == 0 and line["executed_steps"] == line["committed_steps"] for line in left), left
    assert left[0]["committed_steps"] == left[1]["committed_steps"] >= 20, left
    assert '"test_accuracy"' not in output  # it left before training ended


def _checkpointed_job(slurm: SlurmCluster, tmp_path: Path, sbatch: list[str], steps: int) -> str:
    return slurm.sbatch(
        [
            *ONE_NODE,
            "-o",
            str(tmp_path / "out"),
            *sbatch,
            str(REPO / "examples/slurm/checkpointed.sbatch"),
            "--steps",
            str(steps),
            "--step-delay",
            "0.02",
            "--journal",
            str(tmp_path / "journal"),
        ],
        cwd=REPO,  # the script runs from the repository root, as docs/slurm.md says
        env=_env(slurm, CHECKPOINT_DIR=str(tmp_path / "checkpoints")),
    )


@pytest.mark.timeout(150)
def test_requeued_job_resumes_from_its_checkpoint(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``scontrol requeue`` while it trains: the ranks stop at one step on SIGTERM, rank 0 saves, and the requeued
    job goes on from the next step. Each step is in the journal once, and the weights equal one process's that trained
    on the same global batches without a stop (to 1e-5)."""
    steps = 300
    job = _checkpointed_job(slurm, tmp_path, [], steps)
    journal = tmp_path / "journal"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not journal.exists() or len(journal.read_text().splitlines()) < 40):
        time.sleep(0.2)
    requeued = slurm.command(["scontrol", "requeue", job])
    assert requeued.returncode == 0, requeued.stderr
    # Slurm holds a requeued job for about two minutes (its begin time); once it is pending again, release it now.
    slurm.wait_job(job, {"PENDING"}, timeout_s=30)
    released = slurm.command(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    assert released.returncode == 0, released.stderr
    fields = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout_s=90)
    output = (tmp_path / "out").read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), output[-3000:]

    first, second = [line for line in _json_lines(output) if line.get("example") == "checkpointed"]
    assert (first["restart"], first["start_step"], first["stopped_by"]) == (0, 0, "SIGTERM"), first
    assert (second["restart"], second["start_step"], second["end_step"]) == (1, first["end_step"], steps), second
    assert 0 < first["end_step"] < steps
    entries = [line.split() for line in journal.read_text().splitlines()]
    assert [int(step) for step, _ in entries] == list(range(steps)), "each step committed exactly once"
    assert {restart for step, restart in entries if int(step) < first["end_step"]} == {"0"}
    assert {restart for step, restart in entries if int(step) >= first["end_step"]} == {"1"}

    reference = tmp_path / "reference.pt"
    example = [sys.executable, str(REPO / "examples/slurm/checkpointed.py")]
    alone = slurm.command(
        [*example, "--steps", str(steps), "--batch-size", "32", "--checkpoint", str(reference)],
        timeout_s=60,
        env={k: v for k, v in slurm.env().items() if k != "SLURM_CONF"},
    )
    assert alone.returncode == 0, alone.stderr
    resumed = torch.load(tmp_path / "checkpoints" / f"checkpointed-{job}.pt")["model"]
    uninterrupted = torch.load(reference)["model"]
    for name, value in uninterrupted.items():
        assert torch.allclose(resumed[name], value, atol=1e-5, rtol=0), name


@pytest.mark.timeout(150)
def test_time_limit_notice_saves_and_exits_zero(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``--time=1 --signal=USR1@25``: SIGUSR1 comes 25 s (Slurm checks every 30 s, so 5 to 35 s after the start)
    before the limit; the job saves its checkpoint and ends COMPLETED with exit code 0, well inside its minute."""
    job = _checkpointed_job(slurm, tmp_path, ["--time=1", "--signal=USR1@25"], 1_000_000)
    fields = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout_s=100)
    output = (tmp_path / "out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
    (summary,) = [line for line in _json_lines(output) if line.get("example") == "checkpointed"]
    assert summary["stopped_by"] == "SIGUSR1" and summary["end_step"] > 0, summary
    saved = torch.load(tmp_path / "checkpoints" / f"checkpointed-{job}.pt")
    assert saved["step"] == summary["end_step"]
    journal = tmp_path / "journal"
    assert len(journal.read_text().splitlines()) == summary["end_step"]
