"""shoalrun end to end: env, output prefixing, exit codes, kill-on-failure, signals, bad flags."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import SHOALRUN, process_alive

pytestmark = pytest.mark.check  # the quick tier: make check


def shoalrun(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(SHOALRUN + args, env=env, capture_output=True, text=True, timeout=timeout)


def wait_for_pid_files(directory: Path, count: int, timeout_s: float) -> list[int]:
    """The pids that ``count`` workers wrote to ``directory/pids.<rank>`` (each: own pid and a child's)."""
    deadline = time.monotonic() + timeout_s
    while len(list(directory.glob("pids.*"))) < count or any(p.stat().st_size == 0 for p in directory.glob("pids.*")):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)
    return [int(pid) for path in directory.glob("pids.*") for pid in path.read_text().split()]


def survivors(pids: list[int], within_s: float) -> list[int]:
    """The pids still alive after waiting up to ``within_s`` for all of them to end."""
    deadline = time.monotonic() + within_s
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if process_alive(pid)]


def test_issue_example_prints_prefixed_rank_and_size(worker_env: dict[str, str]) -> None:
    code = "import shoal.torch as hvd; hvd.init(); print(hvd.rank(), hvd.size())"
    result = shoalrun(["-np", "2", sys.executable, "-c", code], worker_env)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:0 2", "[1]<stdout>:1 2"]


def test_workers_get_rank_topology_rendezvous_secret_and_knobs(worker_env: dict[str, str], tmp_path: Path) -> None:
    names = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"]
    code = textwrap.dedent(
        f"""
        import os, json
        names = {names!r}
        keys = ["SHOAL_" + n for n in names] + ["HOROVOD_" + n for n in names]
        keys += ["SHOAL_RENDEZVOUS_ADDR", "SHOAL_RENDEZVOUS_PORT", "SHOAL_SECRET", "SHOAL_FUSION_THRESHOLD",
                 "SHOAL_CYCLE_TIME", "SHOAL_CACHE_CAPACITY", "SHOAL_TIMELINE", "SHOAL_LOG_LEVEL"]
        print(json.dumps({{k: os.environ.get(k) for k in keys}}))
        """
    )
    args = ["-np", "3", "-H", "localhost:3", "--fusion-threshold-mb", "2", "--cycle-time-ms", "1.5"]
    args += ["--cache-capacity", "16", "--timeline-filename", "tl.json", "--log-level", "DEBUG"]
    result = shoalrun([*args, sys.executable, "-c", code], worker_env)
    assert result.returncode == 0, result.stderr
    import json

    envs = {}
    for line in result.stdout.splitlines():
        prefix, _, payload = line.partition(":")
        envs[int(prefix[1 : prefix.index("]")])] = json.loads(payload)
    assert sorted(envs) == [0, 1, 2]
    secrets = {e["SHOAL_SECRET"] for e in envs.values()}
    assert len(secrets) == 1 and len(secrets.pop() or "") >= 32
    for rank, env in envs.items():
        for prefix in ("SHOAL_", "HOROVOD_"):
            assert env[prefix + "RANK"] == str(rank) and env[prefix + "SIZE"] == "3"
            assert env[prefix + "LOCAL_RANK"] == str(rank) and env[prefix + "LOCAL_SIZE"] == "3"
            assert env[prefix + "CROSS_RANK"] == "0" and env[prefix + "CROSS_SIZE"] == "1"
        assert env["SHOAL_RENDEZVOUS_ADDR"] == "127.0.0.1" and int(env["SHOAL_RENDEZVOUS_PORT"]) > 0
        assert env["SHOAL_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
        assert env["SHOAL_CYCLE_TIME"] == "1.5" and env["SHOAL_CACHE_CAPACITY"] == "16"
        assert env["SHOAL_TIMELINE"] == os.path.abspath("tl.json") and env["SHOAL_LOG_LEVEL"] == "debug"


def test_stdout_and_stderr_are_prefixed_and_logged_per_rank(worker_env: dict[str, str], tmp_path: Path) -> None:
    code = "import sys, os; r = os.environ['SHOAL_RANK']; print('out', r); print('err', r, file=sys.stderr)"
    logs = tmp_path / "logs"
    result = shoalrun(["-np", "2", "--output-filename", str(logs), sys.executable, "-c", code], worker_env)
    assert result.returncode == 0
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:out 0", "[1]<stdout>:out 1"]
    workers = sorted(line for line in result.stderr.splitlines() if line.startswith("["))
    assert workers == ["[0]<stderr>:err 0", "[1]<stderr>:err 1"]
    assert (logs / "rank.1" / "stdout").read_text() == "out 1\n"
    assert (logs / "rank.0" / "stderr").read_text() == "err 0\n"


def test_failed_worker_ends_the_job_with_its_code_and_names_it(worker_env: dict[str, str]) -> None:
    code = "import os, sys, time\nif os.environ['SHOAL_RANK'] == '1': sys.exit(3)\ntime.sleep(120)"
    start = time.monotonic()
    result = shoalrun(["-np", "3", sys.executable, "-c", code], worker_env)
    elapsed = time.monotonic() - start
    assert result.returncode == 3
    assert "rank 1 on host localhost exited with code 3" in result.stderr
    assert elapsed < 10, f"the other workers were not terminated promptly ({elapsed:.1f} s)"


def test_worker_killed_by_a_signal(worker_env: dict[str, str]) -> None:
    code = "import os, signal, time\nif os.environ['SHOAL_RANK'] == '0': os.kill(os.getpid(), 9)\ntime.sleep(120)"
    result = shoalrun(["-np", "2", sys.executable, "-c", code], worker_env)
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 0 on host localhost was killed by signal SIGKILL" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_shoalrun_ends_the_whole_tree(worker_env: dict[str, str], tmp_path: Path, sig: int) -> None:
    # Each worker starts a grandchild that ignores nothing and would outlive a careless launcher.
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen(["sleep", "300"])
        with open(os.path.join({str(tmp_path)!r}, "pids." + os.environ["SHOAL_RANK"]), "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        print("ready", flush=True)
        time.sleep(300)
        """
    )
    process = subprocess.Popen(
        [*SHOALRUN, "-np", "2", sys.executable, "-c", code],
        env=worker_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pids = wait_for_pid_files(tmp_path, 2, timeout_s=30)
    assert all(process_alive(pid) for pid in pids)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=15)
    assert process.returncode == 128 + sig
    assert f"received {signal.Signals(sig).name}" in stderr.decode()
    assert not survivors(pids, within_s=5), "orphan processes survived shoalrun"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "3", "-H", "localhost:2", "true"], "larger than the 2 slots"),
        (["-np", "2", "-H", "a:x", "true"], "must be an integer"),
        (["-np", "2"], "no command given"),
        (["true"], "-np is required"),
        (["-np", "2", "--no-such-flag", "true"], "unrecognized arguments"),
        (["-np", "two", "true"], "invalid int value"),
        (["-np", "1", "--hostfile", "/nonexistent/hosts", "true"], "cannot read hostfile"),
        (["-np", "0", "true"], "-np must be >= 1"),
        (["-np", "2", "--mpi", "true"], "--mpi: Shoal has no MPI controller"),
        (["--nproc-per-node", "2", "true"], "--nproc-per-node: torchrun's; use -np N"),
        (["-np", "1", "-H", "localhost", "--slots-per-host", "0", "true"], "--slots-per-host must be >= 1"),
        (["-np", "2", "--ranks-filter", "0,x", "true"], "--ranks-filter: cannot read 'x'"),
        (["-np", "1", "-x", "1BAD=2", "true"], "-x/--env: '1BAD' is not an environment variable name"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(worker_env: dict[str, str], args: list[str], message: str) -> None:
    result = shoalrun(args, worker_env, timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shoalrun: error:") and message in lines[0], result.stderr


def test_python_dash_m_runner_and_version(worker_env: dict[str, str]) -> None:
    result = shoalrun(["--version"], worker_env)
    assert result.returncode == 0 and result.stdout.startswith("shoalrun ")
    build = shoalrun(["--check-build"], worker_env)
    assert build.returncode == 0 and "torch 2." in build.stdout and "gloo: yes" in build.stdout
    assert "launcher: none (a single process)" in build.stdout and "optional tensorflow:" in build.stdout


def test_sigkill_of_shoalrun_still_leaves_no_orphans(worker_env: dict[str, str], tmp_path: Path) -> None:
    # shoalrun cannot catch SIGKILL; each initialized worker notices its launcher is gone and ends its own group.
    code = textwrap.dedent(
        f"""
        import os, subprocess, time
        import shoal.torch as hvd
        hvd.init()
        child = subprocess.Popen(["sleep", "300"])
        with open(os.path.join({str(tmp_path)!r}, "pids." + os.environ["SHOAL_RANK"]), "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(300)
        """
    )
    process = subprocess.Popen(
        [*SHOALRUN, "-np", "2", sys.executable, "-c", code],
        env=worker_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids = wait_for_pid_files(tmp_path, 2, timeout_s=60)
    process.kill()
    process.wait(timeout=10)
    assert not survivors(pids, within_s=10), "workers outlived a SIGKILLed shoalrun"


def test_horovodrun_flag_meanings(tmp_path: Path) -> None:
    from shoal.runner.cli import parse_args
    from shoal.runner.launcher import build_slots

    args = parse_args(
        [
            "--slots-per-host",
            "2",
            "-H",
            "localhost",
            "--log-level",
            "debug",
            "--disable-cache",
            "--no-hierarchical-allreduce",
            "--gloo-timeout-seconds",
            "900",
            "--min-num-proc",
            "2",
            "--network-interfaces",
            "lo",
            "true",
        ]
    )
    assert len(build_slots(args)) == 2 and args.min_np == 2 and args.network_interface == "lo"
    env = args.worker_env()
    assert env["SHOAL_LOG_LEVEL"] == "debug" and env["SHOAL_HIERARCHICAL_ALLREDUCE"] == "0"
    assert env["SHOAL_COLLECTIVE_TIMEOUT_SECONDS"] == "900.0"
    assert "SHOAL_CACHE_CAPACITY" not in env  # horovodrun's --disable-cache is about its own check cache


def test_prefix_output_with_timestamp(worker_env: dict[str, str]) -> None:
    result = shoalrun(["-np", "1", "--prefix-output-with-timestamp", sys.executable, "-c", "print('hi')"], worker_env)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4}\[0\]<stdout>:hi", result.stdout.strip()), result.stdout


def test_config_file_sets_knobs_and_flags_win(tmp_path: Path) -> None:
    from shoal.runner.cli import parse_args

    config = tmp_path / "horovod.yaml"
    config.write_text(
        textwrap.dedent("""
        params: {fusion_threshold_mb: 32, cycle_time_ms: 2, cache_capacity: 512, hierarchical_allreduce: false}
        timeline: {filename: tl.json, mark_cycles: true}
        stall_check: {enabled: true, warning_time_seconds: 30, shutdown_time_seconds: 0}
        library_options: {gloo_timeout_seconds: 900, num_nccl_streams: 1}
        logging: {level: info}
        autotune: {enabled: false, log_file: x.csv}
    """)
    )
    env = parse_args(["--config-file", str(config), "--cycle-time-ms", "5", "-np", "1", "true"]).worker_env()
    assert env["SHOAL_FUSION_THRESHOLD"] == str(32 * 1024 * 1024) and env["SHOAL_CYCLE_TIME"] == "5.0"  # flag wins
    assert env["SHOAL_CACHE_CAPACITY"] == "512" and env["SHOAL_HIERARCHICAL_ALLREDUCE"] == "0"
    assert env["SHOAL_TIMELINE_MARK_CYCLES"] == "1" and env["SHOAL_STALL_CHECK_TIME_SECONDS"] == "30.0"
    assert env["SHOAL_COLLECTIVE_TIMEOUT_SECONDS"] == "900.0" and env["SHOAL_LOG_LEVEL"] == "info"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("params: {fusion_threshold: 32}", "unknown key params.fusion_threshold"),
        ("parms: {}", "unknown config file section 'parms'"),
        ("params: {torus_allreduce: true}", "params.torus_allreduce is not supported"),
        ("controller: mpi", "controller 'mpi' is not supported"),
        ("params: {cycle_time_ms: fast}", "params.cycle_time_ms: bad value 'fast'"),
        ("[unclosed", "is not valid YAML"),
    ],
)
def test_config_file_errors_are_one_line(worker_env: dict[str, str], tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text + "\n")
    result = shoalrun(["--config-file", str(config), "-np", "1", "true"], worker_env, timeout=30)
    assert result.returncode == 2 and message in result.stderr, result.stderr


TQDM_WORKER = """
import os, sys, time
from tqdm import tqdm
for _ in tqdm(range(4), file=sys.stderr, mininterval=0, disable=os.environ["SHOAL_RANK"] != "0"):
    time.sleep(0.4)
time.sleep(2)  # the bar has finished drawing; the worker lives on
print("threads", os.environ.get("OMP_NUM_THREADS"), flush=True)
"""


def test_a_progress_bar_moves_before_the_worker_exits(worker_env: dict[str, str]) -> None:
    """tqdm redraws with \\r: each redraw must reach shoalrun's output while the worker still runs."""
    worker_env.pop("OMP_NUM_THREADS", None)
    process = subprocess.Popen(
        [*SHOALRUN, "-np", "2", sys.executable, "-c", TQDM_WORKER],
        env=worker_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    seen = b""
    deadline = time.monotonic() + 60
    while b"2/4" not in seen and time.monotonic() < deadline:
        seen += os.read(process.stderr.fileno(), 4096)
    finished_when_seen = b"4/4" in seen
    out, err = process.communicate(timeout=60)
    assert b"[0]<stderr>:" in seen and b"2/4" in seen and b"\r" in seen, seen
    assert not finished_when_seen  # the redraw arrived while the bar was still running, not with its last line
    cores = os.cpu_count() or 1
    assert sorted(out.decode().splitlines()) == [f"[{r}]<stdout>:threads {max(1, cores // 2)}" for r in range(2)]
    assert (seen + err).count(b"shoalrun: OMP_NUM_THREADS=") == 1


def test_an_elastic_job_gives_each_local_worker_its_share_of_the_cores(worker_env: dict[str, str]) -> None:
    """Elastic jobs list each host once until workers start; the share must still count the host's slots (it once
    gave every one of three workers all the cores)."""
    worker_env.pop("OMP_NUM_THREADS", None)
    code = "import os; print('threads', os.environ['OMP_NUM_THREADS'])"
    result = shoalrun(["-np", "3", "--min-np", "2", sys.executable, "-c", code], worker_env, timeout=60)
    assert result.returncode == 0, result.stderr
    share = max(1, (os.cpu_count() or 1) // 3)
    assert sorted(result.stdout.splitlines()) == [f"[{r}]<stdout>:threads {share}" for r in range(3)], result.stdout
    assert f"OMP_NUM_THREADS={share} for each local worker ({os.cpu_count()} cores / 3 workers)" in result.stderr


def test_an_elastic_job_of_workers_that_exit_before_the_last_is_started_finishes(tmp_path: Path) -> None:
    """Workers that exit 0 while the others are still being spawned (a short script on a busy machine) belong to the
    first round all the same, and the others run to their end: the job finishes with exit 0 (it once said "every
    worker has exited and none finished" and exited 1, because the round was published with the workers still alive;
    and a finished worker once ended the others of a script that never rendezvoused)."""
    from shoal.runner.cli import parse_args
    from shoal.runner.elastic_driver import ElasticSupervisor, elastic_hosts
    from shoal.runner.spawners import ProcessSpawner, Worker, WorkerSpec

    class SlowSpawner(ProcessSpawner):
        def spawn(self, spec: WorkerSpec) -> Worker:
            worker = ProcessSpawner.spawn(self, spec)
            worker.process.wait(timeout=30)  # this worker has exited before the next one starts
            return worker

    script = f"import os, time; time.sleep(0.5); open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()"
    config = parse_args(["-np", "3", "--min-np", "2", sys.executable, "-c", script])
    assert ElasticSupervisor(config, elastic_hosts(config)).job_of(spawner=SlowSpawner()).run() == 0
    assert len(list(tmp_path.iterdir())) == 3  # every worker ran to its end


def test_ranks_filter_and_zero_padded_logs(worker_env: dict[str, str], tmp_path: Path) -> None:
    code = "import os; print('hello from', os.environ['SHOAL_RANK'])"
    logs = tmp_path / "logs"
    result = shoalrun(
        ["-np", "11", "--ranks-filter", "0,9-10", "--output-filename", str(logs), sys.executable, "-c", code],
        worker_env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{r}]<stdout>:hello from {r}" for r in (0, 10, 9)]
    assert sorted(p.name for p in logs.iterdir()) == [f"rank.{r:02d}" for r in range(11)]  # horovodrun's padding
    assert (logs / "rank.05" / "stdout").read_text() == "hello from 5\n"  # filtered out of the console, still logged


@pytest.mark.parametrize(
    ("argv", "command", "num_proc"),
    [
        (["-np", "2", "python", "train.py", "--log", "x", "-np", "3"], ["python", "train.py", "--log", "x", "-np", "3"], 2),
        (["--num-p", "2", "python", "t.py", "--verbose"], ["python", "t.py", "--verbose"], 2),
        (["-np", "2", "--", "python", "t.py", "--start-timeout", "5"], ["python", "t.py", "--start-timeout", "5"], 2),
        (["-np=2", "--min-np", "1", "--blacklist-cooldown-range", "1", "2", "python", "-u"], ["python", "-u"], 2),
    ],
)
def test_the_command_s_own_flags_stay_the_command_s(argv: list[str], command: list[str], num_proc: int) -> None:
    """Everything from the first word that is not a shoalrun flag (or its value) is the command's, even where
    argparse would have read ``--log`` as an abbreviation of shoalrun's ``--log-level``."""
    from shoal.runner.cli import parse_args

    config = parse_args(argv)
    assert config.command == command and config.num_proc == num_proc
