"""shoal.ray on a local Ray cluster (2 CPUs): the executor's topology and API, the digits example to >= 0.95 on 2
workers, a raising worker and a killed worker failing ``run`` with nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, clean_env, process_alive

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'shoal[ray]')")
pytestmark = pytest.mark.xdist_group("ray")  # one worker runs them: one Ray cluster at a time, started once per module

from shoal.ray import RayExecutor  # noqa: E402

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster with 2 CPUs started by this process (``ray.init(num_cpus=2)``; ``ray.shutdown()`` stops it
    and nothing else), whose workers can import this module; yields its address for other drivers."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(TESTS), "RAY_USAGE_STATS_ENABLED": "0"}},
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _topology() -> tuple[int, int, int, int, int]:
    import shoal.torch as hvd

    hvd.init()
    import torch

    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), int(total)


def _lightning_fit() -> dict[str, Any]:
    from test_lightning import _train  # this test directory is on the workers' PYTHONPATH

    fitted = _train(8, 1, 6)
    return {"steps": fitted["steps"], "weights": fitted["weights"].tolist()}


def _held_cpus() -> float:
    """CPUs that actors or placement groups still hold (0 once the executor let everything go)."""
    return float(ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0))


def test_executor_places_ranks_and_runs_collectives(ray_cluster: str) -> None:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2, cpus_per_worker=1)
    executor.start()
    pids = [pid for _, pid in executor.locations]
    try:
        assert executor.run(_topology) == [(0, 2, 0, 2, 3), (1, 2, 1, 2, 3)]
        assert executor.execute(lambda executable: executable) == [None, None]
        assert executor.execute_single(lambda _: os.getpid()) == executor.locations[0][1]
        refs = executor.run_remote(_topology)
        assert [r[0] for r in ray.get(refs)] == [0, 1]
        # Lightning's Trainer(strategy=ShoalStrategy()) in the same actors: 2 ranks x batch 4, 6 steps, in step.
        fitted = executor.run(_lightning_fit)
        assert [f["steps"] for f in fitted] == [6, 6] and fitted[0]["weights"] == fitted[1]["weights"]
    finally:
        executor.shutdown()
    _assert_gone(pids)


class _Counter:
    def __init__(self, start: int) -> None:
        self.value = start


def test_executable_class_and_bad_arguments(ray_cluster: str) -> None:
    with pytest.raises(ValueError, match="exactly one of num_workers and num_hosts"):
        RayExecutor()
    with pytest.raises(ValueError, match="use_gpu"):
        RayExecutor(num_workers=1, gpus_per_worker=1)
    with pytest.raises(RuntimeError, match="not started"):
        RayExecutor(num_workers=1).run(_topology)
    executor = RayExecutor(num_workers=1)
    executor.start(executable_cls=_Counter, executable_args=[41])
    try:
        assert executor.execute(lambda counter: counter.value + 1) == [42]
    finally:
        executor.shutdown()
    too_big = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=3, cpus_per_worker=1)
    with pytest.raises(RuntimeError, match="could not reserve 3"):
        too_big.start()


def _rank_one_raises() -> int:
    import shoal.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank one")
    import torch

    while True:  # rank 0 waits in a collective that rank 1 never joins: run() must still end promptly
        hvd.allreduce(torch.ones(1))


def test_a_raising_worker_fails_run_with_its_traceback_and_leaves_nothing(ray_cluster: str) -> None:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    pids = [pid for _, pid in executor.locations]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 .* raised(.|\n)*ValueError: bad batch on rank one"):
        executor.run(_rank_one_raises)
    assert time.monotonic() - started < 30
    _assert_gone(pids)


def _rank_one_is_killed() -> int:
    import torch

    import shoal.torch as hvd

    hvd.init()
    for step in range(10_000):
        hvd.allreduce(torch.ones(1000), name=f"step.{step % 4}")
        if hvd.rank() == 1 and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_a_killed_worker_fails_run_cleanly_and_leaves_nothing(ray_cluster: str) -> None:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    pids = [pid for _, pid in executor.locations]
    with pytest.raises(RuntimeError, match=r"rank 1 .* died"):
        executor.run(_rank_one_is_killed)
    _assert_gone(pids)


def _assert_released() -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _held_cpus():
        time.sleep(0.2)
    assert _held_cpus() == 0, "actors or the placement group still hold CPUs"


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (any(process_alive(pid) for pid in pids) or _held_cpus()):
        time.sleep(0.2)
    assert not [pid for pid in pids if process_alive(pid)], "a worker process outlived the failed run"
    assert _held_cpus() == 0


def test_digits_example_reaches_95_percent_on_two_ray_workers(ray_cluster: str, tmp_path: Path) -> None:
    env = clean_env()
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    command = [sys.executable, str(REPO / "examples" / "ray_digits.py"), "--num-workers", "2", "--address", ray_cluster]
    result = subprocess.run(
        [*command, "--checkpoint", str(tmp_path / "digits.pt")], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["example"] == "ray_digits" and summary["world"] == 2
    assert summary["test_accuracy"] >= 0.95, summary
    assert (tmp_path / "digits.pt").exists()
    assert "(rank 0 pid=" in result.stdout + result.stderr  # Ray prefixes each worker's lines with its rank


def _ray_train_loop(config: dict[str, Any]) -> None:
    import tempfile

    import torch
    from ray import train

    import shoal.torch as hvd

    hvd.init()
    context = train.get_context()
    placed = (hvd.rank(), hvd.size(), hvd.local_rank()) == (
        context.get_world_rank(),
        context.get_world_size(),
        context.get_local_rank(),
    )
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    target = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for epoch in range(config["epochs"]):
        torch.manual_seed(100 * epoch + hvd.rank())
        x = torch.randn(32, 4)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        optimizer.step()
        mean_loss = hvd.allreduce(loss.detach(), name="loss").item()
        weights_sum = hvd.allreduce(model.weight.detach().sum(), op=hvd.Max).item() - model.weight.detach().sum().item()
        metrics = {"epoch": epoch, "loss": mean_loss, "placed": placed, "weights_differ": abs(weights_sum) > 0}
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if hvd.rank() == 0:
                torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
                checkpoint = train.Checkpoint.from_directory(directory)
            train.report(metrics, checkpoint=checkpoint)


def test_ray_train_data_parallel_trainer_runs_a_shoal_loop(ray_cluster: str, tmp_path: Path) -> None:
    pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'shoal[ray]')")
    import torch
    from ray.train import RunConfig, ScalingConfig

    from shoal.ray.train import DataParallelTrainer, ShoalConfig, ShoalTrainer

    assert issubclass(ShoalTrainer, DataParallelTrainer)  # DataParallelTrainer(..., backend_config=ShoalConfig())
    trainer = ShoalTrainer(
        _ray_train_loop,
        train_loop_config={"epochs": 3},
        shoal_config=ShoalConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="shoal_ray_train"),
    )
    result = trainer.fit()
    assert result.error is None, result.error
    assert result.metrics["epoch"] == 2 and result.metrics["placed"] is True
    assert result.metrics["weights_differ"] is False  # the ranks stayed equal: gradients were averaged
    assert result.metrics["loss"] < 10
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as directory:
        assert set(torch.load(os.path.join(directory, "model.pt"))) == {"weight", "bias"}
    _assert_released()


def test_on_ray_benchmark_compares_the_executor_with_shoalrun(ray_cluster: str) -> None:
    env = clean_env()
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    command = [sys.executable, "-m", "shoal.bench.on_ray", "--workers", "2", "--model", "mlp", "--address", ray_cluster]
    result = subprocess.run(
        [*command, "--steps", "3", "--warmup", "1", "--rounds", "1"], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "on_ray" and summary["workers"] == 2
    assert summary["shoalrun_ips"] > 0 and summary["ray_ips"] > 0
    assert (
        summary["ratio"] == round(summary["ray_ips"] / summary["shoalrun_ips"], 3)
        or abs(summary["ratio"] - summary["ray_ips"] / summary["shoalrun_ips"]) < 0.01
    )
    assert 0 < summary["ray_start_s"] < 60 and 0 < summary["shoalrun_start_s"] < 60
    assert summary["ray_cluster_start_s"] is None  # it joined the running cluster
