"""The elastic driver's failure detector (``shoal.runtime.liveness``) on given heartbeat histories, with an injected
clock; and an elastic job whose worker is stopped (SIGSTOP) for good or for a moment."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from shoal.runtime.liveness import Detector, Liveness, Settings
from test_elastic import RunningJob, check_every_sample_once, gone

DEFAULTS = Settings(period_s=0.5, pause_s=3.0, threshold=8.0, ceiling_s=30.0)


def _history(intervals: list[float], settings: Settings = DEFAULTS) -> Detector:
    detector = Detector(settings, now=0.0)
    now = 0.0
    for interval in intervals:
        now += interval
        detector.beat(now)
    return detector


def _first_suspected(detector: Detector, step_s: float = 0.01) -> float:
    """The silence after the last beat at which ``detector`` first suspects the worker."""
    silence = 0.0
    while not detector.suspected(detector.last + silence):
        silence += step_s
    return silence


def test_a_steady_worker_is_suspected_a_second_past_the_allowed_pause_and_never_for_a_blip() -> None:
    steady = _history([0.5] * 100)  # beats seen every 0.5 s (the deviation is floored at a fifth of the mean)
    suspected = _first_suspected(steady)
    assert 3.0 + 0.5 < suspected < 3.0 + 0.5 + 6 * 0.1, suspected  # mean + pause + ~5.6 deviations (phi 8)
    assert suspected == pytest.approx(steady.suspicion_after_s(), abs=0.02)
    assert not steady.suspected(steady.last + 3.2)  # a 2 s cut whose retransmission lands 3 s in: 3.2 s of silence
    assert steady.phi(steady.last + 0.5) < 1  # a beat on time is no surprise


def test_an_irregular_history_waits_longer_and_the_ceiling_bounds_every_history() -> None:
    regular = _history([0.5] * 100)
    irregular = _history([0.25, 1.75] * 50)  # a loaded machine: the same mean, a deviation of 0.75 s
    assert _first_suspected(irregular) > _first_suspected(regular) + 3  # 5.6 deviations of 0.75 s, not of 0.1
    capped = Settings(period_s=0.5, pause_s=3.0, threshold=8.0, ceiling_s=2.0)
    assert _first_suspected(_history([0.25, 1.75] * 50, capped)) == pytest.approx(2.0, abs=0.02)  # the user's knob


def test_a_new_worker_is_judged_by_the_period_until_it_has_a_history() -> None:
    fresh = Detector(DEFAULTS, now=10.0)  # seen once, no interval yet: mean 0.5 s, deviation 0.1 s
    assert not fresh.suspected(10.0 + 3.4)
    assert fresh.suspected(10.0 + 4.2)
    with pytest.raises(ValueError, match="must be positive"):
        Settings(period_s=0.5, pause_s=3.0, threshold=0.0, ceiling_s=30.0)


def test_the_job_view_counts_a_moved_counter_as_a_beat_and_names_why_it_suspects() -> None:
    liveness = Liveness(DEFAULTS)
    for tick in range(40):  # worker a beats every 0.5 s, worker b stops after 5 s
        now = tick * 0.5
        liveness.observe("a", str(tick).encode(), now)
        liveness.observe("b", str(min(tick, 10)).encode(), now)
    assert liveness.heard("a") and not liveness.heard("c")
    suspected = liveness.suspected(["a", "b", "c"], now=19.5)
    assert list(suspected) == ["b"]
    assert re.match(r"silent for 14\.5 s where its heartbeats came every 0\.50 s", suspected["b"]), suspected
    liveness.forget("b")
    assert not liveness.heard("b")


def test_a_store_outage_suspects_nobody_and_a_late_reconnection_is_judged_from_its_end() -> None:
    liveness = Liveness(DEFAULTS)
    for tick in range(20):  # both beat every 0.5 s until 9.5 s; then the store is unreachable for 8 s
        liveness.observe("a", str(tick).encode(), tick * 0.5)
        liveness.observe("b", str(tick).encode(), tick * 0.5)
    now = 9.5
    while now < 17.5:  # the driver checks every 0.25 s through the outage: all silent, nobody suspected
        now += 0.25
        assert liveness.suspected(["a", "b"], now) == {}, now
    liveness.observe("a", b"a-back", now)  # a's connection resumes at once; b's retransmission comes 3 s later
    for _ in range(12):
        now += 0.25
        liveness.observe("a", f"a{now}".encode(), now)
        assert liveness.suspected(["a", "b"], now) == {}, now  # b's silence counts from the outage's end
    assert "b" in liveness.suspected(["a", "b"], now + 2.0)  # but a silence after it is judged as any other


def test_an_outage_past_a_ceiling_below_the_pause_still_suspects_nobody() -> None:
    """With the ceiling set below the allowed pause (a short ``SHOAL_ELASTIC_UNREACHABLE_SECONDS``), every worker
    reaches it before any is past its pause: all suspected at once is an outage too, never a reason to end them."""
    short = Settings(period_s=0.5, pause_s=3.0, threshold=8.0, ceiling_s=2.0)
    liveness = Liveness(short)
    for tick in range(20):
        liveness.observe("a", str(tick).encode(), tick * 0.5)
        liveness.observe("b", str(tick).encode(), tick * 0.5)
    assert liveness.suspected(["a", "b"], 9.5 + 2.5) == {}  # both silent 2.5 s: past the ceiling, not the pause
    liveness.observe("a", b"back", 12.25)
    assert liveness.suspected(["a", "b"], 12.5) == {}  # b's silence counts from the outage's end
    assert "b" in liveness.suspected(["a", "b"], 12.0 + 2.1)


# ----- an elastic job -----


def _stopped_job(tmp_path: Path, stop_s: float | None) -> tuple[RunningJob, int, float]:
    """Three elastic workers (``examples/elastic_digits.py``); rank 2 is SIGSTOPped at step 15, for ``stop_s`` seconds
    (then SIGCONT) or for good. Returns the job, the pid and when it was stopped."""
    flags = ["-np", "3", "--min-np", "2"]
    job = RunningJob(flags, ["--epochs", "2", "--step-delay", "0.05", "--log-every", "5"])
    pid = job.worker_pids(3)[2]
    job.wait_for(r"^\[0\]<stdout>:step 15 ", 60)
    stopped = time.time()
    subprocess.run(["kill", "-STOP", str(pid)], check=True)
    if stop_s is not None:
        time.sleep(stop_s)
        subprocess.run(["kill", "-CONT", str(pid)], check=True)
    return job, pid, stopped


@pytest.mark.timeout(180)
def test_a_stopped_worker_is_ended_within_seconds_and_the_job_trains_on_without_it(tmp_path: Path) -> None:
    job, pid, stopped = _stopped_job(tmp_path, None)
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    ended = job.wait_for(r"has not reached the job's store .*: silent for ([\d.]+) s .*suspected from ([\d.]+) s\)", 1)
    silent, threshold = float(ended.group(1)), float(ended.group(2))
    # Ended by its own history, not the 30 s ceiling: at the detector's threshold (a loaded machine's irregular beats
    # raise it, by design), within the driver's 0.25 s check and a scheduling margin (1 s).
    assert threshold < 10 and silent < threshold + 1.0, ended.group(0)
    summary = job.summary()
    assert summary["world"] == 2 and summary["resets"] == 1, summary
    check_every_sample_once(summary, 2)
    first = float(job.wait_for(r"first commit after reset 1: step \d+ at ([\d.]+)", 1).group(1))
    print(f"SIGSTOP: ended after {ended.group(1)} s of silence; training committed again {first - stopped:.1f} s later")
    assert first - stopped < 15, first - stopped  # detection, the survivors' restore and the new round
    assert gone([pid], 10), "the stopped worker outlived its end"


@pytest.mark.timeout(180)
def test_a_two_second_stop_is_a_pause_not_a_failure(tmp_path: Path) -> None:
    job, _, _ = _stopped_job(tmp_path, 2.0)
    assert job.finish(150) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 3 and summary["resets"] == 0 and summary["restores"] == 0, summary
    check_every_sample_once(summary, 2)
    assert not any("has not reached the job's store" in line for line in job.lines), job.lines[-30:]


@pytest.mark.timeout(120)
def test_a_static_job_names_a_stopped_worker_in_seconds_and_fails_at_the_ceiling() -> None:
    """A static job keeps Horovod's semantics (a lost worker fails it), but a stopped one is no longer found by a
    collective's timeout (600 s by default): shoalrun names its rank and host once the failure detector suspects it,
    and fails the job when it has been silent for the ceiling (8 s here, 30 s by default)."""
    env = {"SHOAL_ELASTIC_UNREACHABLE_SECONDS": "8"}
    job = RunningJob(["-np", "3"], ["--epochs", "20", "--step-delay", "0.05", "--log-every", "5"], env=env)
    pids = job.worker_pids(3)
    job.wait_for(r"^\[0\]<stdout>:step 15 ", 60)
    stopped = time.monotonic()
    subprocess.run(["kill", "-STOP", str(pids[2])], check=True)
    named = job.wait_for(r"shoalrun: rank 2 on host \S+ has not reached the job's store .*: silent for ([\d.]+) s", 20)
    named_after = time.monotonic() - stopped
    assert job.finish(60) != 0
    failed_after = time.monotonic() - stopped
    job.wait_for(r"shoalrun: rank 2 on host \S+ stayed silent; ending the job", 1)
    print(f"static: rank 2 named {named_after:.1f} s after SIGSTOP ({named.group(1)} s silent), failed at {failed_after:.1f} s")
    assert named_after < 8 and failed_after < 20, (named_after, failed_after)
    assert gone(list(pids.values()), 10), "a worker outlived the job"
