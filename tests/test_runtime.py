"""init/shutdown, topology queries and the rendezvous secret, on 1 to 4 real ranks through the test harness."""

from __future__ import annotations

import pytest

import shoal.torch as hvd
from shoal.testing import MultiRankError, run_ranks


def _identity() -> dict[str, object]:
    hvd.init()
    hvd.init()  # a second init is a no-op, as in Horovod
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local": (hvd.local_rank(), hvd.local_size()),
        "cross": (hvd.cross_rank(), hvd.cross_size()),
        "homogeneous": hvd.is_homogeneous(),
        "initialized": hvd.is_initialized(),
    }


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_init_reports_rank_and_topology(size: int) -> None:
    results = run_ranks(_identity, size)
    for rank, result in enumerate(results):
        assert result == {
            "rank": rank,
            "size": size,
            "local": (rank, size),
            "cross": (0, 1),
            "homogeneous": True,
            "initialized": True,
        }


def _reinit() -> list[tuple[int, int, bool]]:
    from shoal.comm.process_group import allgather_json

    seen = []
    for _ in range(3):
        hvd.init()
        # The new world really works: every rank sees every other rank's value.
        gathered = allgather_json(hvd.rank())
        seen.append((hvd.rank(), sum(gathered), hvd.is_initialized()))
        hvd.shutdown()
        assert not hvd.is_initialized()
    return seen


def test_shutdown_then_init_again_works() -> None:
    results = run_ranks(_reinit, 3)
    for rank, seen in enumerate(results):
        assert seen == [(rank, 3, True)] * 3


def _queries_before_init() -> str:
    try:
        hvd.rank()
    except ValueError as error:
        return str(error)
    return "no error"


def test_queries_before_init_raise_a_clear_value_error() -> None:
    (message,) = run_ranks(_queries_before_init, 1)
    assert "not been initialized" in message and "init()" in message


def _init_only() -> int:
    hvd.init()
    return hvd.rank()


def test_wrong_secret_is_refused_with_a_clear_error() -> None:
    with pytest.raises(MultiRankError) as failure:
        run_ranks(_init_only, 2, rank_env_overrides={1: {"SHOAL_SECRET": "not-the-secret"}}, timeout_s=40, failure_grace_s=1)
    outcome = failure.value.outcomes[1]
    assert outcome.error is not None and "rendezvous refused" in outcome.error and "does not match" in outcome.error


def test_missing_secret_is_refused_with_a_clear_error() -> None:
    with pytest.raises(MultiRankError) as failure:
        run_ranks(_init_only, 2, rank_env_overrides={0: {"SHOAL_SECRET": ""}}, timeout_s=40, failure_grace_s=1)
    outcome = failure.value.outcomes[0]
    assert outcome.error is not None and "SHOAL_SECRET is not set" in outcome.error


def _capabilities() -> dict[str, object]:
    return {
        "gloo_built": hvd.gloo_built(),
        "gloo_enabled": hvd.gloo_enabled(),
        "mpi_enabled": hvd.mpi_enabled(),
        "nccl_built": hvd.nccl_built(),
        "cuda_built": hvd.cuda_built(),
        "rocm_built": hvd.rocm_built(),
        "ddl_built": hvd.ddl_built(),
        "ccl_built": hvd.ccl_built(),
    }


def test_capability_calls_answer_truthfully() -> None:
    import torch
    import torch.distributed as dist

    (caps,) = run_ranks(_capabilities, 1)
    assert caps["gloo_built"] is dist.is_gloo_available() and caps["gloo_enabled"] is dist.is_gloo_available()
    assert caps["cuda_built"] is (torch.version.cuda is not None)
    assert (caps["nccl_built"] > 0) == (dist.is_nccl_available() and torch.version.cuda is not None)
    assert caps["mpi_enabled"] is False and caps["ddl_built"] is False and caps["ccl_built"] is False


def _raise_on_rank_one() -> None:
    import os

    if os.environ["SHOAL_RANK"] == "1":
        raise RuntimeError("rank one fails on purpose")


def _exit_on_rank_zero() -> None:
    import os

    if os.environ["SHOAL_RANK"] == "0":
        os._exit(7)


def test_harness_reports_exceptions_and_exit_codes() -> None:
    with pytest.raises(MultiRankError, match="rank one fails on purpose") as raised:
        run_ranks(_raise_on_rank_one, 2)
    assert raised.value.outcomes[0].error is None and raised.value.outcomes[1].exitcode == 1
    with pytest.raises(MultiRankError, match="rank 0 exited with code 7"):
        run_ranks(_exit_on_rank_zero, 2)


def _sleep_forever() -> None:
    import time

    time.sleep(600)


def test_harness_kills_ranks_past_the_timeout() -> None:
    import time

    start = time.monotonic()
    with pytest.raises(MultiRankError, match="still running after the timeout"):
        run_ranks(_sleep_forever, 2, timeout_s=2)
    assert time.monotonic() - start < 15
