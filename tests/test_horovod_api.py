"""Horovod behaviours a ported script relies on, each against a single-process reference."""

from __future__ import annotations

import pytest
import torch

import shoal.torch as hvd
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
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())  # fmt: skip
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grads = [p.grad for p in model.parameters()]
    # Scripts rely on this: every gradient is a tensor now, so it can be broadcast right away.
    for index, grad in enumerate(grads):
        hvd.broadcast_(grad, root_rank=0, name=f"grad.{index}")  # type: ignore[arg-type]
    state = optimizer.state_dict()["state"]
    return {"grads_are_tensors": all(isinstance(g, torch.Tensor) for g in grads), "state_entries": len(state),
            "step": [float(s["step"]) for s in state.values()]}  # fmt: skip


def test_broadcast_optimizer_state_materializes_a_fresh_optimizer() -> None:
    for out in run_ranks(_fresh_optimizer_state, 2):
        assert out == {"grads_are_tensors": True, "state_entries": 2, "step": [1.0, 1.0]}


def _optimizer_outside_its_set() -> list[float]:
    hvd.init()
    subset = hvd.add_process_set([0, 1])
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters(), process_set=subset)  # fmt: skip
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
