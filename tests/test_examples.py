"""Examples and benchmarks run end to end and print their contract JSON line (fast settings)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SHOALRUN, clean_env, needs_netns


def last_json(command: list[str], timeout: float = 300) -> dict[str, object]:
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    if last.startswith("[0]<stdout>:"):
        last = last.split(":", 1)[1]
    return json.loads(last)  # type: ignore[no-any-return]


def test_digits_read_without_scikit_learn_equal_its_loader_and_split() -> None:
    """shoal.bench.digits reads scikit-learn's bundled file and draws its split itself: the same pixels, labels,
    samples and order as scikit-learn's own load_digits and train_test_split(test_size=0.2, random_state=0), and it
    leaves scikit-learn unimported (the point: about 1.4 s of CPU saved in every worker)."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    model_selection = pytest.importorskip("sklearn.model_selection")
    import numpy as np

    from shoal.bench import digits

    probe = "import sys; from shoal.bench.digits import load_digits; load_digits(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
    reference = sklearn_datasets.load_digits()
    images, target = digits.load_digits()
    assert images.dtype == reference.images.dtype and target.dtype == reference.target.dtype
    assert np.array_equal(images, reference.images) and np.array_equal(target, reference.target)
    expected = model_selection.train_test_split(reference.images, reference.target, test_size=0.2, random_state=0)
    split = digits.train_test_split(images, target, test_size=0.2, seed=0)
    assert [len(part) for part in split] == [1437, 360, 1437, 360]
    assert all(np.array_equal(ours, theirs) for ours, theirs in zip(split, expected, strict=True))
    with pytest.raises(ValueError, match="differ in length"):
        digits.train_test_split(images, target[:-1])


@pytest.mark.parametrize("workers", [1, 4])  # 2 workers: `make demo` (test_docs), and under srun, Ray and Lightning
def test_digits_reaches_95_percent(workers: int, tmp_path: object) -> None:
    script = [sys.executable, str(REPO / "examples" / "digits.py"), "--checkpoint", f"{tmp_path}/digits.pt"]
    command = script if workers == 1 else [*SHOALRUN, "-np", str(workers), *script]
    summary = last_json(command)
    assert summary["example"] == "digits" and summary["world"] == workers
    assert float(summary["test_accuracy"]) >= 0.95, summary  # type: ignore[arg-type]


def test_char_lm_loss_goes_down() -> None:
    script = [sys.executable, str(REPO / "examples" / "char_lm.py"), "--steps", "100", "--corpus-bytes", "300000"]
    summary = last_json([*SHOALRUN, "-np", "2", *script])
    assert summary["example"] == "char_lm" and summary["world"] == 2
    assert float(summary["final_loss"]) < float(summary["first_loss"]) - 1.5, summary  # type: ignore[arg-type]


def test_synthetic_benchmark_reports_rates() -> None:
    script = [sys.executable, str(REPO / "examples" / "synthetic_benchmark.py"), "--model", "mlp", "--num-iters", "2"]
    summary = last_json([*SHOALRUN, "-np", "2", *script])
    assert summary["world"] == 2 and float(summary["total_img_sec"]) > 0  # type: ignore[arg-type]


def test_train_benchmark_json_contract() -> None:
    command = [
        *SHOALRUN,
        "-np",
        "2",
        sys.executable,
        "-m",
        "shoal.bench.train",
        "--model",
        "mlp",
        "--steps",
        "3",
        "--rounds",
        "1",
        "--warmup",
        "1",
        "--profile",
        "--lockstep-bound",
    ]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1].split(":", 1)[1])
    assert summary["bench"] == "train" and summary["model"] == "mlp" and summary["world"] == 2
    keys = ("shoal_ips", "ddp_ips", "ratio", "bound_ips", "of_bound", "solo_ips", "bare_reduce_ms", "no_overlap_ips")
    for key in (*keys, "lockstep_ips", "of_lockstep"):
        assert float(summary[key]) > 0, key
    assert abs(float(summary["of_bound"]) - float(summary["shoal_ips"]) / float(summary["bound_ips"])) < 0.01
    assert abs(float(summary["of_lockstep"]) - float(summary["shoal_ips"]) / float(summary["lockstep_ips"])) < 0.01
    before, after = summary["barrier_us"]  # type: ignore[misc]  # two ranks on one host: a barrier round trip each time
    assert 0 < before < 1000 and 0 < after < 1000, summary["barrier_us"]
    # --profile: where a step's time went, from a timeline of one more Shoal phase (3 steps)
    assert re.search(
        r"compute on rank 0, 3 steps, median ms: forward [\d.]+, backward [\d.]+, synchronize [\d.]+, "
        r"update [\d.]+ \(step [\d.]+\)",
        result.stdout,
    ), result.stdout[-2000:]
    assert re.search(
        r"engine on rank 0, ms per step .*: negotiation [\d.]+, collectives [\d.]+, copies in [\d.]+, "
        r"reduction [\d.]+, copies out [\d.]+",
        result.stdout,
    ), result.stdout[-2000:]


def test_allreduce_benchmark_json_contract(tmp_path: Path) -> None:
    command = [
        *SHOALRUN,
        "-np",
        "2",
        sys.executable,
        "-m",
        "shoal.bench.allreduce",
        "--max-mib",
        "1",
        "--iterations",
        "3",
        "--latency-iterations",
        "50",
        "--json",
        str(tmp_path / "allreduce.json"),
    ]
    summary = last_json(command)
    assert json.loads((tmp_path / "allreduce.json").read_text()) == summary  # --json writes the same object
    assert summary["bench"] == "allreduce" and summary["world"] == 2
    rows = summary["rows"]
    assert [row["bytes"] for row in rows] == [4096, 16384, 65536, 262144, 1048576]  # type: ignore[union-attr,index]
    for row in rows:  # type: ignore[union-attr]
        assert row["shoal_ms"] > 0 and row["raw_ms"] > 0 and row["ratio"] > 0  # type: ignore[index]
        fixed_cost = ("latency_us", "transport_latency_us", "raw_latency_us")
        if row["bytes"] in (4096, 65536):  # type: ignore[index]
            assert all(row[key] > 0 for key in fixed_cost) and row["transport"] == "shm", row  # type: ignore[index]
        else:
            assert not any(key in row for key in fixed_cost), row  # type: ignore[operator]
    assert float(summary["memcpy_GBps"]) > 0  # type: ignore[arg-type]
    assert 0 < float(summary["barrier_us"]) < 1000  # type: ignore[arg-type]
    small = summary["small_tensors"]
    assert small["count"] == 256 and small["bytes_each"] == 16384 and small["speedup"] > 0  # type: ignore[index]
    shared = summary["shared_gradients"]  # two ranks on one host: the arena row is there
    assert shared["bytes"] == 40 * 10**6 and shared["arena_ms"] > 0 and shared["hier_ms"] > 0  # type: ignore[index]
    implied = 2 * shared["arena_ms"] * summary["memcpy_GBps"] / 40  # type: ignore[index,operator]
    assert shared["arena_bytes_moved_per_byte"] == pytest.approx(implied, abs=0.02)  # type: ignore[index]
    # ... and bench.plot draws it.
    plotted = subprocess.run(
        [sys.executable, "-m", "shoal.bench.plot", str(tmp_path / "allreduce.json"), "-o", str(tmp_path / "img")],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plotted.returncode == 0, plotted.stderr
    png = tmp_path / "img" / "allreduce.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_gpu_check_script_passes_its_checks_on_cpu() -> None:
    """The NCCL check script runs in CI over gloo, so it still works when a GPU machine is lent."""
    summary = last_json([*SHOALRUN, "-np", "2", sys.executable, "-m", "shoal.bench.gpu_check", "--device", "cpu", "--mib", "4"])
    assert summary["bench"] == "gpu_check" and summary["world"] == 2 and summary["device"] == "cpu"
    assert summary["checks"] == {
        "collectives": True,
        "more_collectives": True,
        "distributed_optimizer": True,
        "accumulation": True,
        "optimizer_and_elastic_state": True,
        "sync_batch_norm": True,
    }
    assert float(summary["allreduce"]["ratio"]) > 0  # type: ignore[index]


def test_rendezvous_benchmark_times_both_stores() -> None:
    summary = last_json(
        [
            sys.executable,
            "-m",
            "shoal.bench.rendezvous",
            "--worlds",
            "2",
            "--repeats",
            "1",
            "--reinits",
            "1",
            "--import-grace",
            "5",
        ]
    )
    (row,) = summary["rows"]  # type: ignore[misc]
    assert summary["bench"] == "rendezvous" and row["world"] == 2
    assert row["open_ms"] > 0 and row["auth_ms"] > 0 and row["auth_reinit_ms"] > 0 and row["ratio"] > 0


def test_startup_benchmark_times_forked_fresh_and_torchrun_jobs() -> None:
    summary = last_json([sys.executable, "-m", "shoal.bench.startup", "--np", "2", "--repeats", "1"])
    (row,) = summary["rows"]  # type: ignore[misc]
    assert summary["bench"] == "startup" and row["np"] == 2
    for name in ("forked", "fresh", "torchrun"):
        assert row[f"{name}_s"] > 0 and row[f"{name}_cpu_s"] > 0
    assert row["speedup"] == round(row["fresh_s"] / row["forked_s"], 2)
    # the fresh job imports torch in each of its two workers, the forked one once: a second of CPU apart at least
    assert row["fresh_cpu_s"] > row["forked_cpu_s"] + 1.0


@needs_netns
@pytest.mark.timeout(400)
def test_planner_benchmark_compares_auto_with_every_forced_scheme(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "shoal.bench.planner",
        "--hosts",
        "2",
        "--rate",
        "1gbit",
        "--model",
        "mlp",
        "--runs",
        "1",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--schemes",
        "allreduce,sfb",  # the contract; the benchmark's default compares all four
        "--json",
        str(tmp_path / "planner.json"),
    ]
    summary = last_json(command, timeout=380)
    assert summary["bench"] == "planner" and summary["of_runs"] == 1
    (run,) = summary["runs"]  # type: ignore[misc]
    assert set(run["forced"]) == {"allreduce", "sfb"} and all(v > 0 for v in run["forced"].values())
    assert run["best"] == max(run["forced"], key=run["forced"].get)
    assert abs(run["of_best"] - run["auto_ips"] / run["forced"][run["best"]]) < 0.01
    assert sum(run["choices"].values()) == 3  # the MLP's three Linear layers each got a scheme


@pytest.mark.alone  # a prediction against a measurement: another test running beside it skews one of them
@pytest.mark.timeout(300)
def test_predicted_two_rank_shared_memory_cnn_is_close_to_a_measured_run(tmp_path: Path) -> None:
    """shoal.bench.predict on one setting: calibrate (python -m shoal.predict.calibrate under shoalrun), profile two
    processes at once, predict, then train the same 2 ranks; the prediction must land within 40% of the measurement
    (a short run on a busy 2-core machine; the full validation is the benchmark, docs/predict.md). The CNN, not the
    MLP: on one host the MLP's measurement falls short of compute plus its bare reduction by Shoal's own gap (issue
    #18; +39% in the validation, +60% once in a full suite run), which is not what this checks."""
    command = [sys.executable, "-m", "shoal.bench.predict", "--settings", "shm:1x2", "--models", "cnn"]
    command += ["--comms", "allreduce", "--steps", "8", "--rounds", "1", "--profile-steps", "5"]
    summary = last_json([*command, "--json", str(tmp_path / "predict.json")], timeout=280)
    (row,) = summary["rows"]  # type: ignore[misc]
    assert summary["bench"] == "predict" and row["setting"] == "shm:1x2" and row["model"] == "cnn"
    assert row["measured_ips"] > 0 and row["predicted_ips"] > 0
    assert row["error"] == pytest.approx((row["predicted_ips"] - row["measured_ips"]) / row["measured_ips"], abs=0.002)
    assert abs(row["error"]) <= 0.40, row
    assert summary["median_error"] == summary["max_error"] == abs(row["error"])


def test_unequal_benchmark_json_contract() -> None:
    """The unequal-workers benchmark, small and short: it launches its own job, runs every phase with and without
    the neighbour, and ends with its JSON line; the balanced run's loss equals the 1-process reference's."""
    command = [sys.executable, "-m", "shoal.bench.unequal", "--model", "small", "--global-batch-size", "256"]
    command += ["--micro-batch-size", "16", "--samples", "1024", "--steps", "3", "--warmup", "2", "--rounds", "1"]
    command += ["--transition-steps", "12"]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "unequal" and summary["world"] == 2
    for key in ("balanced_ips", "equal_ips", "ddp_ips", "bound_ips", "of_bound", "quiet_of_bound"):
        assert float(summary[key]) > 0, key
    assert abs(summary["of_bound"] - summary["balanced_ips"] / summary["bound_ips"]) < 0.01
    assert set(summary["rebalance_steps"]) == {"start", "stop"}
    assert len(summary["transition_shares"]) == 12 and all(sum(s) == 16 for s in summary["transition_shares"])
    assert abs(summary["final_loss"] - summary["reference_loss"]) < 1e-4, summary


@needs_netns
@pytest.mark.timeout(300)
def test_train_benchmark_lossy_against_ddp_and_its_powersgd_hook_on_a_slow_link() -> None:
    # The documented run is at 100 Mbit/s with the default steps; 1 Gbit/s and 3 steps keep the test short.
    command = [sys.executable, "-m", "shoal.bench.netns", "--hosts", "2", "--rate", "1gbit", "--"]
    command += [sys.executable, "-m", "shoal.bench.train", "--model", "mlp", "--comm", "auto-lossy"]
    command += ["--compare", "ddp,ddp-powersgd", "--compare-comm", "auto", "--steps", "3", "--rounds", "1"]
    summary = last_json(command, timeout=280)
    assert summary["comm"] == "auto-lossy" and summary["other_comm"] == "auto"
    for key in ("shoal_ips", "ddp_ips", "ddp_powersgd_ips", "other_ips", "bound_ips"):
        assert float(summary[key]) > 0, key  # type: ignore[arg-type]
    # The ratio comes from the unrounded rates; the printed rates have one decimal (6.036 against 6.034 once).
    expected = float(summary["shoal_ips"]) / float(summary["ddp_powersgd_ips"])  # type: ignore[arg-type]
    assert summary["powersgd_ratio"] == pytest.approx(expected, rel=1e-3)
    assert sum(summary["plan_choices"].values()) == 3, summary["plan_choices"]  # type: ignore[union-attr]


@pytest.mark.timeout(300)
def test_accuracy_benchmark_curves_targets_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "acc.png"
    script = [sys.executable, "-m", "shoal.bench.accuracy", "--model", "mlp", "--epochs", "3", "--width", "64"]
    script += ["--variants", "shoal,auto-lossy,ddp,ddp-powersgd,solo", "--plot", str(plot)]
    summary = last_json([*SHOALRUN, "-np", "2", *script], timeout=280)
    assert summary["bench"] == "accuracy" and summary["world"] == 2
    variants = summary["variants"]
    assert set(variants) == {"shoal", "auto-lossy", "ddp", "ddp-powersgd", "solo"}  # type: ignore[arg-type]
    reference = variants["shoal"]  # type: ignore[index]
    assert len(reference["curve"]) == 3 and summary["target"] == round(reference["final_accuracy"] - 0.005, 4)
    for name, result in variants.items():  # type: ignore[union-attr]
        seconds = [point[0] for point in result["curve"]]
        assert seconds == sorted(seconds) and 3 <= len(seconds) <= 6, (name, result)  # up to --max-epochs (2 x 3)
        reached = result["time_to_target_s"]
        assert reached is None or any(abs(s - reached) < 1e-9 and a >= summary["target"] for s, a in result["curve"])
    assert plot.stat().st_size > 10_000
