"""``shoal.spark.run_elastic`` on a local Spark (``local[2]``: two task slots, one session for the module): a slot's
Python worker is killed mid-training (as when its executor is lost), the survivor goes on from its last commit,
Spark runs the replacement slot, and its worker joins at a commit."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'shoal[spark]')")
pytestmark = pytest.mark.xdist_group("spark")  # one worker runs them: one Spark session (JVM) for all three modules


import shoal.spark  # noqa: E402
from conftest import process_alive  # noqa: E402
from elastic_training import TOTAL_STEPS, elastic_training, wait_progress  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(180)
def test_a_lost_slot_and_its_replacement_cost_no_committed_step(spark: Any, tmp_path: Path) -> None:
    progress, pids = tmp_path / "progress", tmp_path / "pids"
    pids.mkdir()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["results"] = shoal.spark.run_elastic(
                elastic_training, args=(str(progress), TOTAL_STEPS, str(pids)), num_proc=2, min_num_proc=1,
                max_num_proc=2, elastic_timeout=60, env={"PYTHONPATH": TESTS}, verbose=2,
            )  # fmt: skip
        except BaseException as error:
            outcome["error"] = error

    driver = threading.Thread(target=run, daemon=True)
    driver.start()
    wait_progress(progress, lambda step, size: size == 2 and step >= 8, 120)
    workers = {int(path.name): tuple(map(int, path.read_text().split())) for path in pids.iterdir()}
    victim_task = next(parent for rank, parent in workers.values() if rank == 1)
    os.kill(victim_task, signal.SIGKILL)  # the slot's Spark task dies; its worker dies with it
    wait_progress(progress, lambda step, size: size == 1, 60)
    driver.join(timeout=150)
    assert not driver.is_alive(), "the elastic job did not finish"
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)], [(r["rank"], r["size"]) for r in results]
    log = results[0]["log"]
    assert [step for step, _ in log] == list(range(TOTAL_STEPS)), "a committed step was lost or applied twice"
    sizes = [size for _, size in log]
    two, one = sizes.index(2), sizes.index(1, sizes.index(2))
    assert two < one and sizes[-1] == 2, sizes  # trained at 2, shrank to 1 when the slot died, grew back to 2
    assert results[0]["weight"] == results[1]["weight"]  # the newcomer received rank 0's state and kept in step
    assert results[0]["restores"] >= 1  # the survivor rolled back to its last commit
    every = set(workers) | {int(path.name) for path in pids.iterdir()}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(process_alive(pid) for pid in every):
        time.sleep(0.2)
    assert not any(process_alive(pid) for pid in every), "a worker outlived the job"


def test_run_elastic_refuses_counts_out_of_order(spark: Any) -> None:
    with pytest.raises(ValueError, match="1 <= min_num_proc <= num_proc <= max_num_proc"):
        shoal.spark.run_elastic(int, num_proc=2, min_num_proc=3)
