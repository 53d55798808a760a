"""Every collective, op and dtype on 1-4 ranks, against a numpy reference computed from every rank's input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shoal.torch as hvd
from shoal.testing import run_ranks

pytestmark = pytest.mark.check  # the quick tier: make check

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}


def rank_input(rank: int, dtype: str, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    """Small values (so Product stays exact in every dtype), different on every rank."""
    values = (np.arange(int(np.prod(shape))).reshape(shape) + rank) % 3 + 1
    return torch.tensor(values, dtype=torch.float64).to(getattr(torch, dtype))


def numpy_reduce(inputs: list[np.ndarray], op: str, integer: bool) -> np.ndarray:
    stacked = np.stack(inputs)
    if op == "Average":
        total = stacked.sum(0)
        return total // len(inputs) if integer else total / len(inputs)
    return {"Sum": stacked.sum, "Min": stacked.min, "Max": stacked.max, "Product": stacked.prod}[op](0)


def _allreduce_all() -> dict[str, list[float]]:
    hvd.init()
    results = {}
    for dtype in DTYPES:
        for op_name, op in OPS.items():
            tensor = rank_input(hvd.rank(), dtype)
            results[f"{dtype}/{op_name}"] = hvd.allreduce(tensor, op=op).double().reshape(-1).tolist()
            in_place = rank_input(hvd.rank(), dtype)
            hvd.allreduce_(in_place, op=op, name=f"inplace.{dtype}.{op_name}")
            results[f"{dtype}/{op_name}/inplace"] = in_place.double().reshape(-1).tolist()
    return results


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allreduce_every_op_and_dtype(size: int) -> None:
    results = run_ranks(_allreduce_all, size, timeout_s=120)
    for key in results[0]:
        dtype, op = key.split("/")[:2]
        integer = not getattr(torch, dtype).is_floating_point
        inputs = [rank_input(r, dtype).double().numpy() for r in range(size)]
        expected = numpy_reduce(inputs, op, integer).reshape(-1)
        tolerance = 2e-2 if dtype in ("float16", "bfloat16") else 1e-9
        for rank in range(size):
            np.testing.assert_allclose(results[rank][key], expected, rtol=tolerance, err_msg=f"{key} rank {rank}")


def _other_collectives() -> dict[str, object]:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, object] = {}
    for dtype in [*DTYPES, "bool"]:
        torch_dtype = getattr(torch, dtype)
        piece = torch.full((rank + 1, 2), rank % 2 if dtype == "bool" else rank + 1).to(torch_dtype)
        out[f"allgather/{dtype}"] = hvd.allgather(piece).double().tolist()
        source = torch.full((3,), rank + 5).to(torch_dtype)
        out[f"broadcast/{dtype}"] = hvd.broadcast(source, root_rank=size - 1).double().tolist()
        hvd.broadcast_(source, root_rank=0)
        out[f"broadcast_/{dtype}"] = source.double().tolist()
        rows = torch.arange(size * 2).to(torch_dtype) if dtype != "bool" else torch.ones(size * 2, dtype=torch.bool)
        received = hvd.alltoall(rows + (rank if dtype != "bool" else 0))  # no splits: Horovod returns the tensor alone
        out[f"alltoall/{dtype}"] = (received.double().tolist(), [received.shape[0] // size] * size)
    uneven = [r + 1 for r in range(size)]  # rank r sends r'+1 rows to rank r'
    tensor = torch.arange(sum(uneven), dtype=torch.float32) + 100 * rank
    received, splits = hvd.alltoall(tensor, splits=uneven)
    out["alltoall/splits"] = (received.tolist(), splits.tolist())
    for op_name in ("Sum", "Average"):
        out[f"reducescatter/{op_name}"] = hvd.reducescatter(torch.ones(5, 2) * (rank + 1), op=OPS[op_name]).tolist()
    distinct = torch.arange(21.0).reshape(7, 3) * (rank + 1)  # every element distinct: a block mixed up shows
    out["reducescatter/rows"] = hvd.reducescatter(distinct, op=hvd.Sum, prescale_factor=2.0).tolist()
    out["grouped_allreduce"] = [t.tolist() for t in hvd.grouped_allreduce([torch.ones(2) * rank, torch.ones(3)])]
    out["grouped_allgather"] = [t.tolist() for t in hvd.grouped_allgather([torch.ones(1) * rank, torch.ones(2)])]
    out["grouped_reducescatter"] = [t.tolist() for t in hvd.grouped_reducescatter([torch.ones(size, 1)], op=hvd.Sum)]
    out["scaled"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist()
    out["zero_dim"] = hvd.allreduce(torch.tensor(float(rank)), op=hvd.Sum).tolist()
    out["empty"] = list(hvd.allreduce(torch.empty(0, 3)).shape)
    strided = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    out["noncontiguous"] = hvd.allreduce(strided * (rank + 1), op=hvd.Sum).tolist()
    hvd.allreduce_(strided, op=hvd.Sum)
    out["noncontiguous_inplace"] = strided.tolist()
    out["objects"] = hvd.allgather_object({"rank": rank})
    out["broadcast_object"] = hvd.broadcast_object({"from": rank}, root_rank=size - 1)
    hvd.barrier()
    return out


@pytest.mark.parametrize("path", ["shared memory", "gloo"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allgather_broadcast_alltoall_reducescatter(size: int, path: str) -> None:
    """Through the host's shared memory (the default with several ranks on a host: reducescatter and allgather move
    only each rank's block), and over gloo alone (as between hosts: the reducescatter is a ring)."""
    env = {"SHOAL_HIERARCHICAL_ALLREDUCE": "0"} if path == "gloo" else {}
    results = run_ranks(_other_collectives, size, env=env, timeout_s=120)
    for rank, out in enumerate(results):
        for dtype in [*DTYPES, "bool"]:
            is_bool = dtype == "bool"
            gathered = [[float(r % 2 if is_bool else r + 1)] * 2 for r in range(size) for _ in range(r + 1)]
            assert out[f"allgather/{dtype}"] == gathered, dtype
            assert out[f"broadcast/{dtype}"] == [float(1 if is_bool else size - 1 + 5)] * 3, dtype
            assert out[f"broadcast_/{dtype}"] == [float(1 if is_bool else 5)] * 3, dtype
            expected = [1.0] * (2 * size) if is_bool else [float(2 * rank + j + src) for src in range(size) for j in (0, 1)]
            assert out[f"alltoall/{dtype}"] == (expected, [2] * size), dtype
        # Rank r receives (r+1) rows from every source; source s's rows for r start after sum(1..r).
        start = sum(range(1, rank + 1))
        expected_rows = [float(100 * s + start + j) for s in range(size) for j in range(rank + 1)]
        assert out["alltoall/splits"] == (expected_rows, [rank + 1] * size)
        total = sum(range(1, size + 1))
        rows = [5 // size + (1 if i < 5 % size else 0) for i in range(size)]
        assert out["reducescatter/Sum"] == [[float(total)] * 2] * rows[rank]
        assert out["reducescatter/Average"] == [[total / size] * 2] * rows[rank]
        seven = [7 // size + (1 if i < 7 % size else 0) for i in range(size)]
        first = sum(seven[:rank])
        expected_block = np.arange(21.0).reshape(7, 3)[first : first + seven[rank]] * 2 * total
        np.testing.assert_array_equal(np.array(out["reducescatter/rows"]).reshape(-1, 3), expected_block)
        assert out["grouped_allreduce"] == [[sum(range(size)) / size] * 2, [1.0] * 3]
        assert out["grouped_allgather"] == [[float(r) for r in range(size)], [1.0] * (2 * size)]
        assert out["grouped_reducescatter"] == [[[float(size)]]]
        assert out["scaled"] == [float(size)] * 2
        assert out["zero_dim"] == float(sum(range(size)))
        assert out["empty"] == [0, 3]
        base = np.arange(12.0).reshape(3, 4).T
        np.testing.assert_allclose(out["noncontiguous"], base * sum(range(1, size + 1)))
        np.testing.assert_allclose(out["noncontiguous_inplace"], base * size)
        assert out["objects"] == [{"rank": r} for r in range(size)]
        assert out["broadcast_object"] == {"from": size - 1}
