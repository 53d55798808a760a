"""The shared-memory transport and hierarchical allreduce, against gloo: every dtype and op, odd and tiny sizes,
chunking, fallback, and a rank killed mid-collective."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import shoal.torch as hvd
from shoal.comm import collectives
from shoal.comm.shm import create_local_group, job_token
from shoal.comm.shm_blocks import allgather_blocks, block_bounds, reduce_scatter_
from shoal.config.worker import job_secret
from shoal.core import session as handles
from shoal.runtime import context
from shoal.testing import MultiRankError, run_ranks

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"]
SIZES = [0, 1, 3, 1023, 5000]  # with 4 KiB slots, 5000 elements of any dtype >= 1 byte cross slot boundaries
REDUCTIONS = ["sum", "product", "min", "max"]


def _test_group(slot_bytes: int = 4096) -> object:
    ctx = context.current()
    topology = ctx.topology
    group = create_local_group(
        ctx.store,
        topology.local_rank,
        topology.local_size,
        topology.host_of_rank[topology.rank],
        job_token(ctx.launch.secret),
        slot_bytes=slot_bytes,
        purpose=f"test{slot_bytes}",
    )
    assert group is not None
    return group


def _values(rank: int, dtype: str, count: int) -> torch.Tensor:
    base = (torch.arange(count, dtype=torch.float64) * 7 + rank * 3) % 5 + (rank % 2)
    if dtype == "bool":
        return base.remainder(2).bool()
    return base.to(getattr(torch, dtype))


def _against_gloo(slot_bytes: int = 4096, sizes: tuple[int, ...] = tuple(SIZES)) -> list[str]:
    hvd.init()
    group = _test_group(slot_bytes)
    rank = hvd.rank()
    mismatches = []
    for dtype in DTYPES:
        for count in sizes:
            # Uneven blocks, in proportion 1:2:3..., so that a small count leaves the first ranks none.
            weights = list(range(1, hvd.size() + 1))
            edges = [count * sum(weights[:r]) // sum(weights) for r in range(hvd.size() + 1)]
            blocks = [edges[r + 1] - edges[r] for r in range(hvd.size())]
            for reduction in REDUCTIONS:
                mine = _values(rank, dtype, count)
                expected = mine.clone() if dtype != "int16" else mine.to(torch.int32)
                collectives.allreduce_(expected, reduction, None)  # gloo on the default group
                got = mine.clone()
                group.allreduce_(got, reduction)  # type: ignore[attr-defined]
                tolerance = 1e-2 if dtype in ("float16", "bfloat16") else 0.0
                if not torch.allclose(got.double(), expected.double(), rtol=tolerance, atol=tolerance):
                    mismatches.append(f"allreduce {reduction} {dtype} x{count}")
                low, high = block_bounds(blocks)[rank]
                scattered = reduce_scatter_(group, mine.clone(), reduction, blocks)  # type: ignore[arg-type]
                if not torch.allclose(scattered.double(), expected[low:high].double(), rtol=tolerance, atol=tolerance):
                    mismatches.append(f"reduce_scatter {reduction} {dtype} x{count} in {blocks}")
            whole = allgather_blocks(group, _values(rank, dtype, count)[: blocks[rank]], blocks)  # type: ignore[arg-type]
            if not torch.equal(whole, torch.cat([_values(r, dtype, count)[:n] for r, n in enumerate(blocks)])):
                mismatches.append(f"allgather_blocks {dtype} x{count} in {blocks}")
            source = _values(rank, dtype, count)
            group.broadcast_(source, root=hvd.size() - 1)  # type: ignore[attr-defined]
            if not torch.equal(source, _values(hvd.size() - 1, dtype, count)):
                mismatches.append(f"broadcast {dtype} x{count}")
            gathered = group.allgather(_values(rank, dtype, count))  # type: ignore[attr-defined]
            if not all(torch.equal(gathered[r], _values(r, dtype, count)) for r in range(hvd.size())):
                mismatches.append(f"allgather {dtype} x{count}")
            reduced = _values(rank, dtype, count)
            group.reduce_(reduced, "max", root=0)  # type: ignore[attr-defined]
            if rank == 0:
                expected_max = torch.stack([_values(r, dtype, count) for r in range(hvd.size())]).amax(0)
                if count and not torch.equal(reduced, expected_max):
                    mismatches.append(f"reduce max {dtype} x{count}")
    group.close()  # type: ignore[attr-defined]
    return mismatches


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shared_memory_collectives_match_gloo(size: int) -> None:
    for rank, mismatches in enumerate(run_ranks(_against_gloo, size, timeout_s=240)):
        assert mismatches == [], f"rank {rank}: {mismatches}"


@pytest.mark.parametrize("size", [2, 3])
def test_large_chunks_take_the_copy_saving_path_and_match_gloo(size: int) -> None:
    # 1 MiB slots: 131079 one-byte elements fit one chunk (large path); float64 splits into a large and a small chunk.
    for rank, mismatches in enumerate(run_ranks(_against_gloo, size, args=(1 << 20, (131079,)), timeout_s=240)):
        assert mismatches == [], f"rank {rank}: {mismatches}"


def _finish_on_slices(slot_bytes: int, count: int) -> tuple[list[float], int]:
    """Sum with a finishing step (halve) on the small and the large path; returns the result and how many
    elements this rank's finish calls touched."""
    hvd.init()
    group = _test_group(slot_bytes)
    touched = 0

    def halve(part: torch.Tensor) -> None:
        nonlocal touched
        touched += part.numel()
        part.mul_(0.5)

    tensor = torch.arange(count, dtype=torch.float32) + hvd.rank()
    group.allreduce_(tensor, "sum", finish=halve)  # type: ignore[attr-defined]
    return tensor.tolist(), touched


@pytest.mark.parametrize("slot_bytes, count", [(4096, 3001), (1 << 20, 131079)])  # small chunks; the large path
def test_finish_runs_once_on_each_ranks_slice(slot_bytes: int, count: int) -> None:
    size = 3
    expected = [(size * i + sum(range(size))) * 0.5 for i in range(count)]
    results = run_ranks(_finish_on_slices, size, args=(slot_bytes, count), timeout_s=120)
    for values, _ in results:
        assert values == expected  # scaled exactly once, everywhere
    assert sum(touched for _, touched in results) == count  # each element by one rank: 1/size of the work each


def _engine_path() -> tuple[str | None, list[float]]:
    hvd.init()
    hierarchical = handles.engine().hierarchical
    path = None if hierarchical is None else type(hierarchical.local).__name__
    result = hvd.allreduce(torch.arange(10007.0) * (hvd.rank() + 1), op=hvd.Sum)
    return path, [float(result[0]), float(result[1]), float(result[-1])]


def test_engine_uses_shared_memory_with_chunking() -> None:
    results = run_ranks(_engine_path, 3, env={"SHOAL_SHM_SLOT_BYTES": "4096"})
    for path, values in results:
        assert path == "SharedMemoryGroup"
        assert values == [0.0, 6.0, 10006.0 * 6]


def test_unavailable_shared_memory_falls_back_to_gloo_with_a_warning() -> None:
    # A petabyte per slot cannot be reserved in /dev/shm: the set-up must fail cleanly and fall back.
    results = run_ranks(_engine_path, 2, env={"SHOAL_SHM_SLOT_BYTES": str(2**50)})
    for path, values in results:
        assert path is None and values == [0.0, 3.0, 10006.0 * 3]


def test_hierarchical_can_be_switched_off() -> None:
    for path, _ in run_ranks(_engine_path, 2, env={"SHOAL_HIERARCHICAL_ALLREDUCE": "0"}):
        assert path is None


def _job_segments(token: str) -> list[str]:
    """The job's segments still in /dev/shm (by its token: other tests' jobs may run at the same time)."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"shoal-{token}-")]


def _own_token() -> str:
    return job_token(job_secret(os.environ))


def _die_mid_collective() -> str:
    hvd.init()
    if hvd.rank() == 1:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    big = torch.ones(4 * 1024 * 1024)
    start = time.monotonic()
    try:
        while time.monotonic() - start < 30:
            hvd.allreduce_(big, name="big")
    except RuntimeError as error:
        return f"{_own_token()} {error}"
    return "no error"


def test_rank_killed_mid_collective_is_a_clear_error_and_leaves_no_segment() -> None:
    with pytest.raises(MultiRankError) as failure:
        run_ranks(_die_mid_collective, 3, timeout_s=60)
    outcomes = failure.value.outcomes
    assert outcomes[1].exitcode == -signal.SIGKILL
    for survivor in (0, 2):
        message = str(outcomes[survivor].result)
        assert "engine failed" in message and "died" in message, message
    token = str(outcomes[0].result).split()[0]
    assert len(token) == 12 and not _job_segments(token)


def test_shoalrun_leaves_no_segment_after_a_sigkill() -> None:
    code = textwrap.dedent(
        """
        import os, signal, torch, shoal.torch as hvd
        from shoal.comm.names import job_token
        from shoal.config.worker import job_secret
        hvd.init()
        if hvd.rank() == 0:
            print("token", job_token(job_secret(os.environ)), flush=True)
        big = torch.ones(1 << 20)
        for step in range(1000):
            if hvd.rank() == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            hvd.allreduce_(big, name="big")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "HOROVOD_"))}
    result = subprocess.run(
        [sys.executable, "-m", "shoal.runner", "-np", "3", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 128 + signal.SIGKILL, result.stderr[-2000:]
    assert "rank 1 on host localhost was killed by signal SIGKILL" in result.stderr
    (token,) = [line.split()[-1] for line in result.stdout.splitlines() if line.startswith("[0]<stdout>:token ")]
    assert len(token) == 12 and not _job_segments(token)


def test_segment_layout_numbers() -> None:
    # The slot arithmetic: slices cover a chunk exactly, lower ranks take the remainder.
    from shoal.comm.shm import SharedMemoryGroup

    group = SharedMemoryGroup.__new__(SharedMemoryGroup)
    group.local_size = 3
    group._slices_cache = {}
    assert group.slices(10) == [(0, 4), (4, 7), (7, 10)]
    assert group.slices(2) == [(0, 1), (1, 2), (2, 2)]
    assert np.sum([b - a for a, b in group.slices(12345)]) == 12345


def test_a_closed_arena_or_group_leaves_the_tensors_that_view_it_valid() -> None:
    """``torch.frombuffer`` keeps the mmap object alive but holds no buffer export, so an explicit ``mmap.close()``
    would unmap memory a gradient (or an engine thread) still views: a segfault on the next touch. Closing drops
    the mappings instead; this child process would die of SIGSEGV otherwise."""
    code = textwrap.dedent(
        """
        import gc, os, torch
        from shoal.comm.shared_arena import SharedArena, create_segment, unlink
        from shoal.comm.shm import SharedMemoryGroup, job_token
        token = job_token("arena-close-test")
        path = create_segment(token, "localhost", 4096)
        arena = SharedArena([path], 0, 4096, token, "localhost")
        unlink(path)
        grad = arena.own()[64:128].view(torch.float32)
        arena.close()
        del arena
        gc.collect()
        grad.fill_(2.0)
        print(float(grad.sum()))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.strip() == "32.0"
