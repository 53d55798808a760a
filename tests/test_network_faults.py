"""Network faults between emulated hosts (``shoal.bench.netns --fault``): a link cut for 5 s, a host cut off for
good, and the store unreachable for 5 s, for static and elastic jobs. Each job runs ``examples/elastic_digits.py``
(which also runs as a plain script outside an elastic job); the faults start when the test sends SIGUSR1, once
training is under way. No case may hang, and no worker may outlive its job.

The cases spend most of their time waiting on the network and on timeouts, so the static cases run side by side in
one test and the elastic ones in another (each case in its own thread, on its own emulated hosts); a failure names
its case.

Outcomes (docs/elastic.md, "Network faults"):
- a 5 s cut is a stall for a static job: TCP retransmits carry it on once the link returns;
- a 2 s cut is a stall for an elastic job with the default settings (its failure detector allows a 3 s pause beyond
  the heartbeat's usual interval): nothing is removed or rolled back;
- with ``SHOAL_ELASTIC_UNREACHABLE_SECONDS`` below the cut, an elastic job ends the cut-off worker, goes on without
  it and re-admits its host after its cooldown;
- a host cut off for good fails a static job once it has been silent for the ceiling (shoalrun names its rank and
  host, exit non-zero); an elastic job ends the silent worker and goes on with the rest once the survivors'
  collective times out;
- an unreachable store holds up only what needs it (a commit's round check); the job goes on when it returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import pytest

from conftest import REPO, clean_env, needs_netns
from test_elastic import RunningJob, check_every_sample_once, gone

pytestmark = needs_netns  # the margins (a 5 s cut against 12 s and 3 s limits) hold beside another test

EXAMPLE = [sys.executable, str(REPO / "examples" / "elastic_digits.py"), "--step-delay", "0.05", "--log-every", "5"]
QUICK_FAILURE = {  # the survivors' collective gives up after 12 s, a silent worker is ended after 6 s at the latest
    # (the failure detector's ceiling; set short here: the defaults are 600 s and 30 s)
    "SHOAL_COLLECTIVE_TIMEOUT_SECONDS": "12",
    "SHOAL_STALL_CHECK_TIME_SECONDS": "5",
    "SHOAL_ELASTIC_UNREACHABLE_SECONDS": "6",
}
CUT_PAST_LIMIT = {  # a 5 s cut: the collective timeout stays above the cut and TCP's backoff after it (retransmits
    # at 3 and 6.2 s into the cut)
    "SHOAL_COLLECTIVE_TIMEOUT_SECONDS": "12",
    "SHOAL_STALL_CHECK_TIME_SECONDS": "5",
    "SHOAL_ELASTIC_UNREACHABLE_SECONDS": "3",
}


class EmulatedJob(RunningJob):
    """``python -m shoal.bench.netns FLAGS -- elastic_digits.py ARGS``, read line by line."""

    def __init__(self, flags: list[str], example_args: list[str], env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "shoal.bench.netns", "--faults-on-sigusr1", *flags, "--", *EXAMPLE, *example_args]
        job_env = {**clean_env(), **(env or {})}
        job_env.pop("OMP_NUM_THREADS", None)  # shoalrun divides the cores among all the emulated hosts' ranks
        self.process = subprocess.Popen(
            argv, env=job_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def start_faults_at_step(self, step: int) -> None:
        self.wait_for(rf"^\[0\]<stdout>:step {step} ", 90)
        self.process.send_signal(signal.SIGUSR1)

    def step_time(self, after: float) -> float:
        """When rank 0 first logged a step after ``after`` (a wall-clock time)."""
        for line in self.lines:
            if "<stdout>:step " in line and " at " in line:
                when = float(line.rsplit(" at ", 1)[1])
                if when > after:
                    return when
        raise AssertionError("no step logged after the fault; output:\n" + "\n".join(self.lines[-30:]))

    def fault_time(self, state: str, what: str = ".*") -> float:
        """The wall-clock time a fault (``what``: "link", "store", any) began or ended (``state``), from netns's own
        line."""
        pattern = rf"shoal\.bench\.netns: at [\d.]+ s: .*{what}.* {state} \(([\d.]+)\)"
        return float(self.wait_for(pattern, 60).group(1))

    def finished_as_if_nothing_happened(self, epochs: int) -> None:
        """The job ended with exit 0, all 3 workers, no re-form and no rollback, every sample once per epoch."""
        assert self.finish(120) == 0, "\n".join(self.lines[-30:])
        summary = self.summary()
        assert summary["world"] == 3 and summary["resets"] == 0 and summary["restores"] == 0, summary
        check_every_sample_once(summary, epochs)

    def shared_the_cores(self, ranks: int) -> None:
        """Every rank got the machine's cores divided by all the emulated hosts' ranks, not by its own host's."""
        share = max(1, (os.cpu_count() or 1) // ranks)
        self.wait_for(rf"OMP_NUM_THREADS={share} for each local worker \(\d+ cores / {ranks} workers\)", 1)

    def pids(self) -> list[int]:
        return [int(line.rsplit("worker pid ", 1)[1].split()[0]) for line in self.lines if "<stdout>:worker pid " in line]


def case_a_link_cut_for_five_seconds_is_a_stall_for_a_static_job() -> None:
    job = EmulatedJob(["--hosts", "3", "--fault", "cut:host2:0:5"], ["--epochs", "1"])  # 30 steps, the cut at 20
    job.start_faults_at_step(20)
    came_back = job.fault_time("ends")
    job.finished_as_if_nothing_happened(epochs=1)
    job.shared_the_cores(3)
    resumed = job.step_time(came_back) - came_back
    print(f"static: training resumed {resumed:.1f} s after the link came back")
    assert resumed < 20  # TCP's retransmission backoff after a 5 s loss
    assert gone(job.pids(), 10), "a worker outlived the job"


def case_a_two_second_link_cut_then_store_outage_are_stalls_for_an_elastic_job() -> None:
    """One elastic job with the default failure detector, two faults from step 20: host2's link down for 2 s (a
    blip), then (at 8 s) the route to the store down for 5 s (every worker silent: the store's side at fault). Each
    only holds training up; nothing is re-formed or rolled back."""
    flags = ["--hosts", "3", "--min-np", "2", "--fault", "cut:host2:0:2", "--fault", "store:8:5"]
    # 180 steps: training is still going when the store goes, 3 s after the link is back, even when TCP resumes at
    # once (one run trained 70 steps in 4.6 s).
    job = EmulatedJob(flags, ["--epochs", "6"])
    job.start_faults_at_step(20)
    link_back = job.fault_time("ends", "link")
    store_back = job.fault_time("ends", "store")
    job.finished_as_if_nothing_happened(epochs=6)
    job.shared_the_cores(3)
    resumed = job.step_time(link_back) - link_back
    print(f"elastic: training resumed {resumed:.1f} s after the link came back")
    print(f"store back: training logged its next step {job.step_time(store_back) - store_back:.1f} s later")
    assert resumed < 20
    assert job.step_time(store_back) - store_back < 20
    assert gone(job.pids(), 10), "a worker outlived the job"


def case_a_link_cut_past_the_unreachable_limit_removes_the_host_and_its_cooldown_readmits_it() -> None:
    flags = ["--hosts", "3", "--min-np", "2", "--blacklist-cooldown-range", "1", "2", "--fault", "cut:host2:0:5"]
    # A survivor only receiving from the ended worker when the link returns never learns of its death (its RST was
    # lost in the cut) and waits for the collective timeout: 12 s here, not the default 600 s.
    # --wait-for-world 3: the survivors wait at a commit without host2 until its new worker has joined
    job = EmulatedJob(flags, ["--epochs", "3", "--wait-for-world", "3"], env=CUT_PAST_LIMIT)
    job.start_faults_at_step(20)
    job.wait_for(r"worker host2#3 \(rank 2\) on host host2 has not reached the job's store .*: silent for [\d.]+ s", 30)
    job.wait_for(r"re-forming the job with 3 workers \(new workers are ready to join\)", 60)
    assert job.finish(120) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    # Without host2, then with its new worker; the round without it may be superseded before it forms (the survivors
    # are blocked until the link returns, and by then the cooldown may be over), and such a round is no reset.
    assert summary["world"] == 3 and summary["resets"] in (1, 2), summary
    check_every_sample_once(summary, 3)
    assert gone(job.pids(), 10), "a worker outlived the job"


def case_a_host_cut_off_for_good_fails_a_static_job_at_the_silence_ceiling() -> None:
    """shoalrun names the cut-off rank once the failure detector suspects it, and fails the job when it has been
    silent for the ceiling (6 s here), before the collective's timeout (12 s here, 600 s by default)."""
    job = EmulatedJob(["--hosts", "2", "--fault", "cut:host1:0:forever"], ["--epochs", "20"], env=QUICK_FAILURE)
    job.start_faults_at_step(20)
    cut = job.fault_time("begins")
    code = job.finish(120)
    assert code != 0
    job.wait_for(r"shoalrun: rank 1 on host host1 has not reached the job's store .*: silent for [\d.]+ s", 1)
    job.wait_for(r"shoalrun: rank 1 on host host1 stayed silent; ending the job", 1)
    assert gone(job.pids(), 10), "a worker outlived the job"
    print(f"static job, host cut off for good: shoalrun exited {code}; the cut began at {cut:.1f}")


def case_a_host_cut_off_for_good_leaves_an_elastic_job_with_the_rest() -> None:
    flags = ["--hosts", "3", "--min-np", "2", "--fault", "cut:host2:0:forever"]
    job = EmulatedJob(flags, ["--epochs", "2"], env=QUICK_FAILURE)
    job.start_faults_at_step(20)
    cut = job.fault_time("begins")
    job.wait_for(r"worker host2#3 \(rank 2\) on host host2 has not reached the job's store", 40)
    assert job.finish(120) == 0, "\n".join(job.lines[-30:])
    summary = job.summary()
    assert summary["world"] == 2 and summary["resets"] == 1 and summary["restores"] == 1, summary
    check_every_sample_once(summary, 2)
    first_commit = float(job.wait_for(r"first commit after reset 1: step \d+ at ([\d.]+)", 1).group(1))
    print(f"elastic job, host cut off for good: going on with 2 workers {first_commit - cut:.1f} s after the cut")
    assert gone(job.pids(), 10), "a worker outlived the job"


def run_side_by_side(cases: list[Callable[[], None]], timeout_s: float) -> None:
    """Run every case in its own thread; fail with each failing case's name and traceback."""
    failures: dict[str, str] = {}

    def run(case: Callable[[], None]) -> None:
        try:
            case()
        except BaseException:  # any failure, reported below with the case's name
            failures[case.__name__] = traceback.format_exc()

    threads = [threading.Thread(target=run, args=(case,), daemon=True) for case in cases]
    for thread in threads:
        thread.start()
        time.sleep(2)  # staggered: each job starts its workers (torch imports) while the previous one trains
    deadline = time.monotonic() + timeout_s
    for thread, case in zip(threads, cases, strict=True):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            failures[case.__name__] = f"did not finish within {timeout_s:.0f} s"
    assert not failures, "\n\n".join(f"{name}:\n{text}" for name, text in failures.items())


@pytest.mark.timeout(220)
def test_static_jobs_stall_through_a_five_second_cut_and_fail_clearly_on_a_host_lost_for_good() -> None:
    run_side_by_side(
        [
            case_a_link_cut_for_five_seconds_is_a_stall_for_a_static_job,
            case_a_host_cut_off_for_good_fails_a_static_job_at_the_silence_ceiling,
        ],
        timeout_s=200,
    )


@pytest.mark.timeout(220)
def test_elastic_jobs_ride_out_cuts_and_a_store_outage_and_go_on_without_a_lost_host() -> None:
    run_side_by_side(
        [
            case_a_two_second_link_cut_then_store_outage_are_stalls_for_an_elastic_job,
            case_a_link_cut_past_the_unreachable_limit_removes_the_host_and_its_cooldown_readmits_it,
            case_a_host_cut_off_for_good_leaves_an_elastic_job_with_the_rest,
        ],
        timeout_s=200,
    )
