"""What real jobs do: a peer busy for five times the stall warning, a peer that stops answering, hundreds of
init/shutdown cycles, bad requests followed by good ones, thousands of collectives in a row (STYLE habit 15)."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

import pytest
import torch

import shoal.torch as hvd
from shoal.testing import run_ranks


class _Captured(logging.Handler):
    """Collects the messages of Shoal's logger in a worker, so that a test can return them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _capture_warnings() -> _Captured:
    from shoal.log import get_logger

    handler = _Captured()
    get_logger().addHandler(handler)
    return handler


# ----- a peer busy for five times the stall warning -----


def _slow_peer(busy_s: float) -> dict[str, object]:
    captured = _capture_warnings()
    hvd.init()
    rank = hvd.rank()
    if rank == 0:
        time.sleep(busy_s)  # evaluation, a checkpoint, slow data
    started = time.monotonic()
    first = hvd.allreduce(torch.full((4,), float(rank + 1)), name="after_the_wait", op=hvd.Sum)
    waited = time.monotonic() - started
    second = hvd.allreduce(torch.full((4,), float(rank + 1)), name="next_step")  # a normal step afterwards
    hvd.barrier()
    return {"first": first.tolist(), "second": second.tolist(), "waited": waited, "warnings": captured.messages}


def test_a_peer_busy_for_five_times_the_stall_warning_is_waited_for_and_reported() -> None:
    """The stall warning is set short (1 s) and the peer is busy for 5 s: what holds for a 60 s warning and a peer busy
    for minutes, without waiting minutes. No rank gives up; the waiting rank's tensor is reported as stalled."""
    env = {"SHOAL_STALL_CHECK_TIME_SECONDS": "1"}
    results = run_ranks(_slow_peer, 2, args=(5.0,), env=env, timeout_s=60)
    for result in results:
        assert result["first"] == [3.0] * 4
        assert result["second"] == [1.5] * 4
    assert results[1]["waited"] >= 4.0  # rank 1 really waited for rank 0, and did not give up
    stall = [m for m in results[0]["warnings"] if "Stall inspector" in m]  # type: ignore[union-attr]
    assert stall, results[0]["warnings"]
    assert "'after_the_wait'" in stall[0] and "not yet by ranks [0]" in stall[0]


# ----- a peer that is alive but whose engine stops answering -----


def _silent_peer(pause_s: float) -> dict[str, object]:
    captured = _capture_warnings()
    hvd.init()
    hvd.allreduce(torch.ones(1), name="warm")
    if hvd.rank() == 1:
        # Stop the whole process (engine thread included), as a debugger or a GIL-holding call would; a helper
        # resumes it. Its peer's engine is then blocked inside a collective, alive but unanswered.
        subprocess.Popen(["sh", "-c", f"sleep {pause_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), 19)  # SIGSTOP
    result = hvd.allreduce(torch.full((2,), float(hvd.rank() + 1)), name="after_the_pause", op=hvd.Sum)
    hvd.barrier()
    return {"result": result.tolist(), "warnings": captured.messages}


@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_a_silent_peer_is_reported_by_the_watch_and_never_crashes_the_waiter(shared_memory: str) -> None:
    env = {"SHOAL_STALL_CHECK_TIME_SECONDS": "2", "SHOAL_HIERARCHICAL_ALLREDUCE": shared_memory}
    results = run_ranks(_silent_peer, 2, args=(7.0,), env=env, timeout_s=60)
    assert [r["result"] for r in results] == [[3.0, 3.0]] * 2
    blocked = [m for m in results[0]["warnings"] if "has been blocked" in m]  # type: ignore[union-attr]
    assert blocked, results[0]["warnings"]
    assert "rank 0" in blocked[0] and "SHOAL_COLLECTIVE_TIMEOUT_SECONDS" in blocked[0]


# ----- init / collectives / a mismatch / barrier / shutdown, a hundred times -----


def _lifecycle(cycles: int) -> list[str]:
    errors = []
    for cycle in range(cycles):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        assert hvd.allreduce(torch.ones(3) * (rank + 1), op=hvd.Sum).tolist() == [3.0] * 3, cycle
        assert hvd.allgather(torch.tensor([rank])).tolist() == list(range(size)), cycle
        assert hvd.broadcast(torch.tensor([rank + 10]), root_rank=1).tolist() == [11], cycle
        try:  # a deliberate mismatch: every rank must get the error, and the engine must go on
            hvd.allreduce(torch.ones(2 + rank), name="mismatched")
            errors.append(f"cycle {cycle}: no error")
        except RuntimeError as error:
            if "Mismatched shapes" not in str(error):
                errors.append(f"cycle {cycle}: {error}")
        assert hvd.allreduce(torch.ones(2), name="after_the_error").tolist() == [1.0, 1.0], cycle
        if cycle % 10 == 0:  # process-set ids are handed out afresh each session
            subset = hvd.add_process_set([1])
            assert subset.process_set_id == 1, cycle
            if subset.included():
                assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=subset).tolist() == [1.0], cycle
        hvd.barrier()
        hvd.shutdown()
    return errors


def test_a_hundred_init_shutdown_cycles_with_errors_in_between() -> None:
    results = run_ranks(_lifecycle, 2, args=(100,), timeout_s=120)
    assert results == [[], []]


def _stale_process_set() -> str:
    hvd.init()
    subset = hvd.add_process_set([0])
    hvd.shutdown()
    hvd.init()
    try:
        hvd.allreduce(torch.ones(1), process_set=subset)
    except ValueError as error:
        return str(error)
    finally:
        hvd.barrier()
    return "no error"


def test_a_process_set_from_before_a_reinit_is_refused() -> None:
    for message in run_ranks(_stale_process_set, 2):
        assert "before the last shutdown()/init()" in message


# ----- thousands of collectives: no growth in memory, threads or file descriptors -----


def _resources() -> tuple[int, int, int]:
    with open("/proc/self/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), threading.active_count(), len(os.listdir("/proc/self/fd"))


def _soak(count: int, warmup: int) -> dict[str, object]:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    grads = [torch.randn(n) for n in (10, 1000, 30000)]
    samples = {}
    for index in range(count):
        kind = index % 5
        if kind == 0:
            handles = [hvd.allreduce_async(g, name=f"g{i}") for i, g in enumerate(grads)]
            for handle in handles:
                hvd.synchronize(handle)
        elif kind == 1:
            assert hvd.allreduce(torch.ones(4), op=hvd.Sum).tolist() == [float(size)] * 4
        elif kind == 2:
            assert hvd.allgather(torch.tensor([rank])).tolist() == list(range(size))
        elif kind == 3:
            hvd.broadcast_(torch.zeros(16), root_rank=0, name="bcast")
        else:
            hvd.grouped_allreduce([torch.ones(3), torch.ones(5)], name=f"grouped.{index % 50}")
        if index + 1 in (warmup, count):
            samples[index + 1] = _resources()
    hvd.barrier()
    return samples


def test_five_thousand_collectives_do_not_grow_memory_threads_or_files() -> None:
    count, warmup = 5000, 1000
    results = run_ranks(_soak, 2, args=(count, warmup), timeout_s=120)
    for rank, samples in enumerate(results):
        (rss_warm, threads_warm, fds_warm), (rss_end, threads_end, fds_end) = samples[warmup], samples[count]
        assert rss_end < rss_warm * 1.10, f"rank {rank}: RSS {rss_warm >> 20} -> {rss_end >> 20} MiB"
        assert threads_end == threads_warm, f"rank {rank}: threads {threads_warm} -> {threads_end}"
        assert fds_end == fds_warm, f"rank {rank}: open files {fds_warm} -> {fds_end}"


# ----- a failure inside one collective fails that collective alone -----


def _one_collective_fails() -> dict[str, object]:
    import shoal.engine.executor as executor

    original = executor._postscale_

    def failing(tensor: torch.Tensor, op: int, postscale: float, members: int) -> None:
        if postscale == 3.0:  # stands for a reduction error after the wire, on every rank
            raise RuntimeError("injected failure")
        original(tensor, op, postscale, members)

    executor._postscale_ = failing
    hvd.init()
    outcome: dict[str, object] = {}
    try:
        hvd.allreduce(torch.ones(2), name="doomed", postscale_factor=3.0)
        outcome["doomed"] = "no error"
    except RuntimeError as error:
        outcome["doomed"] = str(error)
    outcome["next"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="next").tolist()
    hvd.barrier()
    return outcome


def test_a_failure_inside_one_collective_fails_it_alone_and_the_engine_goes_on() -> None:
    # On gloo the scaling runs after the wire (on the shared-memory path it runs inside the collective, each rank
    # on its slice, where a failure is a transport failure).
    for outcome in run_ranks(_one_collective_fails, 2, env={"SHOAL_HIERARCHICAL_ALLREDUCE": "0"}):
        assert "allreduce of 'doomed'" in outcome["doomed"] and "injected failure" in outcome["doomed"]  # type: ignore[operator]
        assert outcome["next"] == [2.0, 2.0]


# ----- the timeline can be started and stopped while the engine works -----


def _toggle_timeline(path: str) -> int:
    import sys

    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so that a check-then-use race shows
    hvd.init()
    stop = threading.Event()

    def toggle() -> None:
        while not stop.is_set():
            hvd.start_timeline(f"{path}.{hvd.rank()}", mark_cycles=True)
            hvd.stop_timeline()

    toggler = threading.Thread(target=toggle)
    toggler.start()
    try:
        for index in range(300):
            assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"t{index % 7}").tolist() == [2.0] * 3
    finally:
        stop.set()
        toggler.join()
    hvd.barrier()
    return 300


def test_starting_and_stopping_the_timeline_never_races_the_engine(tmp_path: os.PathLike[str]) -> None:
    assert run_ranks(_toggle_timeline, 2, args=(str(tmp_path) + "/timeline{rank}",)) == [300, 300]
