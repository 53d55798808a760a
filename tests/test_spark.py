"""``shoal.spark.run`` on a local Spark (``local[2]``, one session for the module): ranks, a collective, results in
rank order, and failures (a raising rank, a killed task) that end the job with a clear error and leave no process."""

from __future__ import annotations

import io
import os
import time
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'shoal[spark]')")
pytestmark = pytest.mark.xdist_group("spark")  # one worker runs them: one Spark session (JVM) for all three modules


import shoal.spark  # noqa: E402
from conftest import process_alive  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS}  # the workers unpickle this module's functions by reference


def topology_and_sum(scale: float) -> dict[str, Any]:
    import torch

    import shoal.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1) * scale]), op=hvd.Sum, name="spark.sum")
    print(f"rank {hvd.rank()} says hello", flush=True)
    result = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "sum": float(total.item()),
        "pid": os.getpid(),
    }
    hvd.shutdown()
    return result


def raise_on_rank_one() -> int:
    import shoal.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one refuses")
    time.sleep(60)  # rank 0 would wait here: the job must end it
    return hvd.rank()


def report_then_wait(directory: str) -> int:
    import shoal.torch as hvd

    hvd.init()
    with open(os.path.join(directory, f"pids.{hvd.rank()}"), "w") as out:
        out.write(f"{os.getpid()} {os.getppid()}")
    time.sleep(120)
    return hvd.rank()


@pytest.mark.timeout(180)
def test_run_places_ranks_reduces_and_returns_results_in_rank_order(spark: Any) -> None:
    out, err = io.StringIO(), io.StringIO()
    results = shoal.spark.run(topology_and_sum, args=(2.0,), num_proc=2, env=ENV, stdout=out, stderr=err, verbose=0)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["local_size"] == 2 for r in results)
    assert sorted(r["local_rank"] for r in results) == [0, 1]
    assert [r["sum"] for r in results] == [6.0, 6.0]  # (1 + 2) * 2 on both
    assert "[0]<stdout>:rank 0 says hello" in out.getvalue() and "[1]<stdout>:rank 1 says hello" in out.getvalue()
    deadline = time.monotonic() + 10
    while any(process_alive(r["pid"]) for r in results) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(r["pid"]) for r in results)


@pytest.mark.timeout(180)
def test_a_raising_rank_fails_the_job_with_its_host_and_traceback(spark: Any) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        shoal.spark.run(raise_on_rank_one, num_proc=2, env=ENV, verbose=0)
    message = str(raised.value)
    assert "rank 1 on host" in message and "ValueError: rank one refuses" in message and "Traceback" in message
    assert time.monotonic() - started < 30, "the failure took too long to reach the driver"


@pytest.mark.timeout(180)
def test_a_killed_task_fails_the_job_and_leaves_no_process(spark: Any, tmp_path: Any) -> None:
    import signal
    import threading

    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["result"] = shoal.spark.run(report_then_wait, args=(str(tmp_path),), num_proc=2, env=ENV, verbose=0)
        except Exception as error:
            outcome["error"] = error

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("pids.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = {int(p.name.split(".")[1]): list(map(int, p.read_text().split())) for p in tmp_path.glob("pids.*")}
    assert len(pids) == 2, pids
    _worker, task = pids[1]
    killed_at = time.monotonic()
    os.kill(task, signal.SIGKILL)  # the Spark task's Python worker, not the rank's own process
    caller.join(timeout=60)
    assert not caller.is_alive(), "run() did not return after a task died"
    assert "error" in outcome and "shoal.spark.run" in str(outcome["error"]), outcome
    print(outcome["error"])
    assert time.monotonic() - killed_at < 30
    every = [pid for pair in pids.values() for pid in pair]
    deadline = time.monotonic() + 15
    while any(process_alive(pid) for pid in every) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_alive(pid) for pid in every), "a process outlived the job"


def test_without_a_spark_context_run_says_so() -> None:
    import subprocess
    import sys

    code = "import shoal.spark\ntry:\n    shoal.spark.run(int, num_proc=1)\nexcept RuntimeError as error:\n    print(error)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "could not find an active SparkContext; are you running in a PySpark session?" in result.stdout, result


def digits_under_torchrun(epochs: int) -> float:
    """A Shoal training function as TorchDistributor runs it: under torchrun, with SHOAL_SECRET in the environment."""
    import sys

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import shoal.torch as hvd

    sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "examples"))
    from digits import DigitsNet, evaluate, load_data

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    train_set, test_set = load_data()
    model = DigitsNet()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.03 * hvd.size(), momentum=0.9), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train_set, batch_size=16, sampler=sampler):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    accuracy = float(evaluate(model, test_set))
    hvd.shutdown()
    return accuracy


@pytest.mark.timeout(240)
def test_torch_distributor_runs_a_shoal_function(spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyspark's TorchDistributor starts torchrun; Shoal's init finds torchrun's ranks, and with SHOAL_SECRET set its
    store is authenticated. Both ranks end with the same weights, so either's accuracy is the job's."""
    import secrets

    from pyspark.ml.torch.distributor import TorchDistributor

    monkeypatch.setenv("SHOAL_SECRET", secrets.token_hex(16))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    accuracy = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(digits_under_torchrun, 5)
    assert accuracy >= 0.95, accuracy


@pytest.mark.timeout(240)
def test_on_spark_benchmark_compares_shoal_spark_run_with_shoalrun() -> None:
    import json
    import subprocess
    import sys

    from conftest import REPO, clean_env

    command = [sys.executable, "-m", "shoal.bench.on_spark", "--workers", "2", "--model", "mlp"]
    command += ["--steps", "5", "--rounds", "1"]
    result = subprocess.run(command, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "on_spark" and report["workers"] == 2 and report["model"] == "mlp"
    assert report["shoalrun_ips"] > 0 and report["spark_ips"] > 0
    assert report["ratio"] == pytest.approx(report["spark_ips"] / report["shoalrun_ips"], rel=0.01)
    assert 0 < report["shoalrun_start_s"] < 60 and 0 < report["spark_start_s"] < 60 and report["spark_session_start_s"] > 0
