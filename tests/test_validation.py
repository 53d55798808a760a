"""Single-process checks of request validation, device negotiation, the engine's waits and the collective watch."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shoal.core.requests import Call, build_meta
from shoal.core.rules import ReduceSpec
from shoal.engine.config import EngineConfig
from shoal.engine.cycle import Pauses, pause_ms
from shoal.engine.engine import Engine
from shoal.engine.negotiation import find_mismatch
from shoal.engine.request import Kind, ReduceOp, RequestMeta
from shoal.engine.stall import CollectiveWatch
from shoal.engine.validation import MOVABLE_DTYPES, REDUCING_DTYPES, check_request
from shoal.exceptions import UnsupportedOperationError

pytestmark = pytest.mark.check  # the quick tier: make check


def meta(dtype: str = "float32", kind: Kind = Kind.ALLREDUCE, op: ReduceOp | None = ReduceOp.Sum, **fields: Any) -> RequestMeta:
    return RequestMeta(
        name="t", kind=kind, process_set=0, dtype=dtype, shape=(2,), op=None if op is None else int(op), **fields
    )


@pytest.mark.parametrize("dtype", MOVABLE_DTYPES)
def test_every_fixed_width_dtype_passes_for_data_movement(dtype: str) -> None:
    for kind in (Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL):
        check_request(meta(dtype, kind, op=None))


def test_movable_dtypes_include_the_unsigned_and_float8_ones() -> None:
    assert {"uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"} <= set(MOVABLE_DTYPES)
    assert set(REDUCING_DTYPES) < set(MOVABLE_DTYPES)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64", "float8_e4m3fn", "complex32"])
def test_reductions_without_arithmetic_raise_type_error_naming_the_tensor(dtype: str) -> None:
    for kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
        with pytest.raises(
            TypeError, match=rf"tensor 't': dtype {dtype} has no reduction arithmetic here; reductions take uint8"
        ):
            check_request(meta(dtype, kind))


def test_a_dtype_nothing_carries_is_refused_by_every_op() -> None:
    for kind in (Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL):
        with pytest.raises(TypeError, match=r"tensor 't': dtype qint8 is not supported; supported dtypes: uint8"):
            check_request(meta("qint8", kind, op=ReduceOp.Sum if kind == Kind.ALLREDUCE else None))


@pytest.mark.parametrize(
    ("dtype", "op", "error", "text"),
    [
        ("bool", ReduceOp.Sum, TypeError, "Sum is not defined for bool"),
        ("bool", ReduceOp.Average, TypeError, "Average is not defined for bool"),
        ("complex64", ReduceOp.Min, TypeError, "Min is not defined for complex"),
        ("complex128", ReduceOp.Product, TypeError, "Product is not defined for complex"),
        ("int32", ReduceOp.Adasum, TypeError, "Adasum combines floating-point tensors only"),
    ],
)
def test_reductions_undefined_for_a_dtype_are_refused(dtype: str, op: ReduceOp, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        check_request(meta(dtype, op=op))


def test_bool_min_max_product_and_complex_sums_pass() -> None:
    for op in (ReduceOp.Min, ReduceOp.Max, ReduceOp.Product):
        check_request(meta("bool", op=op))
    for op in (ReduceOp.Sum, ReduceOp.Average):
        check_request(meta("complex64", op=op))


def test_bad_devices_ops_and_factors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="tensors on 'meta' are not supported"):
        check_request(meta(device="meta"))
    with pytest.raises(UnsupportedOperationError, match="reducescatter supports Average and Sum, not Max"):
        check_request(meta(kind=Kind.REDUCESCATTER, op=ReduceOp.Max))
    with pytest.raises(ValueError, match="prescale factor must be a finite number"):
        check_request(meta(prescale=float("nan")))
    with pytest.raises(ValueError, match="unknown reduce op 42"):
        check_request(RequestMeta(name="t", kind=Kind.ALLREDUCE, process_set=0, dtype="float32", op=42))


def _fake_tensor(device: str) -> Any:
    return SimpleNamespace(dtype=torch.float32, shape=torch.Size([3]), device=torch.device(device))


def test_requests_on_different_cuda_devices_negotiate_alike() -> None:
    """Horovod's recipe, torch.cuda.set_device(hvd.local_rank()), puts rank i on cuda:i: that must agree."""
    call = Call(Kind.ALLREDUCE, spec=ReduceSpec(ReduceOp.Average))
    metas = {rank: build_meta(call, _fake_tensor(f"cuda:{rank}"), "grad") for rank in (0, 1)}  # type: ignore[arg-type]
    assert metas[0].device == metas[1].device == "cuda"
    assert find_mismatch(metas, 2) is None
    mixed = {0: metas[0], 1: build_meta(call, _fake_tensor("cpu"), "grad")}  # type: ignore[arg-type]
    assert find_mismatch(mixed, 2) == "Mismatched devices for tensor 'grad': rank 0: cuda, rank 1: cpu"


def test_the_engine_pause_never_overflows_however_long_a_peer_takes() -> None:
    config = EngineConfig()
    tuned = SimpleNamespace(cycle_time_ms=config.cycle_time_ms)
    fake = SimpleNamespace(_pending={(0, "t"): None}, config=config, cycle=SimpleNamespace(tuned=tuned))
    # 20 ms cycles for an hour is 180,000 empty cycles; 2**1024 overflowed a float after about 21 s.
    assert Engine._wait_ms(fake, Pauses(stalled=180_000)) == config.idle_cycle_time_ms  # type: ignore[arg-type]
    assert pause_ms(config.cycle_time_ms, config.idle_cycle_time_ms, True, 180_000) == config.idle_cycle_time_ms


def test_an_idle_engine_s_pause_doubles_after_ten_quiet_cycles_up_to_the_quiet_cycle_time() -> None:
    pauses = [pause_ms(1.0, 20.0, False, 0, quiet, 200.0) for quiet in range(16)]
    assert pauses == [20.0] * 11 + [40.0, 80.0, 160.0, 200.0, 200.0]
    assert pause_ms(1.0, 20.0, False, 0, 10**6, 200.0) == 200.0  # no overflow however long the quiet
    assert pause_ms(1.0, 20.0, False, 0, 50, 20.0) == 20.0  # the quiet time at the idle time: no back-off
    assert pause_ms(1.0, 20.0, True, 3, 50, 200.0) == 8.0  # waiting on peers: the busy back-off, not the quiet one
    sooner = [Pauses(quiet=quiet, quiet_after=2).ms(EngineConfig(), 1.0, False) for quiet in range(7)]
    assert sooner == [20.0] * 3 + [40.0, 80.0, 160.0, 200.0]  # local steps' engines back off after 2
    with pytest.raises(ValueError, match="quiet cycle time"):
        EngineConfig(quiet_cycle_time_ms=10.0)


def test_the_collective_timeout_must_exceed_the_stall_check_time() -> None:
    with pytest.raises(ValueError, match="must exceed the stall check time"):
        EngineConfig(collective_timeout_s=30.0, stall_check_time_s=60.0)
    assert EngineConfig(stall_shutdown_time_s=900.0).transport_timeout_s == 930.0
    # No stall shutdown (0, the default): a collective timeout set short is the transport's (it was raised to 30 s).
    assert EngineConfig(collective_timeout_s=12.0, stall_check_time_s=5.0).transport_timeout_s == 12.0


def test_the_watch_warns_while_a_collective_blocks_and_shuts_down_once() -> None:
    verdicts: list[str] = []
    watch = CollectiveWatch(3, check_time_s=0.2, shutdown_time_s=0.5, transport_timeout_s=9.0, on_shutdown=verdicts.append)
    try:
        with watch.watching("allreduce 'x'"):
            time.sleep(0.9)
        warnings = watch.warnings
        time.sleep(0.3)  # nothing is blocked now: no more warnings
        assert watch.warnings == warnings >= 2
        assert len(verdicts) == 1 and "rank 3 was blocked in allreduce 'x'" in verdicts[0]
    finally:
        watch.stop()
    assert not any(t.name == "shoal-engine-watch" and t.is_alive() for t in threading.enumerate())


def test_tuned_settings_survive_the_broadcast_encoding() -> None:
    from shoal.engine.autotune import TunedSettings

    for settings in (TunedSettings(0, 0.5, 0, False, False), TunedSettings(64 << 20, 10.0, None, True, True)):
        assert TunedSettings.from_tensor(settings.to_tensor()) == settings  # bucket 0 (each gradient alone) is not None


def _metadata_reuse() -> dict[str, object]:
    import shoal.torch as hvd
    from shoal.core import requests
    from shoal.core import session as handles

    hvd.init()
    call = Call(Kind.ALLREDUCE, spec=ReduceSpec(ReduceOp.Sum, 1.0, 1.0), in_place=True)
    first = requests.build(call, torch.ones(4), "reused")
    again = requests.build(call, torch.zeros(4), "reused")
    reshaped = requests.build(call, torch.ones(5), "reused")
    errors = []
    for _ in range(2):  # a refused request is not remembered: it is refused every time
        try:
            requests.build(call, torch.ones(4, dtype=torch.bool), "reused")
        except TypeError as error:
            errors.append(str(error))
    old_session = handles.session()
    reduced = hvd.allreduce_(torch.ones(4), op=hvd.Sum, name="reused").tolist()
    hvd.shutdown()
    hvd.init()
    fresh = requests.build(call, torch.ones(4), "reused")
    result = {
        "same": again.meta is first.meta and all(r.checked for r in (first, again, reshaped)),
        "reshaped": reshaped.meta is not first.meta and reshaped.meta.shape == (5,),
        "errors": errors,
        "reduced": reduced,
        "fresh": fresh.meta is not first.meta and handles.session() is not old_session and fresh.meta == first.meta,
    }
    hvd.shutdown()
    return result


def test_a_repeating_call_reuses_its_checked_metadata_within_a_session() -> None:
    """The same name, op, set, dtype, shape and device: the metadata made and checked once is reused; another shape
    makes new metadata; a refused dtype is refused every time; a re-init starts afresh."""
    from shoal.testing import run_ranks

    (result,) = run_ranks(_metadata_reuse, 1, timeout_s=60)
    assert result["same"] and result["reshaped"] and result["fresh"], result
    assert len(result["errors"]) == 2 and all("bool" in e for e in result["errors"]), result  # type: ignore[arg-type]
    assert result["reduced"] == [1.0] * 4
