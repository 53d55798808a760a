"""Engine behaviour: submission order, mismatches, duplicate names, fusion, cache, stalls, timeline, join,
process sets, shutdown and re-init."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shoal.torch as hvd
from shoal.core import session as handles
from shoal.engine.timeline import load_timeline
from shoal.testing import MultiRankError, run_ranks

pytestmark = pytest.mark.check  # the quick tier: make check


def _reverse_order() -> list[list[float]]:
    hvd.init()
    names = [f"t{i}" for i in range(20)]
    order = names if hvd.rank() % 2 == 0 else list(reversed(names))
    submitted = {n: hvd.allreduce_async(torch.full((4,), float(int(n[1:]) + hvd.rank())), name=n) for n in order}
    return [hvd.synchronize(submitted[n]).tolist() for n in names]


def test_ranks_may_submit_in_different_orders() -> None:
    for result in run_ranks(_reverse_order, 3):
        assert result == [[float(i + 1)] * 4 for i in range(20)]  # mean of i, i+1, i+2


MISMATCHES = {
    "shape": lambda r: hvd.allreduce(torch.ones(2 + r), name="x"),
    "dtype": lambda r: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r else torch.float64), name="x"),
    "op": lambda r: hvd.allreduce(torch.ones(2), name="x", op=hvd.Sum if r else hvd.Max),
    "root": lambda r: hvd.broadcast(torch.ones(2), root_rank=r, name="x"),
    "prescale": lambda r: hvd.allreduce(torch.ones(2), name="x", prescale_factor=1.0 + r),
    "postscale": lambda r: hvd.allreduce(torch.ones(2), name="x", postscale_factor=1.0 + r),
    "operation": lambda r: hvd.allreduce(torch.ones(2), name="x") if r else hvd.allgather(torch.ones(2), name="x"),
    "allgather trailing shape": lambda r: hvd.allgather(torch.ones(2, 1 + r), name="x"),
}
EXPECTED_WORDS = {
    "shape": "shapes",
    "dtype": "data types",
    "op": "reduce ops",
    "root": "root ranks",
    "prescale": "prescale",
    "postscale": "postscale",
    "operation": "operations",
    "allgather trailing shape": "beyond the first dimension",
}


def _mismatches() -> dict[str, tuple[str, float]]:
    hvd.init()
    seen = {}
    for kind, call in MISMATCHES.items():
        start = time.monotonic()
        try:
            call(hvd.rank())
            seen[kind] = ("no error", 0.0)
        except RuntimeError as error:
            seen[kind] = (str(error), time.monotonic() - start)
        # The process stays usable after every mismatch, with the cache on.
        assert hvd.allreduce(torch.ones(1), name="after", op=hvd.Sum).item() == hvd.size()
    return seen


def test_every_mismatch_is_a_clear_error_on_every_rank_and_recoverable() -> None:
    for seen in run_ranks(_mismatches, 2):
        for kind, (message, elapsed) in seen.items():
            assert "tensor 'x'" in message and EXPECTED_WORDS[kind] in message, (kind, message)
            assert "rank 0" in message and "rank 1" in message, message
            assert elapsed < 1.0, f"{kind}: the error took {elapsed:.2f} s"


def _cached_then_changed() -> list[object]:
    hvd.init()
    out: list[object] = [hvd.allreduce(torch.ones(3), name="grad", op=hvd.Sum).tolist() for _ in range(3)]
    try:  # rank 1 changes the shape of a cached tensor: still a clean error, not a hang
        hvd.allreduce(torch.ones(3 if hvd.rank() == 0 else 4), name="grad")
        out.append("no error")
    except RuntimeError as error:
        out.append(str(error))
    out.append(hvd.allreduce(torch.ones(5), name="grad", op=hvd.Sum).tolist())
    return out


def test_cached_tensor_changing_shape_is_caught() -> None:
    for out in run_ranks(_cached_then_changed, 2):
        assert out[:3] == [[2.0] * 3] * 3
        assert "Mismatched shapes for tensor 'grad'" in str(out[3])
        assert out[4] == [2.0] * 5


def _duplicate_name() -> str:
    hvd.init()
    handle = hvd.allreduce_async(torch.ones(1), name="dup")
    try:
        hvd.allreduce_async(torch.ones(1), name="dup")
        message = "no error"
    except ValueError as error:
        message = str(error)
    hvd.synchronize(handle)
    return message


def test_duplicate_in_flight_names_raise_value_error() -> None:
    for message in run_ranks(_duplicate_name, 2):
        assert "'dup' is already in flight" in message


def _fusion(threshold: int) -> tuple[int, list[float]]:
    hvd.init()
    engine = handles.engine()
    before = engine.collective_calls
    results = hvd.grouped_allreduce([torch.ones(256) * i for i in range(16)], op=hvd.Sum)  # 16 x 1 KiB
    return engine.collective_calls - before, [float(r[0]) for r in results]


def test_fusion_packs_ready_tensors_up_to_the_threshold() -> None:
    fused = run_ranks(_fusion, 2, args=(64 * 1024 * 1024,))
    split = run_ranks(_fusion, 2, args=(4096,), env={"SHOAL_FUSION_THRESHOLD": "4096"})
    for calls, values in fused:
        assert calls == 1 and values == [2.0 * i for i in range(16)]
    for calls, values in split:
        assert calls == 4 and values == [2.0 * i for i in range(16)]  # 4 tensors of 1 KiB per 4 KiB buffer


def _steady_cycles() -> tuple[int, int]:
    hvd.init()
    engine = handles.engine()
    for _ in range(5):
        hvd.allreduce(torch.ones(4), name="steady")
    cached_before = len(engine.cycle.cache)
    return cached_before, int(hvd.allreduce(torch.ones(1), name="probe", op=hvd.Sum).item())


def test_response_cache_disabled_still_works() -> None:
    assert run_ranks(_steady_cycles, 2, env={"SHOAL_CACHE_CAPACITY": "0"}) == [(0, 2), (0, 2)]
    assert run_ranks(_steady_cycles, 2) == [(1, 2), (1, 2)]


def _quiet_cycles(seconds: float) -> tuple[int, float]:
    hvd.init()
    engine = handles.engine()
    hvd.allreduce(torch.ones(4), name="before")
    start = engine.cycle.cycles
    time.sleep(seconds)
    idle = engine.cycle.cycles - start
    return idle, float(hvd.allreduce(torch.ones(1), name="after", op=hvd.Sum).item())


@pytest.mark.timeout(120)
def test_a_quiet_job_s_engines_cycle_less_often_and_still_answer_at_once() -> None:
    """An idle engine joins a cycle every 20 ms (a round trip over every host's link); after 10 cycles in which
    nothing completed anywhere, its pause doubles up to the quiet cycle time (200 ms): 2 s of quiet take about 10 +
    3 + 8 cycles instead of 100. The first collective after it still completes (each rank's submission wakes its
    engine). A loaded machine only makes cycles fewer, so the bound on the quiet job's count holds there too."""
    quiet = run_ranks(_quiet_cycles, 2, args=(2.0,))
    steady = run_ranks(_quiet_cycles, 2, args=(2.0,), env={"SHOAL_QUIET_CYCLE_TIME": "20"})
    for (cycles, value), (steady_cycles, steady_value) in zip(quiet, steady, strict=True):
        assert value == steady_value == 2.0
        assert cycles <= 30 < 40 <= steady_cycles, (cycles, steady_cycles)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _stall_warning() -> list[str]:
    from shoal.log import get_logger

    capture = _Capture()
    get_logger().addHandler(capture)
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(2.5)
    hvd.allreduce(torch.ones(1), name="late.tensor")
    return capture.messages


def test_stall_warning_names_the_tensor_and_the_missing_ranks() -> None:
    env = {"SHOAL_STALL_CHECK_TIME_SECONDS": "1"}
    messages = run_ranks(_stall_warning, 3, env=env)[0]
    assert any("'late.tensor'" in m and "ranks [0, 2]" in m and "not yet by ranks [1]" in m for m in messages), messages


def _stall_shutdown() -> str:
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(4)
        return "skipped"
    try:
        hvd.allreduce(torch.ones(1), name="never")
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_stall_shutdown_time_turns_the_stall_into_an_error() -> None:
    env = {"SHOAL_STALL_CHECK_TIME_SECONDS": "0.5", "SHOAL_STALL_SHUTDOWN_TIME_SECONDS": "1.5"}
    results = run_ranks(_stall_shutdown, 2, env=env)
    assert "Stall inspector" in results[0] and "'never'" in results[0]


def _timeline(path: str) -> None:
    hvd.init()
    for _ in range(3):
        hvd.grouped_allreduce([torch.ones(8), torch.ones(4)], name="grads")
    hvd.allgather(torch.ones(2), name="gathered")
    hvd.start_timeline(path + ".runtime", mark_cycles=True)
    hvd.broadcast(torch.ones(2), root_rank=0, name="runtime.bcast")
    hvd.stop_timeline()


def test_timeline_is_valid_chrome_trace_json(tmp_path: Path) -> None:
    import json

    path = str(tmp_path / "timeline.json")
    run_ranks(_timeline, 2, args=(path,), env={"SHOAL_TIMELINE": path})  # rank 0 writes it, as in Horovod
    events = json.loads(Path(path).read_text())  # the finished file is plain JSON
    phases = {e["name"] for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "SHM_ALLREDUCE"} <= phases  # one host
    assert {"MEMCPY_OUT_FUSION_BUFFER", "NEGOTIATE_ALLGATHER", "ALLGATHER"} <= phases
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"grads.0", "grads.1", "gathered"} <= rows
    runtime = json.loads(Path(path + ".runtime").read_text())
    assert any(e["name"] == "CYCLE_START" for e in runtime) and any(e["name"] == "BROADCAST" for e in runtime)
    assert {e["pid"] for e in events} == {0}
    # A file cut off mid-write (a killed job) still loads, minus the partial line.
    text = Path(path).read_text()
    truncated = tmp_path / "killed.json"
    truncated.write_text(text[: len(text) // 2])
    assert 0 < len(load_timeline(str(truncated))) < len(events)


def _uneven_join() -> tuple[list[float], int]:
    hvd.init()
    results = []
    steps = 3 if hvd.rank() == 0 else 1
    for step in range(steps):
        results.append(hvd.allreduce(torch.full((2,), float(hvd.rank() + 1)), name=f"step{step}", op=hvd.Sum)[0].item())
    return results, hvd.join()


def test_join_lets_ranks_with_less_work_stop() -> None:
    results = run_ranks(_uneven_join, 3)
    assert results[0] == ([6.0, 1.0, 1.0], 0)  # after the others joined, only rank 0 contributes
    assert results[1] == ([6.0], 0) and results[2] == ([6.0], 0)


def _process_sets() -> dict[str, object]:
    hvd.init()
    evens = hvd.add_process_set([0, 2])
    out: dict[str, object] = {"included": evens.included(), "id": evens.process_set_id}
    if evens.included():
        out["sum"] = hvd.allreduce(torch.ones(1) * hvd.rank(), op=hvd.Sum, process_set=evens).item()
        out["gather"] = hvd.allgather(torch.ones(1) * hvd.rank(), process_set=evens).tolist()
        out["set_rank"] = evens.rank()
    out["world"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    try:
        hvd.add_process_set([0, 2])
    except ValueError as error:
        out["duplicate"] = str(error)
    out["removed"] = hvd.remove_process_set(evens)
    return out


def test_process_sets() -> None:
    results = run_ranks(_process_sets, 3)
    for rank, out in enumerate(results):
        assert out["included"] == (rank != 1) and out["id"] == 1 and out["world"] == 3.0
        assert "already exists" in str(out["duplicate"]) and out["removed"] is True
        if rank != 1:
            assert out["sum"] == 2.0 and out["gather"] == [0.0, 2.0] and out["set_rank"] == rank // 2


def _shutdown_fails_pending() -> str:
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(0.5)
        hvd.shutdown()
        return "shut down"
    handle = hvd.allreduce_async(torch.ones(1), name="orphan")
    try:
        hvd.synchronize(handle)
    except RuntimeError as error:
        message = str(error)
    try:
        hvd.allreduce(torch.ones(1))
    except RuntimeError as error:
        message += " | " + str(error)
    return message


def test_shutdown_fails_pending_handles_instead_of_hanging() -> None:
    message = run_ranks(_shutdown_fails_pending, 2, timeout_s=30)[0]
    assert "shut down" in message and "not running" in message


def _reinit_collectives() -> list[float]:
    values = []
    for _ in range(3):
        hvd.init()
        values.append(hvd.allreduce(torch.ones(1), name="same", op=hvd.Sum).item())
        hvd.shutdown()
    return values


def test_shutdown_then_init_runs_collectives_again() -> None:
    assert run_ranks(_reinit_collectives, 2) == [[2.0] * 3] * 2


def _bad_input() -> list[str]:
    hvd.init()
    errors = []
    for call in (
        lambda: hvd.allreduce([1, 2]),
        lambda: hvd.allreduce(torch.ones(1, dtype=torch.int32), op=hvd.Adasum),
        lambda: hvd.alltoall(torch.ones(3), splits=[1, 1]),
        lambda: hvd.synchronize(123456),
        lambda: hvd.reducescatter(torch.ones(2), op=hvd.Max),
        lambda: hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum),
    ):
        try:
            call()
            errors.append("no error")
        except (TypeError, ValueError, RuntimeError) as error:
            errors.append(type(error).__name__)
    return errors


def test_bad_input_gets_clear_errors() -> None:
    errors = run_ranks(_bad_input, 2)[0]
    # Horovod's torch raises reducescatter with an op other than Sum and Average as a RuntimeError.
    assert errors == ["TypeError", "TypeError", "ValueError", "ValueError", "UnsupportedOperationError", "ValueError"]


def test_api_before_init_raises() -> None:
    def call() -> None:
        hvd.allreduce(torch.ones(1))

    if hvd.is_initialized():
        pytest.skip("this test process is initialized")
    with pytest.raises(ValueError, match="not been initialized"):
        call()


def _rank_dies() -> str:
    hvd.init()
    hvd.allreduce(torch.ones(1), name="warmup")
    if hvd.rank() == 1:
        os._exit(3)
    try:
        hvd.allreduce(torch.ones(1), name="after.death")
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_dead_peer_is_an_error_not_a_hang() -> None:
    with pytest.raises(MultiRankError) as failure:
        run_ranks(_rank_dies, 2, timeout_s=60)
    outcomes = failure.value.outcomes
    assert outcomes[1].exitcode == 3
    assert outcomes[0].error is None and "engine failed" in str(outcomes[0].result)


def _failed_rank_lingers() -> float:
    """Rank 1's engine fails while rank 0 waits for it in a collective; rank 1 then stays alive for 6 s."""
    hvd.init()
    hvd.allreduce(torch.ones(3), name="warmup")
    if hvd.rank() == 1:

        def broken_cycle() -> tuple[bool, BaseException | None]:
            raise RuntimeError("injected engine failure")

        handles.engine().cycle.run = broken_cycle  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected engine failure"):
            hvd.allreduce(torch.ones(3), name="x")
        hvd.shutdown()
        time.sleep(6)  # twice the wait the test allows rank 0: only the release lets it finish in time
        return 0.0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="engine failed"):
        hvd.allreduce(torch.ones(3), name="x")
    return time.monotonic() - start


@pytest.mark.parametrize("shared_memory", ["0", "1"])
def test_a_failed_engine_releases_peers_blocked_on_it_at_once(shared_memory: str) -> None:
    # Without the release, rank 0 waits until rank 1's process exits (6 s here; the gloo timeout, 300 s, in general).
    waited_s, _ = run_ranks(_failed_rank_lingers, 2, env={"SHOAL_HIERARCHICAL_ALLREDUCE": shared_memory}, timeout_s=60)
    assert waited_s < 3.0, f"rank 0 waited {waited_s:.1f} s for a rank whose engine had failed"


def test_a_request_latch_wakes_every_waiter_once_set_and_times_out_before() -> None:
    """``Request.done`` (a ``Latch``): waits time out while unset; one set wakes every waiter, now and later; a
    second set, even racing the first, changes nothing."""
    import threading

    from shoal.engine.request import Latch

    latch = Latch()
    assert not latch.is_set()
    started = time.monotonic()
    assert latch.wait(0.05) is False and time.monotonic() - started >= 0.04
    woken: list[bool] = []
    waiters = [threading.Thread(target=lambda: woken.append(latch.wait(10))) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)
    assert woken == []
    setters = [threading.Thread(target=latch.set) for _ in range(2)]
    for setter in setters:
        setter.start()
    for thread in setters + waiters:
        thread.join(5)
    assert woken == [True] * 4 and latch.is_set()
    latch.set()
    assert latch.wait() is True and latch.wait(0) is True


# ----- a process that ends with an abandoned engine thread -----

_GUARDED = """
import atexit, sys, threading, time
from shoal.engine import exit_guard
atexit.register(print, "finalized")  # runs only if the interpreter finalizes
thread = threading.Thread(target=time.sleep, args=({sleep},), daemon=True)
thread.start()
exit_guard.arm(thread)
print("work done", flush=False)
if {sleep} == 0:
    thread.join()  # the thread has ended by the time the process does
{end}
"""


@pytest.mark.parametrize(
    ("end", "sleep", "status"),
    [("sys.exit(3)", 30, 3), ("raise ValueError('late')", 30, 1), ("pass", 30, 0), ("sys.exit(3)", 0, 3)],
)
def test_a_process_left_with_an_abandoned_thread_exits_with_its_own_status(end: str, sleep: int, status: int) -> None:
    """Armed, the guard ends the process at exit without finalization while the thread lives, with the status it
    was exiting with and its output flushed; once the thread has ended, the process finalizes as usual."""
    script = _GUARDED.format(sleep=sleep, end=end)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert done.stdout == ("work done\n" if sleep else "work done\nfinalized\n")  # flushed, not finalized
    assert ("ValueError: late" in done.stderr) == (status == 1)
