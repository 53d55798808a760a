"""API fuzz: dtypes x ops x shapes. Every call either returns the single-process reference on every rank or raises
the same clear error on every rank, and the next valid call still works.

The expected errors are the specification written out (``expected_error``): unsupported dtypes raise TypeError,
reductions undefined for a dtype raise TypeError, impossible shapes and in-place writes into expanded tensors raise
ValueError. Reference results are computed in float64 (complex128) from every rank's input; integer Average is
Horovod's: the sum times 1/size, truncated toward zero. Tolerance: 2e-2 relative for float16/bfloat16, 1e-6 else.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

import shoal.torch as hvd
from shoal.engine.executor import split_rows
from shoal.testing import run_ranks

DTYPES = [
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
]
UNSUPPORTED = {"uint16", "uint32", "uint64", "float8_e4m3fn"}
"""Dtypes without reduction arithmetic: reductions refuse them, data movement carries them bit for bit."""
SHAPES = ["plain", "scalar", "empty", "noncontiguous", "expanded", "requires_grad"]
OPS = [
    "allreduce.Sum",
    "allreduce.Average",
    "allreduce.Min",
    "allreduce.Max",
    "allreduce.Product",
    "allreduce_.Sum",
    "allgather",
    "broadcast",
    "alltoall",
    "reducescatter.Sum",
    "reducescatter.Average",
    "grouped_allreduce.Sum",
]
REDUCE_OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}


def make_input(dtype: str, shape: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: small values, negative ones for signed types, different on every rank."""
    torch_dtype = getattr(torch, dtype)
    count = {"scalar": 1, "empty": 0, "expanded": 2}.get(shape, 8)
    values = torch.arange(count, dtype=torch.float64) + rank
    if dtype == "bool":
        base = (values % 2) == 0
    elif dtype.startswith("uint") or dtype.startswith("float8"):
        base = (values % 3 + 1).to(torch_dtype)
    elif dtype.startswith("complex"):
        base = torch.complex(values % 5 - 2, values % 3).to(torch_dtype)
    else:
        base = (values % 5 - 2).to(torch_dtype)
    if shape == "scalar":
        return base.reshape(())
    if shape == "empty":
        return base.reshape(0, 2)
    if shape == "noncontiguous":
        return base.reshape(2, 4).t()
    if shape == "expanded":
        return base.reshape(1, 2).expand(4, 2)
    tensor = base.reshape(4, 2).clone()
    if shape == "requires_grad":
        tensor.requires_grad_()
    return tensor


def applicable(dtype: str, shape: str) -> bool:
    return shape != "requires_grad" or dtype in ("float32", "float64", "complex64")


def expected_error(dtype: str, shape: str, op: str, size: int) -> str | None:
    """The specification of which calls are refused, and with which exception type."""
    kind, _, reduce_op = op.partition(".")
    # Shapes are checked by the front end first, then dtypes and ops by the engine.
    if kind in ("alltoall", "reducescatter") and shape == "scalar":
        return "ValueError"
    if kind == "alltoall" and 4 % size and shape not in ("scalar", "empty"):
        return "ValueError"
    if kind == "allreduce_" and shape == "expanded":
        return "ValueError"
    if dtype in UNSUPPORTED and kind in ("allreduce", "allreduce_", "grouped_allreduce", "reducescatter"):
        return "TypeError"  # no reduction arithmetic; allgather, broadcast and alltoall move their bits
    if dtype == "bool" and reduce_op in ("Sum", "Average"):
        return "TypeError"
    if dtype.startswith("complex") and reduce_op in ("Min", "Max", "Product"):
        return "TypeError"
    return None


def call(op: str, tensor: torch.Tensor, name: str, process_set: Any) -> torch.Tensor:
    kind, _, reduce_op = op.partition(".")
    if kind == "allreduce":
        return hvd.allreduce(tensor, op=REDUCE_OPS[reduce_op], name=name, process_set=process_set)
    if kind == "allreduce_":
        target = tensor.detach().clone() if tensor.stride() and 0 not in tensor.stride() else tensor.detach()
        return hvd.allreduce_(target, op=REDUCE_OPS[reduce_op], name=name, process_set=process_set)
    if kind == "allgather":
        return hvd.allgather(tensor, name=name, process_set=process_set)
    if kind == "broadcast":
        return hvd.broadcast(
            tensor, root_rank=process_set.ranks[-1] if process_set.ranks else 1, name=name, process_set=process_set
        )
    if kind == "alltoall":
        return hvd.alltoall(tensor, name=name, process_set=process_set)
    if kind == "reducescatter":
        return hvd.reducescatter(tensor, op=REDUCE_OPS[reduce_op], name=name, process_set=process_set)
    if kind == "grouped_allreduce":
        return hvd.grouped_allreduce([tensor, tensor], op=REDUCE_OPS[reduce_op], name=name, process_set=process_set)[1]
    raise AssertionError(op)


def as_lists(tensor: torch.Tensor) -> tuple[list[int], list[float]]:
    """(shape, flat values) in float64; a complex tensor as (..., 2) pairs of reals."""
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return list(tensor.shape), tensor.to(torch.float64).reshape(-1).tolist()


def _fuzz(dtypes: list[str], subset_ranks: list[int] | None) -> dict[str, Any]:
    hvd.init()
    rank = hvd.rank()
    process_set = hvd.add_process_set(subset_ranks) if subset_ranks else hvd.global_process_set
    if not process_set.included():
        hvd.barrier()
        return {}
    set_rank = process_set.rank()
    outcomes: dict[str, Any] = {}
    for number, (dtype, shape, op) in enumerate(itertools.product(dtypes, SHAPES, OPS)):
        if not applicable(dtype, shape):
            continue
        key = f"{dtype}/{shape}/{op}"
        try:
            outcomes[key] = ("ok", as_lists(call(op, make_input(dtype, shape, set_rank), f"case{number}", process_set)))
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as error:
            outcomes[key] = ("error", type(error).__name__, str(error))
            # The next valid call must still work.
            check = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"check{number}", process_set=process_set)
            outcomes[key + "/next"] = check.tolist()
    hvd.barrier()
    del rank
    return outcomes


def reference(dtype: str, shape: str, op: str, size: int, set_rank: int) -> np.ndarray:
    inputs = [make_input(dtype, shape, r).detach() for r in range(size)]
    wide = [torch.view_as_real(t.to(torch.complex128)) if t.is_complex() else t.to(torch.float64) for t in inputs]
    stacked = np.stack([t.numpy() for t in wide])
    kind, _, reduce_op = op.partition(".")
    if kind in ("allreduce", "allreduce_", "grouped_allreduce", "reducescatter"):
        if reduce_op == "Sum":
            result = stacked.sum(0)
        elif reduce_op == "Average":
            total = stacked.sum(0)
            integer = not (dtype.startswith("float") or dtype.startswith("complex") or dtype == "bfloat16")
            result = np.trunc(total * (1.0 / size)) if integer else total / size
        elif reduce_op == "Min":
            result = stacked.min(0)
        elif reduce_op == "Max":
            result = stacked.max(0)
        else:
            result = stacked.prod(0)
        if kind == "reducescatter":
            counts = split_rows(result.shape[0], size)
            start = sum(counts[:set_rank])
            result = result[start : start + counts[set_rank]]
        return result
    if kind == "allgather":
        return np.concatenate([a.reshape(1, *a.shape) if a.ndim == 0 or shape == "scalar" else a for a in stacked])
    if kind == "broadcast":
        return stacked[size - 1]
    if kind == "alltoall":
        rows = stacked.shape[1] // size
        return np.concatenate([a[set_rank * rows : (set_rank + 1) * rows] for a in stacked])
    raise AssertionError(op)


def check_outcomes(results: list[dict[str, Any]], dtypes: list[str], size: int, members: list[int]) -> int:
    checked = 0
    for dtype, shape, op in itertools.product(dtypes, SHAPES, OPS):
        if not applicable(dtype, shape):
            continue
        key = f"{dtype}/{shape}/{op}"
        error = expected_error(dtype, shape, op, size)
        for set_rank, rank in enumerate(members):
            outcome = results[rank][key]
            if error is not None:
                assert outcome[0] == "error" and outcome[1] == error, f"{key} rank {rank}: expected {error}, got {outcome}"
                assert dtype in outcome[2] or "tensor" in outcome[2] or "in-place" in outcome[2], outcome[2]
                assert results[rank][key + "/next"] == [float(size)] * 2, key
            else:
                assert outcome[0] == "ok", f"{key} rank {rank}: {outcome}"
                tolerance = 2e-2 if dtype in ("float16", "bfloat16") else 1e-6
                expected = reference(dtype, shape, op, size, set_rank)
                got_shape, values = outcome[1]
                assert got_shape == list(expected.shape), f"{key} rank {rank}: shape {got_shape} != {expected.shape}"
                np.testing.assert_allclose(
                    np.array(values), expected.reshape(-1), rtol=tolerance, atol=tolerance, err_msg=f"{key} rank {rank}"
                )
            checked += 1
    return checked


def test_fuzz_every_dtype_op_and_shape_on_two_ranks() -> None:
    results = run_ranks(_fuzz, 2, args=(DTYPES, None), timeout_s=150)
    assert check_outcomes(results, DTYPES, 2, [0, 1]) > 1500


@pytest.mark.parametrize("members", [[0, 2]])
def test_fuzz_in_a_process_set_of_three_ranks(members: list[int]) -> None:
    dtypes = ["int32", "float32", "bool", "complex64", "uint16"]
    results = run_ranks(_fuzz, 3, args=(dtypes, members), timeout_s=150)
    assert results[1] == {}
    assert check_outcomes(results, dtypes, len(members), members) > 400
