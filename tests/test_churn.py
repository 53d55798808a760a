"""``python -m shoal.bench.churn``: a short run (18 s per job, 3 seeded events) keeps the JSON contract and the
invariants that hold whatever the events: no committed step lost or repeated, no worker left behind, no step redone
because of a notice."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, clean_env

pytest.importorskip("sklearn", reason="the churn benchmark trains on scikit-learn's digits")


@pytest.mark.timeout(300)
def test_a_short_churn_run_keeps_the_contract() -> None:
    command = [sys.executable, "-m", "shoal.bench.churn", "--workers", "3", "--minutes", "0.3", "--events", "3", "--seed", "7"]
    result = subprocess.run(command, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("churn: seed 7;"), lines[0]
    drawn = [line for line in lines if line.startswith("churn: ") and " s  " in line and " return " not in line]
    assert len(drawn) == 3, result.stdout  # each drawn event is printed; a removed host's return comes on top
    report = json.loads(lines[-1])
    print(lines[-1])
    assert report["bench"] == "churn" and report["seed"] == 7 and report["workers"] == 3
    events = report["events"]
    assert set(events) == {"kill", "term", "remove", "return"} and events["kill"] + events["term"] + events["remove"] == 3
    assert events["return"] <= events["remove"] and report["return_after_s"] == report["mean_interval_s"]
    assert report["lost_steps"] == 0 and report["leftover_processes"] == 0
    assert report["steps_redone_by_kind"]["term"] == 0
    assert report["steps_redone"] == sum(report["steps_redone_by_kind"].values())
    assert all(kind in report["events"] and value > 0 for kind, value in report["recovery_s"].items())
    assert 0 < report["goodput_ratio"] < 2 and report["static_samples_per_s"] > 0
    assert report["accuracy"] >= 0.9 and report["static_accuracy"] >= 0.9
    assert report["committed_steps"] > 0 and 1 <= report["final_world"] <= 3
