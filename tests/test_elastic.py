"""Elastic training end to end: workers killed with SIGKILL, a slot added by discovery, --min-np, --reset-limit.

Every job runs ``examples/elastic_digits.py`` under a real ``shoalrun`` with elastic flags. Output is read while the
job runs, so a worker can be killed mid-epoch at a known step.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, SHOALRUN, clean_env, process_alive

EXAMPLE = [sys.executable, str(REPO / "examples" / "elastic_digits.py")]


class RunningJob:
    """A shoalrun job whose merged output is collected line by line in the background."""

    def __init__(
        self, flags: list[str], example_args: list[str], command: list[str] = EXAMPLE, env: dict[str, str] | None = None
    ) -> None:
        self.process = subprocess.Popen(
            [*SHOALRUN, *flags, *command, *example_args],
            env={**clean_env(), **(env or {})},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first output line matching ``pattern``; fails the test after ``timeout_s``."""
        return self.wait_for_line(pattern, timeout_s)[1]

    def wait_for_line(self, pattern: str, timeout_s: float, after: int = -1) -> tuple[int, re.Match[str]]:
        """The index and match of the first output line after line ``after`` that matches ``pattern`` (a later state
        of the job, where an earlier line would also match); fails the test after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            for index, line in enumerate(self.lines[after + 1 :], after + 1):
                match = regex.search(line)
                if match:
                    return index, match
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-40:]))

    def worker_pids(self, count: int) -> dict[int, int]:
        """Initial rank -> pid, from each worker's start line."""
        for rank in range(count):
            self.wait_for(rf"^\[{rank}\]<stdout>:worker pid \d+", 60)
        pids = {}
        for line in self.lines:
            match = re.match(r"^\[(\d+)\]<stdout>:worker pid (\d+)", line)
            if match:
                pids[int(match.group(1))] = int(match.group(2))
        return pids

    def finish(self, timeout_s: float) -> int:
        """Wait for shoalrun to exit; returns its code (kills the job and fails the test on timeout)."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("shoalrun did not finish; output:\n" + "\n".join(self.lines[-40:])) from None
        self._reader.join(timeout=10)
        return code

    def summary(self) -> dict[str, object]:
        """The example's final JSON line."""
        for line in reversed(self.lines):
            if '"example": "elastic_digits"' in line:
                return json.loads(line.split(":", 1)[1] if line.startswith("[") else line)  # type: ignore[no-any-return]
        raise AssertionError("no summary line; output:\n" + "\n".join(self.lines[-40:]))

    def kill(self) -> None:
        """End the whole job (shoalrun ends its workers on SIGTERM)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()


def gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(process_alive(p) for p in pids)


def discovery(tmp_path: Path, offer: str) -> tuple[Path, Path]:
    """A hosts file holding ``offer`` and a discovery script that prints it; rewrite the file to change the offer."""
    hosts = tmp_path / "hosts"
    hosts.write_text(offer + "\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return hosts, script


def check_every_sample_once(summary: dict[str, object], epochs: int) -> None:
    """Each epoch processed every training sample exactly once: nothing skipped, nothing applied twice."""
    log = summary["epochs"]
    assert isinstance(log, list) and [entry["epoch"] for entry in log] == list(range(epochs)), log
    for entry in log:
        assert entry["distinct"] == entry["recorded"] == summary["train_samples"], entry


@pytest.mark.timeout(240)
def test_sigkill_one_of_three_workers_finishes_with_two() -> None:
    job = RunningJob(["-np", "3", "--min-np", "2", "--reset-limit", "1"], ["--epochs", "5", "--log-every", "5"])
    pids = job.worker_pids(3)
    job.wait_for(r"^\[0\]<stdout>:step 35 ", 60)  # 30 steps per epoch at 3 workers: mid-way through epoch 1
    killed_at = time.time()
    subprocess.run(["kill", "-9", str(pids[2])], check=True)
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 2 and summary["resets"] == 1, summary
    check_every_sample_once(summary, 5)
    first_commit = float(job.wait_for(r"first commit after reset 1: step \d+ at ([\d.]+)", 1).group(1))
    recovery_s = first_commit - killed_at
    print(f"recovery: {recovery_s:.2f} s from SIGKILL to the next committed step")
    assert 0 < recovery_s < 30
    # Undisturbed, the same job reaches 0.98 (3 workers, 5 epochs); the examples' bar holds after the failure.
    assert float(summary["test_accuracy"]) >= 0.95, summary  # type: ignore[arg-type]
    assert gone(list(pids.values()), 10), "a worker outlived the job"


@pytest.mark.timeout(120)
def test_survivors_stop_waiting_for_a_failed_member_whose_connections_stay_open(tmp_path: Path) -> None:
    """A member exits 1 inside a step's collective while a process it left behind (outside shoalrun's reach, as on a
    hung remote host) keeps its gloo connections open: the driver marks the round broken, the survivors' heartbeat
    sees it and fails their pending collective, and they restore and finish within seconds, not at the transport's
    600 s timeout (before the mark, rank 0 waited as long as the stray process lived). A child the failed worker left
    in its own process group is ended with it."""
    child_pid_file, grouped_pid_file = tmp_path / "child.pid", tmp_path / "grouped.pid"
    worker = [
        sys.executable,
        str(REPO / "tests" / "workers" / "elastic_hung_peer.py"),
        str(child_pid_file),
        str(grouped_pid_file),
    ]
    flags = ["-np", "3", "--min-np", "2", "--max-np", "3", "-H", "localhost:3", "--no-hierarchical-allreduce"]
    started = time.monotonic()
    job = RunningJob(flags, [], command=worker)
    try:
        code = job.finish(90)
        took_s = time.monotonic() - started
        assert code == 0, "\n".join(job.lines[-30:])
        assert child_pid_file.exists(), "the failing rank never started its stray child"
        assert any("elastic round 1 lost worker" in line for line in job.lines), "\n".join(job.lines[-30:])
        results = [json.loads(line.split(":", 1)[1]) for line in job.lines if line.startswith("[") and '"restores"' in line]
        assert sorted(r["rank"] for r in results) == [0, 1], results
        assert all(r["size"] == 2 and r["step"] == 40 and r["restores"] == 1 for r in results), results
        assert all(r["caller_cycles"] == 0 for r in results), results  # no call waits inside a collective itself
        assert took_s < 60, f"the survivors took {took_s:.0f} s"
        # What the failed worker left in its own process group goes with it (the driver ends the group).
        assert gone([int(grouped_pid_file.read_text())], 10), "a failed worker's child outlived it"
    finally:
        for path in (child_pid_file, grouped_pid_file):
            if path.exists():
                subprocess.run(["kill", "-9", path.read_text()], check=False, capture_output=True)


@pytest.mark.timeout(240)
def test_a_failed_host_gets_a_worker_again_after_its_cooldown() -> None:
    """The same SIGKILL with --blacklist-cooldown-range 1 2: localhost waits 2 s (2 * 1 + U(0,1), kept within 2),
    then gets a new worker that joins at a commit, so the job ends with three workers; without the flag (the test
    above) it ends with two."""
    flags = ["-np", "3", "--min-np", "2", "--max-np", "3", "--blacklist-cooldown-range", "1", "2"]
    # --wait-for-world 3: the survivors wait at their first commit without the killed worker until its host's new
    # worker has joined, so training cannot end before it does, however fast the steps run
    job = RunningJob(flags, ["--epochs", "5", "--log-every", "5", "--wait-for-world", "3"])
    pids = job.worker_pids(3)
    job.wait_for(r"^\[0\]<stdout>:step 35 ", 60)
    subprocess.run(["kill", "-9", str(pids[2])], check=True)
    job.wait_for(r"host localhost gets no new workers for 2 s; re-forming the job", 30)
    assert job.finish(180) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 3 and summary["resets"] == 2, summary
    check_every_sample_once(summary, 5)
    assert float(summary["test_accuracy"]) >= 0.95, summary  # type: ignore[arg-type]
    assert gone(list(pids.values()), 10), "a worker outlived the job"


@pytest.mark.timeout(240)
def test_sigterm_to_one_of_three_workers_leaves_at_a_commit_with_nothing_rolled_back() -> None:
    """A preemption notice to rank 0, the hardest member to lose: it leaves at its next commit, the other two go on
    from that commit (no restore, no step run twice), rank 1 becomes rank 0, and the job ends with two."""
    job = RunningJob(["-np", "3", "--min-np", "2", "--reset-limit", "1"], ["--epochs", "5", "--log-every", "5"])
    pids = job.worker_pids(3)
    job.wait_for(r"^\[0\]<stdout>:step 35 ", 60)
    noticed_at = time.time()
    subprocess.run(["kill", "-TERM", str(pids[0])], check=True)
    job.wait_for(r"worker localhost#1 \(rank 0\) on host localhost got SIGTERM; it leaves at its next commit", 30)
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 2 and summary["resets"] == 1, summary
    # The new rank 0 trained from the start: it restored nothing, and ran each committed step exactly once.
    assert summary["restores"] == 0 and summary["executed_steps"] == summary["committed_steps"], summary
    check_every_sample_once(summary, 5)
    assert job.wait_for(r"^\[0\]<stderr>:.*left the job after a SIGTERM notice, at a commit", 1)
    assert not any("exited with code" in line or "was killed" in line for line in job.lines), job.lines[-30:]
    first_commit = float(job.wait_for(r"first commit after reset 1: step \d+ at ([\d.]+)", 1).group(1))
    print(f"graceful leave: {first_commit - noticed_at:.2f} s from SIGTERM to the others' next committed step")
    assert 0 < first_commit - noticed_at < 30
    assert float(summary["test_accuracy"]) >= 0.95, summary  # type: ignore[arg-type]
    assert gone(list(pids.values()), 10), "a worker outlived the job"


@pytest.mark.timeout(120)
def test_sigusr1_to_shoalrun_ends_the_whole_job_at_a_commit_with_exit_zero() -> None:
    """A notice to the whole job (SIGUSR1 to shoalrun: Slurm's ``--signal=B:USR1``): every worker leaves at its next
    commit, none restores or runs a step twice, and shoalrun exits 0. tests/test_slurm.py does it under a real Slurm."""
    job = RunningJob(["-np", "2", "--min-np", "1"], ["--epochs", "50", "--log-every", "5", "--step-delay", "0.01"])
    pids = job.worker_pids(2)
    job.wait_for(r"^\[0\]<stdout>:step 20 ", 60)
    job.process.send_signal(signal.SIGUSR1)
    assert job.finish(60) == 0, "\n".join(job.lines[-30:])
    assert job.wait_for(r"shoalrun: every worker left at a commit after SIGUSR1", 1)
    left = [json.loads(line.split(":", 1)[1]) for line in job.lines if '"left": true' in line]
    assert len(left) == 2, job.lines[-30:]
    assert all(entry["restores"] == 0 and entry["executed_steps"] == entry["committed_steps"] for entry in left), left
    assert left[0]["committed_steps"] == left[1]["committed_steps"] >= 20, left
    assert gone(list(pids.values()), 10), "a worker outlived the job"


@pytest.mark.timeout(240)
def test_a_notice_that_reaches_no_commit_within_its_grace_is_a_failure() -> None:
    """Commits only at epoch ends, 0.1 s per step and a 1 s grace period: the worker given notice reaches no commit
    in time, exits with 128 + SIGTERM, and the others restore their last commit, as after a crash."""
    flags = ["-np", "3", "--min-np", "2", "--reset-limit", "1", "--preemption-grace-seconds", "1"]
    job = RunningJob(flags, ["--epochs", "2", "--log-every", "2", "--commit-every", "100000", "--step-delay", "0.1"])
    pids = job.worker_pids(3)
    job.wait_for(r"^\[0\]<stdout>:step 6 ", 60)
    subprocess.run(["kill", "-TERM", str(pids[2])], check=True)
    job.wait_for(r"worker localhost#3 \(rank 2\) on host localhost exited with code 143: it reached no commit within", 30)
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 2 and summary["restores"] == 1, summary
    assert summary["executed_steps"] > summary["committed_steps"], summary  # the rolled-back steps were run again
    check_every_sample_once(summary, 2)
    assert job.wait_for(r"^\[2\]<stderr>:.*received SIGTERM 1 s ago and reached no commit since", 1)
    assert gone(list(pids.values()), 10), "a worker outlived the job"


@pytest.mark.timeout(120)
def test_sigterm_to_shoalrun_still_ends_an_elastic_job() -> None:
    """Workers take SIGTERM as a notice, but not when shoalrun itself is ending the job: they exit at once."""
    job = RunningJob(["-np", "2", "--min-np", "2"], ["--epochs", "50", "--log-every", "5"])
    pids = job.worker_pids(2)
    job.wait_for(r"^\[0\]<stdout>:step 10 ", 60)
    signalled = time.monotonic()
    job.process.terminate()
    assert job.finish(30) == 128 + signal.SIGTERM
    print(f"shoalrun ended the elastic job {time.monotonic() - signalled:.2f} s after its SIGTERM")
    assert job.wait_for(r"shoalrun: received SIGTERM; terminating all workers", 1)
    assert gone(list(pids.values()), 10), "a worker outlived the job"
    assert not any("leaving the job at the next commit" in line for line in job.lines), job.lines[-20:]


@pytest.mark.timeout(180)
def test_discovery_adds_a_worker_that_receives_rank_0_state(tmp_path: Path) -> None:
    hosts, script = discovery(tmp_path, "localhost:2")
    job = RunningJob(
        ["-np", "2", "--max-np", "3", "--host-discovery-script", str(script)],
        ["--epochs", "6", "--step-delay", "0.04", "--log-every", "5"],  # time for the newcomer on a loaded machine
    )
    job.worker_pids(2)
    job.wait_for(r"^\[0\]<stdout>:step 10 ", 60)
    hosts.write_text("localhost:3\n")
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 3 and summary["resets"] == 1, summary
    check_every_sample_once(summary, 6)
    synced = [re.search(r"synced at step (\d+) as rank (\d) of 3: weights checksum (\S+)", line) for line in job.lines]
    after_growth = [m for m in synced if m is not None]
    assert sorted(int(m.group(2)) for m in after_growth) == [0, 1, 2], job.lines[-30:]
    assert len({m.group(1) for m in after_growth}) == 1  # the same committed step everywhere
    assert len({m.group(3) for m in after_growth}) == 1  # the newcomer holds exactly rank 0's weights
    assert int(after_growth[0].group(1)) > 0


@pytest.mark.timeout(120)
def test_fewer_than_min_np_exits_non_zero_within_the_elastic_timeout() -> None:
    job = RunningJob(["-np", "2", "--min-np", "2", "--elastic-timeout", "3"], ["--step-delay", "0.05", "--log-every", "5"])
    pids = job.worker_pids(2)
    job.wait_for(r"^\[0\]<stdout>:step 10 ", 60)
    killed_at = time.monotonic()
    subprocess.run(["kill", "-9", str(pids[1])], check=True)
    code = job.finish(60)
    elapsed = time.monotonic() - killed_at
    assert code != 0
    assert elapsed < 3 + 10, elapsed
    job.wait_for(r"fewer than --min-np 2, and no host offered more slots within --elastic-timeout 3 s", 1)
    job.wait_for(r"still 1 worker\(s\), fewer than --min-np 2; [12] s left for hosts to offer more", 1)  # progress
    assert gone(list(pids.values()), 5), "a worker outlived the job"


@pytest.mark.timeout(120)
def test_reset_limit_is_respected() -> None:
    job = RunningJob(["-np", "3", "--min-np", "1", "--reset-limit", "0"], ["--step-delay", "0.05", "--log-every", "5"])
    pids = job.worker_pids(3)
    job.wait_for(r"^\[0\]<stdout>:step 10 ", 60)
    subprocess.run(["kill", "-9", str(pids[1])], check=True)
    assert job.finish(60) != 0
    job.wait_for(r"--reset-limit 0 is reached", 1)
    assert gone(list(pids.values()), 5), "a worker outlived the job"
    assert not any("re-forming the job with" in line for line in job.lines)


@pytest.mark.timeout(180)
def test_discovery_offering_fewer_slots_removes_a_worker_cleanly(tmp_path: Path) -> None:
    hosts, script = discovery(tmp_path, "localhost:3")
    job = RunningJob(
        ["-np", "3", "--host-discovery-script", str(script), "--min-np", "2"],
        ["--epochs", "4", "--step-delay", "0.02", "--log-every", "5"],
    )
    pids = job.worker_pids(3)
    job.wait_for(r"^\[0\]<stdout>:step 15 ", 60)
    hosts.write_text("localhost:2\n")
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 2 and summary["resets"] == 1, summary
    check_every_sample_once(summary, 4)
    assert any("a host offers fewer slots" in line for line in job.lines)
    assert gone(list(pids.values()), 5), "a worker outlived the job"


@pytest.mark.timeout(180)
def test_a_remote_worker_killed_over_ssh_excludes_its_host(loopback_sshd: tuple[int, Path]) -> None:
    port, key = loopback_sshd
    flags = [
        "-np",
        "3",
        "-H",
        "localhost:2,127.0.0.2:1",
        "-p",
        str(port),
        "-i",
        str(key),
        "--min-np",
        "2",
        "--start-timeout",
        "60",
        "--ssh-strict-host-key-checking",
        "no",
    ]
    job = RunningJob(flags, ["--epochs", "4", "--step-delay", "0.02", "--log-every", "5"])
    pids = job.worker_pids(3)  # rank 2 runs on 127.0.0.2, through ssh (the same machine, so its pid is visible)
    job.wait_for(r"^\[0\]<stdout>:step 15 ", 60)
    subprocess.run(["kill", "-9", str(pids[2])], check=True)
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 2 and summary["resets"] == 1, summary
    check_every_sample_once(summary, 4)
    job.wait_for(r"on host 127\.0\.0\.2 .*host 127\.0\.0\.2 gets no new workers", 1)
    assert gone(list(pids.values()), 10), "a worker outlived the job"


@pytest.mark.timeout(150)
def test_unnamed_collectives_barrier_and_sync_batch_norm_pair_up_after_a_reform(tmp_path: Path) -> None:
    """Survivors and a newcomer name unnamed requests alike after the re-form (the counters restart per init)."""
    hosts, script = discovery(tmp_path, "localhost:2")
    worker = [sys.executable, str(REPO / "tests" / "workers" / "elastic_unnamed.py")]
    # 120 steps of 0.05 s: time enough for the newcomer to start and join on a loaded machine before training ends.
    job = RunningJob(["-np", "2", "--max-np", "3", "--host-discovery-script", str(script)], ["--steps", "120"], worker)
    job.wait_for(r"step 5 world 2 rank 0 ok", 60)
    hosts.write_text("localhost:3\n")
    assert job.finish(120) == 0, "\n".join(job.lines[-30:])
    grown = [line for line in job.lines if re.search(r"step \d+ world 3 rank \d ok", line)]
    assert {re.search(r"rank (\d)", line).group(1) for line in grown} == {"0", "1", "2"}, job.lines[-30:]  # type: ignore[union-attr]
    assert sum("done world 3" in line for line in job.lines) == 3, job.lines[-30:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("loss", ["discovery", "sigkill", "sigkill, sharded"])
def test_a_balanced_job_that_shrinks_and_grows_keeps_one_process_weights(tmp_path: Path, loss: str) -> None:
    """BalancedLoader under elastic: the world goes 2 -> 1 -> 2, the global batch stays; the weights equal one process
    over the same global batches (atol 1e-5, float reassociation) and every sample of every epoch counts once.
    The worker leaves when discovery stops offering its slot, or is SIGKILLed (the survivor rolls back to its last
    commit) and comes back after its host's cooldown. Sharded (``shard="gradients"``), the optimizer state is
    re-sharded over each new world from the last commit: the killed worker's half of the momentum is not lost."""
    import numpy as np

    from workers import balanced_elastic as worker

    hosts, script = discovery(tmp_path, "localhost:2")
    hold = tmp_path / "hold"  # the survivor waits at world 1 until the returning worker has joined
    hold.touch()
    epochs = 12
    flags = ["-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(script)]
    job = RunningJob(
        [*flags, "--blacklist-cooldown-range", "1", "2"] if loss.startswith("sigkill") else flags,
        ["--epochs", str(epochs), "--step-delay", "0.1", "--hold-file", str(hold)]
        + (["--shard", "gradients"] if "sharded" in loss else []),
        [sys.executable, str(REPO / "tests" / "workers" / "balanced_elastic.py")],
    )
    pid = int(job.wait_for(r"^\[1\]<stdout>:worker pid (\d+)", 60).group(1))
    job.wait_for(r"^\[0\]<stdout>:step 8 world 2", 90)
    if loss.startswith("sigkill"):
        subprocess.run(["kill", "-9", str(pid)], check=True)
    else:
        hosts.write_text("localhost:1\n")
    shrunk, _ = job.wait_for_line(r"^\[0\]<stdout>:step \d+ world 1", 60)
    hosts.write_text("localhost:2\n")
    job.wait_for_line(r"^\[0\]<stdout>:step \d+ world 2", 60, after=shrunk)
    hold.unlink()
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    result = None
    for line in reversed(job.lines):
        if line.startswith("[0]<stdout>:{"):
            result = json.loads(line.split(":", 1)[1])
            break
    assert result is not None, "\n".join(job.lines[-30:])
    log = result["log"]
    assert (result["restores"] > 0) == loss.startswith("sigkill"), result["restores"]  # a kill rolls back, a removal does not
    worlds = [entry[2] for entry in log]
    assert 1 in worlds and worlds[0] == 2 and worlds[-1] == 2, worlds
    steps = [(entry[0], entry[1]) for entry in log]
    assert steps == [(e, s) for e in range(epochs) for s in range(4)], steps  # each step committed once, in order
    for epoch in range(epochs):
        processed = [i for entry in log if entry[0] == epoch for i in entry[3]]
        assert sorted(processed) == list(range(worker.SAMPLES)), f"epoch {epoch}: a sample was lost or repeated"
    expected = worker.reference_weights(epochs)
    for name, value in expected.items():
        np.testing.assert_allclose(np.array(result["weights"][name]), np.array(value), atol=1e-5, err_msg=name)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("loss", ["discovery", "sigkill"])
def test_local_steps_keep_their_outer_state_through_a_host_leaving_and_one_joining(tmp_path: Path, loss: str) -> None:
    """Local steps (the hosts meet every 4 steps) on two hosts of one worker each, in a job that goes 2 -> 1 -> 2
    hosts: discovery stops offering one host and offers it again, or its worker is SIGKILLed (the survivor rolls back
    to its last commit, the exchange in flight forgotten) and its host comes back after the cooldown. The host that
    leaves takes its inner steps since the last outer update with it: they are counted and reported. The joiner
    receives the survivor's weights and outer state (the round's start, the outer momentum), and every sample of every
    epoch counts once."""
    hosts, script = discovery(tmp_path, "localhost:1\n127.0.0.1:1")
    flags = ["-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(script)]
    if loss == "sigkill":
        flags += ["--blacklist-cooldown-range", "1", "2"]
    example = ["--epochs", "3", "--local-every", "4", "--step-delay", "0.02", "--log-every", "5", "--wait-for-world", "2"]
    job = RunningJob(flags, example)
    pid = job.worker_pids(2)[1]
    job.wait_for(r"^\[0\]<stdout>:step 15 .*world 2", 90)  # three outer rounds in
    if loss == "sigkill":
        subprocess.run(["kill", "-9", str(pid)], check=True)
    else:
        hosts.write_text("localhost:1\n")  # the host 127.0.0.1, rank 1, leaves at the next commit
    shrunk, _ = job.wait_for_line(r"^\[0\]<stdout>:reset 1: now rank 0 of 1", 60)
    hosts.write_text("localhost:1\n127.0.0.1:1\n")  # and comes back
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 2 and summary["resets"] == 2, summary
    assert (summary["restores"] > 0) == (loss == "sigkill"), summary  # type: ignore[operator]
    check_every_sample_once(summary, 3)
    warned = job.wait_for(r"local steps: 1 host\(s\) left the job with (\d+) inner steps each", 1)
    each = int(warned.group(1))
    assert 1 <= each <= 2 * 4 and summary["lost_inner_steps"] == each, (each, summary)  # a round, and one in flight
    print(f"{loss}: {each} inner steps lost; test accuracy {summary['test_accuracy']}; restores {summary['restores']}")
    synced: dict[str, dict[str, str]] = {}
    for line in job.lines[shrunk:]:
        weights = re.search(r"synced at step \d+ as rank (\d) of 2: weights checksum (\S+)", line)
        outer = re.search(r"outer state as rank (\d) of 2: (.*)", line)
        for match, key in ((weights, "weights"), (outer, "outer")):
            if match:
                synced.setdefault(match.group(1), {}).setdefault(key, match.group(2))
    assert set(synced) == {"0", "1"} and synced["0"] == synced["1"], synced  # the joiner equals the survivor
    assert "momentum []" not in synced["0"]["outer"], synced  # the outer optimizer had stepped: momentum went over
