"""Elastic Shoal on Ray: a node leaves mid-training (its worker dies with it) and the survivor goes on from its last
commit; a node joins and gets a worker at the next commit. A local multi-node Ray cluster (ray.cluster_utils)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'shoal[ray]')")
pytestmark = pytest.mark.xdist_group("ray")  # one worker runs them: one Ray cluster at a time, started once per module

from ray.cluster_utils import Cluster  # noqa: E402

from elastic_training import TOTAL_STEPS, elastic_training, wait_progress  # noqa: E402
from shoal.ray import ElasticRayExecutor, RayExecutor  # noqa: E402

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def cluster() -> Iterator[Any]:
    """A head node with no CPUs (the driver's) and two worker nodes of 1 CPU each."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    local = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    local.add_node(num_cpus=1)
    local.add_node(num_cpus=1)
    ray.init(address=local.address, runtime_env={"env_vars": {"PYTHONPATH": str(TESTS), "RAY_USAGE_STATS_ENABLED": "0"}})
    local.wait_for_nodes()
    try:
        yield local
    finally:
        ray.shutdown()
        local.shutdown()


def test_a_node_leaving_and_one_joining_cost_no_committed_step(cluster: Any, tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    outcome: dict[str, Any] = {}
    executor = ElasticRayExecutor(
        ElasticRayExecutor.create_settings(min_np=1, max_np=2, elastic_timeout=60, timeout_s=60), cpus_per_slot=1
    )
    executor.start()

    def run() -> None:  # the driver in a thread; this (main) thread changes the cluster, as Ray's autoscaler would
        try:
            outcome["results"] = executor.run(elastic_training, args=(str(progress), TOTAL_STEPS))
        except BaseException as error:
            outcome["error"] = error

    driver = threading.Thread(target=run, daemon=True)
    driver.start()
    wait_progress(progress, lambda step, size: size == 2 and step >= 8, 120)
    cluster.remove_node(cluster.worker_nodes[-1] if isinstance(cluster.worker_nodes, list) else list(cluster.worker_nodes)[-1])
    wait_progress(progress, lambda step, size: size == 1, 120)
    cluster.add_node(num_cpus=1)
    driver.join(timeout=180)
    assert not driver.is_alive(), "the elastic job did not finish"
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)], [(r["rank"], r["size"]) for r in results]
    log = results[0]["log"]
    assert [step for step, _ in log] == list(range(TOTAL_STEPS)), "a committed step was lost or applied twice"
    sizes = [size for _, size in log]
    two, one = sizes.index(2), sizes.index(1, sizes.index(2))
    assert two < one and sizes[-1] == 2, sizes  # trained at 2, shrank to 1 when the node left, grew back to 2
    assert results[0]["weight"] == results[1]["weight"]  # the newcomer received rank 0's state and kept in step
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and ray.available_resources().get("CPU", 0) < 2:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2  # every actor the job started has been ended


def test_a_draining_node_s_worker_leaves_at_a_commit_with_nothing_rolled_back(cluster: Any, tmp_path: Path) -> None:
    """``ray drain-node`` with a preemption reason and a deadline: the node is no longer offered, its worker leaves at
    the next commit, and the survivor goes on from that commit without restoring."""
    from ray.core.generated import autoscaler_pb2

    progress = tmp_path / "progress"
    outcome: dict[str, Any] = {}
    executor = ElasticRayExecutor(
        ElasticRayExecutor.create_settings(min_np=1, max_np=2, elastic_timeout=60, timeout_s=60), cpus_per_slot=1
    )
    executor.start()

    def run() -> None:
        try:
            outcome["results"] = executor.run(elastic_training, args=(str(progress), TOTAL_STEPS // 2))
        except BaseException as error:
            outcome["error"] = error

    driver = threading.Thread(target=run, daemon=True)
    driver.start()
    wait_progress(progress, lambda step, size: size == 2 and step >= 8, 120)
    nodes = cluster.worker_nodes if isinstance(cluster.worker_nodes, list) else list(cluster.worker_nodes)
    gcs = ray._raylet.GcsClient(address=cluster.address)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, why = gcs.drain_node(nodes[-1].node_id, reason, "spot notice", int(time.time() * 1000) + 120_000)
    assert accepted, why
    driver.join(timeout=180)
    assert not driver.is_alive(), "the elastic job did not finish"
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 1)], [(r["rank"], r["size"]) for r in results]
    assert results[0]["restores"] == 0, "the survivor rolled back although the other worker left at a commit"
    log = results[0]["log"]
    assert [step for step, _ in log] == list(range(TOTAL_STEPS // 2)), "a committed step was lost or applied twice"
    sizes = [size for _, size in log]
    last_at_two = len(sizes) - 1 - sizes[::-1].index(2)  # the job may start at 1 and grow before the drain
    assert last_at_two < len(sizes) - 1 and set(sizes[last_at_two + 1 :]) == {1}, sizes


def test_elastic_arguments_of_ray_executor() -> None:
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="positive min_workers"):
        RayExecutor(max_workers=2)
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        ElasticRayExecutor(min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="not available for an elastic job"):
        RayExecutor(min_workers=1, max_workers=2).execute(lambda _: None)
