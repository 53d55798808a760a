"""DistributedOptimizer(shard=...): ZeRO stages 1 and 2 against single-process references.

Reference rule: N ranks x batch B, each holding 1/N of the optimizer state (and, in stage 2, of the reduced
gradient), must give the weights of one process with batch N*B and the whole state. Tolerance: fp32 weights and
optimizer state agree within atol 1e-5 (the only differences are the order of floating-point summation, and Adam's
update computed over a flat shard instead of per tensor).
"""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import shoal.torch as hvd
from conftest import REPO, SHOALRUN, clean_env
from shoal.plan.memory import ModelMemory, estimate, estimates
from shoal.testing import run_ranks
from shoal.torch.sharding import Shard, ShardLayout
from shoal.torch.sharding.memory import model_memory, state_per_element

pytestmark = pytest.mark.check  # the quick tier: make check

BATCH = 4
STEPS = 3
ATOL = 1e-5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.unused = nn.Linear(3, 3)  # never in the graph: no gradient on any rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _optimizer(model: Net, kind: str) -> torch.optim.Optimizer:
    """Two param groups with their own hyperparameters, so a shard that spans groups must step each its own way."""
    groups: list[dict[str, Any]] = [
        {"params": list(model.fc1.parameters()) + list(model.unused.parameters())},
        {"params": list(model.fc2.parameters()), "lr": 0.05},
    ]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01, betas=(0.8, 0.95), weight_decay=0.01)
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.001)


def _data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, size * BATCH, 8, generator=generator), torch.randn(STEPS, size * BATCH, 4, generator=generator)


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, stand_in: bool = False
) -> None:
    """``stand_in``: give a parameter without a gradient zeros, as Horovod's optimizer (and Shoal's, sharded or not)
    does before the exchange, so weight decay moves it in the reference too."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # hyperparameters change per step
    for step in range(x.shape[0]):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step]), y[step]).backward()
        for param in model.parameters() if stand_in else ():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        optimizer.step()
        scheduler.step()


def _numpy_state(state: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {
        int(i): {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
        for i, entry in state["state"].items()
    }


def _reference(size: int, kind: str) -> tuple[dict[str, np.ndarray], dict[int, dict[str, Any]]]:
    torch.manual_seed(0)
    model = Net()
    optimizer = _optimizer(model, kind)
    x, y = _data(size)
    _train(model, optimizer, x, y, stand_in=True)
    return {k: v.numpy() for k, v in model.state_dict().items()}, _numpy_state(optimizer.state_dict())


def _sharded(kind: str, shard: str, bucket_bytes: int) -> dict[str, Any]:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())  # different on purpose: the parameters change after the optimizer is built
    model = Net()
    optimizer = hvd.DistributedOptimizer(
        _optimizer(model, kind), named_parameters=model.named_parameters(), shard=shard, bucket_bytes=bucket_bytes
    )
    if hvd.rank() == 0:
        torch.manual_seed(0)
        model.load_state_dict(Net().state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    x, y = _data(hvd.size())
    rows = slice(hvd.rank() * BATCH, (hvd.rank() + 1) * BATCH)
    _train(model, optimizer, x[:, rows], y[:, rows])
    shards = optimizer._shoal_shards  # type: ignore[attr-defined]
    # Stage 2 keeps no whole gradient after backward: the reduced one lives in the shards only.
    nn.functional.mse_loss(model(x[0, rows]), y[0, rows]).backward()
    optimizer.synchronize()  # type: ignore[attr-defined]
    grads_left = sum(p.grad is not None for p in model.parameters())
    optimizer.zero_grad()
    return {
        "weights": {k: v.numpy() for k, v in model.state_dict().items()},
        "state": _numpy_state(optimizer.state_dict()),
        "state_numel": shards.state_numel,
        "owned": shards.layout.owned,
        "total": shards.layout.total,
        "grads_left": grads_left,
    }


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_ranks_match_one_process_with_the_global_batch_and_hold_a_share_of_the_state(
    size: int, kind: str, shard: str
) -> None:
    weights, state = _reference(size, kind)
    bucket_bytes = 64 if size == 3 else 1 << 20  # many small buckets, or one bucket split N ways
    results = run_ranks(_sharded, size, args=(kind, shard, bucket_bytes), timeout_s=120)
    for rank, result in enumerate(results):
        for name, value in weights.items():
            np.testing.assert_allclose(result["weights"][name], value, atol=ATOL, err_msg=f"rank {rank}, {name}")
        assert result["state"].keys() == state.keys()
        for index, entry in state.items():
            for key, value in entry.items():
                np.testing.assert_allclose(result["state"][index][key], value, atol=ATOL, err_msg=f"rank {rank}, {index}.{key}")
        assert result["grads_left"] == (0 if shard == "gradients" else sum(1 for _ in Net().parameters()))
    total = results[0]["total"]
    assert sum(r["owned"] for r in results) == total
    assert max(r["owned"] for r in results) <= -(-total // size) + len(list(Net().parameters()))
    per_element = {"sgd": 1, "adam": 2}[kind]  # momentum; Adam's two moments
    assert [r["state_numel"] for r in results] == [per_element * r["owned"] for r in results]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_bytes", [0, 40, 1 << 20])
def test_the_layout_gives_every_element_to_exactly_one_rank_in_blocks_that_tile_each_bucket(
    size: int, bucket_bytes: int
) -> None:
    sizes, groups = [5, 1, 12, 7, 3], [0, 0, 1, 1, 0]
    owner = [np.zeros(n, dtype=int) for n in sizes]
    for rank in range(size):
        layout = ShardLayout(sizes, groups, 4, bucket_bytes, size, rank)
        assert sorted(p for b in layout.buckets for p in b.params) == list(range(len(sizes)))
        for bucket, pieces in zip(layout.buckets, layout.pieces, strict=True):
            assert sum(bucket.blocks) == bucket.numel and max(bucket.blocks) - min(bucket.blocks) <= 1
            assert sum(p.length for p in pieces) == bucket.blocks[rank]  # the pieces tile this rank's block
        for pieces in layout.pieces:
            for piece in pieces:
                owner[piece.param][piece.start : piece.start + piece.length] += 1
                assert groups[piece.param] == piece.group
        assert layout.owned == sum(layout.shard_sizes)
        for chunk_elements in (1, 10, 1000):  # the gathered values, a run of buckets at a time, land everywhere once
            landed = [np.zeros(n, dtype=int) for n in sizes]
            chunks = layout.gather_chunks(chunk_elements)
            assert chunks[0].owned_start == 0 and chunks[-1].owned_stop == layout.owned
            assert all(a.owned_stop == b.owned_start for a, b in itertools.pairwise(chunks))
            for chunk in chunks:
                for param, start, length, _ in chunk.runs:
                    landed[param][start : start + length] += 1
            assert all((n == 1).all() for n in landed)
    assert all((o == 1).all() for o in owner)


def _against_unsharded(shard: str, options: dict[str, Any]) -> float:
    """Train the same steps unsharded and sharded with ``options`` (each with backward passes of half a batch);
    return the largest difference between the two runs' weights."""
    hvd.init()
    torch.set_num_threads(1)
    passes = int(options.get("backward_passes_per_step", 1))
    clip = options.pop("clip", None)  # clip the reduced gradients to this global norm before each step
    compressions = {"fp16": hvd.Compression.fp16, "powersgd": hvd.Compression.powersgd(rank=2, warmup_steps=1)}
    options = {k: (compressions[v] if k == "compression" else v) for k, v in options.items()}
    x, y = _data(hvd.size())
    rows = slice(hvd.rank() * BATCH, (hvd.rank() + 1) * BATCH)
    finals, norms = [], []
    for sharding in (None, shard):
        torch.manual_seed(0)
        model = Net()
        optimizer = hvd.DistributedOptimizer(
            _optimizer(model, "adam"), named_parameters=model.named_parameters(), shard=sharding, **options
        )
        for step in range(STEPS):
            optimizer.zero_grad()
            for part in torch.arange(BATCH).chunk(passes):
                nn.functional.mse_loss(model(x[step, rows][part]), y[step, rows][part]).backward()
            if clip is None:
                optimizer.step()
                continue
            optimizer.synchronize()  # type: ignore[attr-defined]
            norms.append(float(optimizer.clip_grad_norm_(clip)))  # type: ignore[attr-defined]
            with optimizer.skip_synchronize():  # type: ignore[attr-defined]
                optimizer.step()
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    if clip is not None:  # the norms, before clipping, as both took them: every step clipped
        half = len(norms) // 2
        assert all(n > clip for n in norms), norms
        assert max(abs(a - b) for a, b in zip(norms[:half], norms[half:], strict=True)) < 1e-5, norms
    return float((finals[0] - finals[1]).abs().max())


# Each of Horovod's reduction options gives the sharded optimizer the gradients the unsharded one gets, and clipping
# by the global norm (across stage 2's shards) clips as torch.nn.utils.clip_grad_norm_ does over the whole model.
OPTIONS = {
    "backward_passes_per_step=2": {"backward_passes_per_step": 2},
    "op=Sum": {"op": hvd.Sum},
    "gradient_predivide_factor=2": {"gradient_predivide_factor": 2.0},
    "fp16 compression": {"compression": "fp16"},
    "clip_grad_norm_": {"clip": 0.05},
}


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_horovods_reduction_options_give_the_unsharded_weights(shard: str, case: str) -> None:
    for rank, difference in enumerate(run_ranks(_against_unsharded, 2, args=(shard, OPTIONS[case]), timeout_s=120)):
        assert difference < ATOL, f"{case}, rank {rank}: {difference}"


def test_stage_one_keeps_the_compressed_schemes() -> None:
    """PowerSGD (after one step of warm-up) still runs on the whole gradients at stage 1: the same weights as
    unsharded with it; stage 2 refuses it, as it refuses every per-layer scheme."""
    options = {"compression": "powersgd"}
    for rank, difference in enumerate(run_ranks(_against_unsharded, 2, args=("optimizer", options), timeout_s=120)):
        assert difference < ATOL, f"rank {rank}: {difference}"


def _resharded(kind: str, given: dict[str, Any]) -> dict[str, Any]:
    """Load a whole state saved by one process, on rank 0 alone, then continue on every rank, sharded."""
    hvd.init()
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in given["weights"].items()})
    optimizer = hvd.DistributedOptimizer(_optimizer(model, kind), named_parameters=model.named_parameters(), shard="gradients")
    if hvd.rank() == 0:
        optimizer.load_state_dict(given["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    x, y = _data(hvd.size())
    rows = slice(hvd.rank() * BATCH, (hvd.rank() + 1) * BATCH)
    for step in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step, rows]), y[step, rows]).backward()
        optimizer.step()
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_a_whole_state_loads_into_a_sharded_optimizer_and_training_goes_on_as_in_one_process() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = _optimizer(model, "adam")
    x, y = _data(3)
    _train(model, optimizer, x, y, stand_in=True)  # one process's state, to resume from on 3 ranks
    saved = {
        "weights": {k: v.numpy().copy() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
    }
    for step in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step]), y[step]).backward()
        model.unused.weight.grad, model.unused.bias.grad = torch.zeros(3, 3), torch.zeros(3)  # Horovod's stand-in
        optimizer.step()
    for rank, weights in enumerate(run_ranks(_resharded, 3, args=("adam", saved), timeout_s=120)):
        for name, value in model.state_dict().items():
            np.testing.assert_allclose(weights[name], value.numpy(), atol=ATOL, err_msg=f"rank {rank}, {name}")


def _refusals() -> list[str]:
    hvd.init()
    model = Net()
    errors = []
    for build in (
        lambda: hvd.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), shard="optimizer"),
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard="zero3"),
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=2, comm="sfb", model=model),
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=1, comm="ps"),
    ):
        with pytest.raises(ValueError) as caught:
            build()
        errors.append(str(caught.value))
    return errors


def test_what_sharding_cannot_serve_is_refused_before_training() -> None:
    errors = run_ranks(_refusals, 2)[0]
    assert "LBFGS may read more than its shard" in errors[0]
    assert "'zero3'" in errors[1] and "'optimizer'" in errors[1]
    assert "shard='gradients'" in errors[2] and "shard='optimizer'" in errors[2]
    assert "comm='ps'" in errors[3]


def test_shard_names_and_stage_numbers() -> None:
    assert Shard.parse(None) is Shard.NONE and Shard.parse(0) is Shard.NONE
    assert Shard.parse(1) is Shard.OPTIMIZER and Shard.parse("optimizer") is Shard.OPTIMIZER
    assert Shard.parse(2) is Shard.GRADIENTS and Shard.parse("gradients") is Shard.GRADIENTS
    with pytest.raises(ValueError, match="ZeRO stage 0, 1 or 2"):
        Shard.parse(3)
    with pytest.raises(ValueError, match="ZeRO stage"):
        Shard.parse(True)


def test_shard_benchmark_compares_stages_with_ddp_and_torch_zero_in_one_run(tmp_path: Path) -> None:
    command = [*SHOALRUN, "-np", "2", sys.executable, "-m", "shoal.bench.shard", "--model", "mlp"]
    command += ["--batch-size", "8", "--steps", "2", "--warmup", "1", "--rounds", "1", "--json", str(tmp_path / "shard.json")]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1].split(":", 1)[1])
    assert json.loads((tmp_path / "shard.json").read_text()) == summary  # --json writes the same object
    assert summary["bench"] == "shard" and summary["world"] == 2 and summary["solo_ips"] > 0
    phases = summary["phases"]
    assert list(phases) == ["ddp", "torch_zero1", "shoal", "shoal_optimizer", "shoal_gradients"]
    adam_bytes = 2 * 4 * summary["params"]  # two fp32 moments per parameter
    assert phases["ddp"]["state_bytes"] >= adam_bytes and phases["shoal"]["state_bytes"] >= adam_bytes
    for stage in ("shoal_optimizer", "shoal_gradients"):  # an even half each (+ the step counts), whatever the layers
        assert adam_bytes / 2 <= phases[stage]["state_bytes"] <= adam_bytes / 2 + 64
        assert summary[f"{stage}_state_share"] < 0.51
    assert phases["shoal_gradients"]["grad_bytes"] <= phases["shoal"]["grad_bytes"] / 2 + 64  # stage 2: half the grads
    for name, phase in phases.items():
        assert phase["ips"] > 0 and summary[f"{name}_ratio"] > 0
        assert phase["max_abs_diff"] < 1e-5, name  # the same training, whichever way it is sharded
        if name.startswith("shoal"):  # the prediction is reported beside the measurement (the targets: the bench's)
            assert phase["predicted_held_bytes"] > 0 and phase["predicted_peak_bytes"] >= phase["predicted_held_bytes"]
            assert phase["held_error"] == phase["predicted_held_bytes"] / phase["held_bytes"] - 1


def test_the_memory_prediction_holds_each_part_once_and_shards_what_each_stage_shards() -> None:
    model = ModelMemory(param_bytes=1000, state_per_element=2.0, step_temporaries=1.0, activation_bytes=50)
    none, optimizer, gradients = estimates(model, ranks=4)
    assert none.parts == {"parameters": 1000, "gradients": 1000, "optimizer state": 2000}
    assert none.peak == 4000 + 1000 + 50  # Adam's temporaries over every parameter, and the activations
    shared = ModelMemory(param_bytes=1000, state_per_element=2.0, step_temporaries=0.5, in_flight_bytes=800, adopts_shared=True)
    assert estimate(shared, 4, "none").peak == 4000 + 1000  # the gradients' move into shared memory outweighs the step
    assert estimate(shared, 4, "gradients").peak == estimate(shared, 4, "gradients").held + 800 + 200  # backward
    assert optimizer.parts == {"parameters": 1000, "gradients": 1000, "optimizer state": 500, "shards": 250}
    assert optimizer.peak == optimizer.held + 250 + 250 + 50  # temporaries over the shard, the gradients' copy
    assert gradients.parts == {"parameters": 1000, "gradients": 250, "optimizer state": 500, "shards": 250}
    assert none.held > optimizer.held > gradients.held
    assert estimate(model, 1, "gradients").held == 1000 + 1000 + 2000 + 1000  # one rank: the shards are a copy
    with pytest.raises(ValueError, match="unknown shard option"):
        estimate(model, 2, "zero3")
    with pytest.raises(ValueError, match="cannot be negative"):
        ModelMemory(param_bytes=-1, state_per_element=1.0)


def test_the_optimizer_state_per_element_follows_the_class_and_its_hyperparameters() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    assert state_per_element(torch.optim.SGD(params, lr=0.1)) == 0.0
    assert state_per_element(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == 1.0
    assert state_per_element(torch.optim.Adam(params)) == 2.0
    assert state_per_element(torch.optim.Adam(params, amsgrad=True)) == 3.0
    assert state_per_element(torch.optim.RMSprop(params, momentum=0.9, centered=True)) == 3.0
    assert state_per_element(torch.optim.Adagrad(params)) == 1.0
    memory = model_memory(torch.optim.Adam([*params, nn.Parameter(torch.zeros(5))]), bucket_bytes=16, local_size=2)
    assert memory.param_bytes == 32 and memory.adopts_shared
    assert memory.in_flight_bytes == 20 + 12  # the two largest buckets: a 20-byte parameter alone, then 12 bytes
