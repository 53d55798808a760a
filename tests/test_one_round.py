"""The one-round cycle (``shoal.engine.one_round``): a repeating cached set of small allreduces sends its readiness
with its data. Every test checks values against what the allreduce must give, and that one-round cycles ran."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

import shoal.torch as hvd
from shoal.core import session
from shoal.exceptions import CollectiveMismatchError
from shoal.testing import run_ranks

pytestmark = pytest.mark.check

PATHS = {"shm": {}, "gloo": {"SHOAL_HIERARCHICAL_ALLREDUCE": "0"}}
"""One host reduces through shared memory by default; with it off, the one round goes over gloo as between hosts."""

STEPS = 40

KINDS = {
    "float32-average": (torch.float32, hvd.Average, 1.0, 1.0),
    "int64-sum": (torch.int64, hvd.Sum, 1.0, 1.0),
    "float64-scaled": (torch.float64, hvd.Sum, 2.0, 0.25),
}
"""A set fuses into one buffer only with one dtype, op and scaling, so each kind is its own run."""


def _inputs(rank: int, step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [
        (torch.arange(6) * (rank + 1) + step).to(dtype),
        torch.full((3,), rank * 7 + step).to(dtype),
        (torch.arange(5) - 2).to(dtype) * (rank - step),
    ]


def _repeating(kind: str, jitter: bool) -> dict[str, object]:
    """Three cached allreduces per step; with ``jitter`` each rank pauses at random between its submissions, so
    some one-round cycles see only part of the set on some rank (that part is dropped and sent again)."""
    hvd.init()
    dtype, op, prescale, postscale = KINDS[kind]
    rng = random.Random(hvd.rank() * 1000 + 1)
    results = []
    for step in range(STEPS):
        handles = []
        for index, tensor in enumerate(_inputs(hvd.rank(), step, dtype)):
            if jitter and rng.random() < 0.4:
                time.sleep(rng.random() * 0.004)
            name = f"t{index}"
            handles.append(hvd.allreduce_async(tensor, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale))
        results.append([hvd.synchronize(h).tolist() for h in handles])
    return {"results": results, "one_round": session.engine().one_round_cycles}


def _expected(kind: str, size: int) -> list[list[torch.Tensor]]:
    _, op, prescale, postscale = KINDS[kind]
    expected = []
    for step in range(STEPS):
        per_rank = [_inputs(rank, step, torch.float64) for rank in range(size)]
        sums = [sum(p[i] * prescale for p in per_rank) * postscale for i in range(3)]
        expected.append([s / size if op == hvd.Average else s for s in sums])
    return expected


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("size", [2, 3])
def test_repeating_cached_allreduces_take_one_round_and_give_the_allreduce(path: str, kind: str, size: int) -> None:
    for result in run_ranks(_repeating, size, args=(kind, True), env=PATHS[path]):
        assert result["one_round"] > STEPS // 2, result["one_round"]
        for got, want in zip(result["results"], _expected(kind, size), strict=True):
            for values, reference in zip(got, want, strict=True):
                assert torch.allclose(torch.tensor(values, dtype=torch.float64), reference, atol=1e-5), (values, reference)


def test_two_ranks_are_bit_identical_with_and_without_the_one_round_cycle() -> None:
    on = run_ranks(_repeating, 2, args=("float32-average", False))
    off = run_ranks(_repeating, 2, args=("float32-average", False), env={"SHOAL_ONE_ROUND_CYCLES": "0"})
    assert on[0]["one_round"] > STEPS // 2 and off[0]["one_round"] == 0
    assert [r["results"] for r in on] == [r["results"] for r in off]


def _changes_while_armed() -> dict[str, object]:
    """Arm on "x", then: a new name, a new shape under "x" on every rank, a join by the others."""
    hvd.init()
    eng = session.engine()
    for step in range(10):
        hvd.allreduce(torch.full((4,), float(step)), name="x", op=hvd.Sum)
    armed = eng.one_round_cycles
    new_name = hvd.allreduce(torch.ones(2), name="y", op=hvd.Sum).tolist()
    reshaped = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), name="x", op=hvd.Sum).tolist()
    for _ in range(5):
        hvd.allreduce(torch.ones(3), name="x", op=hvd.Sum)
    uneven = []
    if hvd.rank() == 0:
        for _ in range(3):
            uneven.append(hvd.allreduce(torch.ones(3), name="x", op=hvd.Sum).tolist())
    return {"armed": armed, "new": new_name, "reshaped": reshaped, "uneven": uneven, "join": hvd.join()}


def test_a_new_name_a_new_shape_and_a_join_while_armed() -> None:
    results = run_ranks(_changes_while_armed, 3)
    for rank, result in enumerate(results):
        assert result["armed"] > 0
        assert result["new"] == [3.0, 3.0]
        assert result["reshaped"] == [6.0, 6.0, 6.0]
        assert result["uneven"] == ([[1.0, 1.0, 1.0]] * 3 if rank == 0 else [])  # joined ranks add zeros
        assert result["join"] == 0


def _mismatch_while_armed() -> str:
    hvd.init()
    for _ in range(10):
        hvd.allreduce(torch.ones(4), name="x", op=hvd.Sum)
    try:
        hvd.allreduce(torch.ones(4 + hvd.rank()), name="x", op=hvd.Sum)
    except CollectiveMismatchError as error:
        return str(error)
    return "no error"


def test_a_mismatch_while_armed_is_the_usual_error_on_every_rank() -> None:
    for message in run_ranks(_mismatch_while_armed, 2, timeout_s=30):
        assert "x" in message and "shape" in message


def _stall_while_armed() -> str:
    hvd.init()
    for _ in range(10):
        hvd.allreduce(torch.ones(1), name="x")
    if hvd.rank() == 1:
        time.sleep(4)
        return "skipped"
    try:
        hvd.allreduce(torch.ones(1), name="x")
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_the_stall_inspector_still_ends_a_stall_while_armed() -> None:
    env = {"SHOAL_STALL_CHECK_TIME_SECONDS": "0.5", "SHOAL_STALL_SHUTDOWN_TIME_SECONDS": "1.5"}
    results = run_ranks(_stall_while_armed, 2, env=env)
    assert "Stall inspector" in results[0] and "'x'" in results[0]


def _threads_block_and_submit_at_once() -> dict[str, object]:
    """Three threads make blocking calls while a fourth keeps async requests in flight: one thread at a time runs
    the cycles, and every call gets its own value."""
    import threading

    hvd.init()
    rank = hvd.rank()
    errors: list[str] = []

    def blocking(index: int) -> None:
        for step in range(25):
            got = hvd.allreduce(torch.full((3,), float(rank + index + step)), name=f"b{index}", op=hvd.Sum)
            want = float(sum(r + index + step for r in range(hvd.size())))
            if got.tolist() != [want] * 3:
                errors.append(f"b{index} step {step}: {got.tolist()} != {want}")

    def asynchronous() -> None:
        for step in range(25):
            handles = [hvd.allreduce_async(torch.ones(2) * (rank + i), name=f"a{i}", op=hvd.Sum) for i in range(4)]
            for i, handle in enumerate(handles):
                got = hvd.synchronize(handle).tolist()
                want = float(sum(r + i for r in range(hvd.size())))
                if got != [want] * 2:
                    errors.append(f"a{i} step {step}: {got} != {want}")

    threads = [threading.Thread(target=blocking, args=(i,)) for i in range(3)] + [threading.Thread(target=asynchronous)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return {"errors": errors, "alive": sum(t.is_alive() for t in threads), "caller_cycles": session.engine().caller_cycles}


def test_blocking_calls_on_several_threads_run_cycles_one_at_a_time() -> None:
    for result in run_ranks(_threads_block_and_submit_at_once, 2, timeout_s=90):
        assert result["errors"] == [] and result["alive"] == 0
        assert result["caller_cycles"] > 0  # the calling threads ran cycles themselves


def test_the_timeline_shows_one_allreduce_per_completed_request(tmp_path: Path) -> None:
    """A round that carried only part of the set leaves no allreduce on the other requests' rows."""
    import json

    env = {"SHOAL_TIMELINE": str(tmp_path / "tl-{rank}.json")}
    run_ranks(_repeating, 2, args=("float32-average", True), env=env)
    for rank in (0, 1):
        events = json.loads((tmp_path / f"tl-{rank}.json").read_text())
        rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        for tensor in ("t0", "t1", "t2"):
            begins = [e for e in events if e["ph"] == "B" and e["name"] == "ALLREDUCE" and rows.get(e["tid"]) == tensor]
            assert len(begins) == STEPS, (rank, tensor, len(begins))
            assert any(e.get("args", {}).get("one_round") for e in begins)


def _rotating_names() -> dict[str, object]:
    """Blocking calls on a, b, c in turn: two cycles in a row complete {a} then {b}, which arms on {a, b}; but the
    next call is c, so that bet loses a round. Each such set is tried once at most, then left alone."""
    hvd.init()
    got = []
    for step in range(30):
        for name in ("a", "b", "c"):
            got.append(hvd.allreduce(torch.full((2,), float(step)), name=name, op=hvd.Sum)[0].item())
    return {"values": got, "one_round": session.engine().one_round_cycles}


def test_a_set_whose_bets_lose_is_not_armed_again() -> None:
    for result in run_ranks(_rotating_names, 2):
        assert result["values"] == [2.0 * step for step in range(30) for _ in range(3)]
        assert result["one_round"] <= 6, result["one_round"]


def _empty_tensors() -> dict[str, object]:
    """A repeating set of empty tensors (0 elements in all) beside the usual rounds: the set still arms and completes."""
    hvd.init()
    shapes = []
    for _ in range(STEPS):
        handles = [hvd.allreduce_async(torch.zeros(0), name=f"e{i}", op=hvd.Sum) for i in range(2)]
        shapes.append([tuple(hvd.synchronize(h).shape) for h in handles])
    share = session.engine().execution("e0")
    return {"shapes": shapes, "one_round": session.engine().one_round_cycles, "share": share}


def test_a_set_of_empty_tensors_takes_one_round_too() -> None:
    for result in run_ranks(_empty_tensors, 2):
        assert result["shapes"] == [[(0,), (0,)]] * STEPS
        assert result["one_round"] > 0
        seconds, elements, total = result["share"]
        assert (elements, total) == (0, 0) and seconds >= 0
