"""Shared test helpers: how to call shoalrun, and how to tell whether a process is still alive."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shoal.config import env_name
from shoal.testing import free_port

REPO = Path(__file__).resolve().parent.parent
SHOALRUN = [sys.executable, "-m", "shoal.runner"]
needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2 (.ci/run installs iproute2)",
)
"""For tests that emulate hosts with ``shoal.bench.netns``."""

_TF_THREADS = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
"""TensorFlow's own thread pools, which OMP_NUM_THREADS does not size, at one thread each in every test process, as
torch's are: two tests run at once on two cores, and idle pool threads spin on them (test_tensorflow and test_keras
took 169 s with TensorFlow's default pools, 146 s with these)."""
_TENSORFLOW_TESTS = {"test_tensorflow.py", "test_keras.py", "test_keras2.py", "test_tf_extras.py", "test_conformance.py"}


LONGEST_FIRST = (
    "test_network_faults.py",
    "test_churn.py",
    "test_slurm.py",
    "test_spark.py",
    "test_spark_estimator.py",
    "test_spark_elastic.py",
    "test_ray.py",
    "test_ray_elastic.py",
    "test_examples.py",
    "test_elastic.py",
    "test_tensorflow.py",
    "test_keras.py",
    "test_reliability.py",
)
"""Modules whose tests take longest, in the order ``make test``'s two workers should start them: the longest jobs
first, so that the run does not end on one worker finishing a long test while the other has nothing left."""


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected: ``make test``'s run of the "alone" tests needs none
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the tests of ``LONGEST_FIRST`` ahead of the rest (a stable sort: the same order on every xdist worker).
    When TensorFlow tests will run, import TensorFlow once in the forkserver the ranks are forked from, instead of
    in every rank (five seconds of CPU each)."""
    import importlib.util

    from shoal.testing import preload

    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if importlib.util.find_spec("tensorflow") and any(item.path.name in _TENSORFLOW_TESTS for item in items):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        for name, value in _TF_THREADS.items():  # ranks forked from the preloaded server, and in-process tests
            os.environ.setdefault(name, value)
        preload("tensorflow")


@pytest.fixture(autouse=True)
def _alone_or_together(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist (``make test`` runs two workers), a test marked ``alone`` runs while no other test does:
    every test holds a shared lock, an ``alone`` one the exclusive lock. A gate in front stops new tests from starting
    while an ``alone`` test waits for the running ones to finish."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one test at a time anyway
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    base = os.path.join(tempfile.gettempdir(), f"shoal-tests-{run}")
    _one_worker_per_group(request, base)
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


def _one_worker_per_group(request: pytest.FixtureRequest, base: str) -> None:
    """Fail a test of an ``xdist_group`` that a second worker runs: the group shares one cluster, JVM or Slurm per
    worker, and two at once start twice and can collide on ports. ``--dist loadgroup`` groups by a suffix it writes
    into each test's id, which pytest 9.2's structured ids silently drop (pytest-dev/pytest-xdist#1386): hence the
    pin on pytest in pyproject.toml, and this check that makes the next such change loud."""
    mark = request.node.get_closest_marker("xdist_group")
    if mark is None or not getattr(request.config.option, "loadgroup", False):
        return
    name, worker = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")), os.environ["PYTEST_XDIST_WORKER"]
    with open(f"{base}.group-{name}", "a+") as record:
        fcntl.flock(record, fcntl.LOCK_EX)
        record.seek(0)
        first = record.read().strip()
        if not first:
            record.write(worker)
    if first and first != worker:
        pytest.fail(f"xdist_group {name!r} runs on {first} and {worker}: --dist loadgroup is not grouping", pytrace=False)


PRELOAD_SERVER_ENV = env_name("PRELOAD_SERVER")


@pytest.fixture(scope="session", autouse=True)
def _preload_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One preload server per test process (``python -m shoal.runner.preload_server``): every shoalrun job the tests
    start on this host forks its fork server from it instead of importing torch again (3 s of CPU a job). Tests of
    the fork server itself take it out of their environment (``clean_env(preload_server=False)``)."""
    path = tmp_path_factory.mktemp("preload") / "server.sock"
    argv = [sys.executable, "-m", "shoal.runner.preload_server", str(path), "--parent", str(os.getpid())]
    server = subprocess.Popen(argv, env=clean_env(preload_server=False), stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    if "listening at" in server.stdout.readline():
        os.environ[PRELOAD_SERVER_ENV] = str(path)
    try:
        yield
    finally:
        os.environ.pop(PRELOAD_SERVER_ENV, None)
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark (``local[2]``) per test process, shared by every Spark test module (a session takes seconds
    to start). Its Python workers are this interpreter (which has Shoal), see this directory (the tests' functions and
    modules travel by reference), and are not reused between tasks."""
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'shoal[spark]')")
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    tests = os.path.dirname(os.path.abspath(__file__))
    session = (
        SparkSession.builder.master("local[2]")
        .appName("shoal-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.python.worker.reuse", "false")
        .config("spark.executorEnv.PYTHONPATH", tests)
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def process_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or gone between the open and the read
        return False


def clean_env(preload_server: bool = True) -> dict[str, str]:
    """This process's environment without any launcher variables, so a child sees no job; with the tests' preload
    server (``_preload_server``) unless ``preload_server`` is False."""
    prefixes = ("SHOAL_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    if preload_server and PRELOAD_SERVER_ENV in os.environ:
        env[PRELOAD_SERVER_ENV] = os.environ[PRELOAD_SERVER_ENV]
    env["PYTHONUNBUFFERED"] = "1"
    # One compute thread per process: two tests run at once on two cores, and a process whose intra-op threads wait
    # for a busy core spins on it. The tests of shoalrun's own share of the cores remove this.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(_TF_THREADS)
    return env


@pytest.fixture
def worker_env() -> dict[str, str]:
    """A clean environment for launching child jobs."""
    return clean_env()


SSHD = "/usr/sbin/sshd"


@pytest.fixture
def loopback_sshd(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """An sshd on 127.0.0.2 that accepts a fresh key for the current user; yields (port, private key)."""
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None or os.geteuid() != 0:
        pytest.skip("needs root and an OpenSSH server (.ci/run installs openssh-server)")
    os.makedirs("/run/sshd", exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "user_key.pub").read_text())
    port = free_port("127.0.0.2")
    options = {
        "Port": str(port),
        "ListenAddress": "127.0.0.2",
        "HostKey": str(tmp_path / "host_key"),
        "AuthorizedKeysFile": str(tmp_path / "authorized_keys"),
        "StrictModes": "no",
        "PidFile": str(tmp_path / "sshd.pid"),
        "PermitRootLogin": "prohibit-password",
        "UsePAM": "no",
        "PasswordAuthentication": "no",
    }
    argv = [SSHD, "-D", "-e", "-f", "/dev/null"]
    for key, value in options.items():
        argv += ["-o", f"{key}={value}"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.2", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.skip(f"sshd did not start: {server.stderr.read().decode() if server.stderr else ''}")
            time.sleep(0.1)
    try:
        yield port, tmp_path / "user_key"
    finally:
        server.terminate()
        server.wait(timeout=10)


def keras_collectives(hvd_keras: Any, rank: int, prefix: str) -> dict[str, Any]:
    """The four Keras collectives of Horovod's Keras module on this rank's 2x2 value (rank added to 0..3), named
    ``<prefix>.<op>``: what each returned. Every rank gets the average, the rows of all ranks, rank 1's value, and its
    row of the sum."""
    value = np.arange(4.0).reshape(2, 2) + rank
    return {
        "allreduce": hvd_keras.allreduce(value, name=f"{prefix}.allreduce"),
        "allgather": hvd_keras.allgather(value, name=f"{prefix}.allgather"),
        "broadcast": hvd_keras.broadcast(value, 1, name=f"{prefix}.broadcast"),
        "reducescatter": hvd_keras.reducescatter(value, name=f"{prefix}.reducescatter", op=hvd_keras.Sum),
    }
