"""Horovod behaviours a ported script relies on, each against a single-process reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shoal.torch as hvd
from conftest import clean_env
from shoal.testing import run_ranks


def _static_process_sets() -> dict[str, object]:
    evens, odds = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1])
    hvd.init(process_sets=[evens, odds])
    rank = hvd.rank()
    out: dict[str, object] = {"ids": (evens.process_set_id, odds.process_set_id)}
    if evens.included():
        out["evens"] = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=evens).item()
    hvd.barrier()
    hvd.shutdown()
    try:
        hvd.init(process_sets=[hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 0])])  # the same set twice
        out["duplicate"] = "accepted"
    except ValueError as error:
        out["duplicate"] = str(error)
    out["initialized_after_error"] = hvd.is_initialized()
    return out


def test_init_registers_static_process_sets() -> None:
    for rank, out in enumerate(run_ranks(_static_process_sets, 3)):
        assert out["ids"] == (1, 2)
        assert out.get("evens") == (2.0 if rank in (0, 2) else None)
        assert "already exists" in out["duplicate"] and out["initialized_after_error"] is False  # type: ignore[operator]


def _alltoall_returns() -> tuple[list[float], tuple[list[float], list[int]]]:
    hvd.init()
    rank = hvd.rank()
    plain = hvd.alltoall(torch.tensor([rank * 10.0, rank * 10.0 + 1]))
    received, splits = hvd.alltoall(torch.tensor([rank * 10.0, rank * 10.0 + 1]), splits=[1, 1])
    return plain.tolist(), (received.tolist(), splits.tolist())


def test_alltoall_returns_splits_only_when_given() -> None:
    results = run_ranks(_alltoall_returns, 2)
    assert results[0] == ([0.0, 10.0], ([0.0, 10.0], [1, 1]))
    assert results[1] == ([1.0, 11.0], ([1.0, 11.0], [1, 1]))


def _sparse_allreduce(op: int) -> list[list[float]]:
    hvd.init()
    rank = hvd.rank()
    dense = torch.zeros(4, 2)
    dense[rank] = rank + 1.0
    dense[3] = 1.0
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="emb", op=op)
    return hvd.synchronize(handle).to_dense().tolist()


@pytest.mark.parametrize(("op", "scale"), [(hvd.Sum, 1.0), (hvd.Average, 0.5)])
def test_sparse_allreduce_matches_the_dense_sum(op: int, scale: float) -> None:
    expected = torch.zeros(4, 2)
    expected[0], expected[1], expected[3] = 1.0, 2.0, 2.0
    for result in run_ranks(_sparse_allreduce, 2, args=(op,)):
        assert result == (expected * scale).tolist()


def _fresh_optimizer_state() -> dict[str, object]:
    hvd.init()
    torch.manual_seed(hvd.rank())  # different initial weights on purpose
    model = torch.nn.Linear(3, 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grads = [p.grad for p in model.parameters()]
    # Scripts rely on this: every gradient is a tensor now, so it can be broadcast right away.
    for index, grad in enumerate(grads):
        hvd.broadcast_(grad, root_rank=0, name=f"grad.{index}")  # type: ignore[arg-type]
    state = optimizer.state_dict()["state"]
    return {
        "grads_are_tensors": all(isinstance(g, torch.Tensor) for g in grads),
        "state_entries": len(state),
        "step": [float(s["step"]) for s in state.values()],
    }


def test_broadcast_optimizer_state_materializes_a_fresh_optimizer() -> None:
    for out in run_ranks(_fresh_optimizer_state, 2):
        assert out == {"grads_are_tensors": True, "state_entries": 2, "step": [1.0, 1.0]}


def _optimizer_outside_its_set() -> list[float]:
    hvd.init()
    subset = hvd.add_process_set([0, 1])
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters(), process_set=subset
    )
    x = torch.full((1, 2), float(hvd.rank() + 1))
    model(x).sum().backward()
    optimizer.step()  # rank 2 is outside the set: a local step, no exchange, no error
    hvd.barrier()
    return model.weight.detach().reshape(-1).tolist()


def test_distributed_optimizer_is_local_outside_its_process_set() -> None:
    results = run_ranks(_optimizer_outside_its_set, 3)
    assert results[0] == results[1] == [-0.5, -0.5]  # 1 - mean(1, 2)
    assert results[2] == [-2.0, -2.0]  # 1 - its own gradient 3


def _work(scale: float, offset: int = 0) -> list[float]:
    hvd.init()
    return [*hvd.allreduce(torch.ones(2) * scale * (hvd.rank() + 1), op=hvd.Sum).tolist(), float(hvd.rank() + offset)]


def _unhappy_rank_one() -> int:
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one is unhappy")
    hvd.barrier()
    return 0


def test_shoal_run_returns_every_rank_result_and_raises_with_the_traceback() -> None:
    import os

    import shoal as horovod  # what `horovod.run(...)` scripts become

    tests_dir = os.path.dirname(__file__)
    env = {"PYTHONPATH": tests_dir}  # the workers import this module to find the function
    assert horovod.run(_work, args=(2.0,), kwargs={"offset": 10}, np=2, env=env) == [[6.0, 6.0, 10.0], [6.0, 6.0, 11.0]]
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 raised:.*ValueError: rank one is unhappy"):
        horovod.run(_unhappy_rank_one, num_proc=2, env=env)


HOROVOD_SCRIPT = """
import sys
import horovod
import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
from horovod.torch.elastic import TorchState
from horovod.torch.mpi_ops import allreduce
import shoal.torch
hvd.init()
same = hvd is shoal.torch and allreduce is shoal.torch.allreduce and TorchState is shoal.torch.elastic.TorchState
same = same and HorovodInternalError is shoal.torch.HorovodInternalError
sys.stdout.write(f"{hvd.rank()} {hvd.allreduce(torch.ones(1), op=hvd.Sum).item()} {same}" + chr(10))
"""


def test_an_unmodified_horovod_script_runs_under_horovod_compat(tmp_path: object) -> None:
    import subprocess
    import sys

    from conftest import SHOALRUN, clean_env

    script = f"{tmp_path}/train.py"
    with open(script, "w") as handle:
        handle.write(HOROVOD_SCRIPT)
    result = subprocess.run(
        [*SHOALRUN, "--horovod-compat", "-np", "2", sys.executable, script],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:0 2.0 True", "[1]<stdout>:1 2.0 True"]
    # Without the option the same script finds no horovod at all (nothing named horovod was installed).
    plain = subprocess.run([sys.executable, script], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert "No module named 'horovod'" in plain.stderr


def test_horovod_compat_refuses_a_real_horovod_on_the_path(tmp_path: object) -> None:
    import os
    import subprocess
    import sys

    from conftest import SHOALRUN, clean_env

    os.makedirs(f"{tmp_path}/site/horovod")
    open(f"{tmp_path}/site/horovod/__init__.py", "w").close()
    env = clean_env()
    env["PYTHONPATH"] = f"{tmp_path}/site"
    command = [*SHOALRUN, "--horovod-compat", "-np", "1", sys.executable, "-c", "import horovod.torch"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "a real Horovod is importable too" in result.stderr and f"{tmp_path}/site/horovod" in result.stderr


def _embedding_rows(rank: int, step: int) -> torch.Tensor:
    return torch.tensor([[rank + step, 3], [5, (rank * 2 + step) % 10]])


def _sparse_adam() -> list[list[float]]:
    hvd.init()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(embedding.parameters(), lr=0.1), named_parameters=embedding.named_parameters()
    )
    for step in range(3):
        optimizer.zero_grad()
        embedding(_embedding_rows(hvd.rank(), step)).pow(2).sum().backward()
        optimizer.step()
    return embedding.weight.detach().tolist()


def test_sparse_gradients_train_with_sparse_adam_as_one_process_would() -> None:
    """sparse_as_dense=False: gradients stay sparse (allgather of indices and values), so SparseAdam accepts them."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = torch.optim.SparseAdam(embedding.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        (sum(embedding(_embedding_rows(rank, step)).pow(2).sum() for rank in range(2)) / 2).backward()  # type: ignore[union-attr]
        optimizer.step()
    for weights in run_ranks(_sparse_adam, 2):
        torch.testing.assert_close(torch.tensor(weights), embedding.weight.detach(), rtol=1e-6, atol=1e-6)


def test_deprecations_point_at_the_users_line_and_show_under_default_filters(tmp_path: Path) -> None:
    """Python shows a DeprecationWarning by default only when it points at ``__main__``: Shoal's point at the user's
    call, however deep the rule sits (a fixed stacklevel once landed on a Shoal frame, so users never saw them)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "import shoal.torch as hvd\n"
        "hvd.init()\n"
        "params = [torch.nn.Parameter(torch.ones(2))]\n"
        "hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), num_groups=1)\n"
        "hvd.allreduce(torch.ones(1), average=True, name='x')\n"
    )
    env = {k: v for k, v in clean_env().items() if k != "PYTHONWARNINGS"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"{script}:5: DeprecationWarning: num_groups is deprecated" in result.stderr, result.stderr
    assert f"{script}:6: DeprecationWarning: Parameter `average` has been replaced" in result.stderr, result.stderr
