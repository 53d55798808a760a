"""DistributedOptimizer, state broadcast, compression, SyncBatchNorm and join, against single-process references.

Reference rule: N ranks x batch B must give the weights of one process with batch N*B. Tolerance: fp32 weights
agree within atol 1e-5 (the only difference is the order of floating-point summation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import shoal.torch as hvd
from shoal.core import session as handles
from shoal.testing import run_ranks
from shoal.torch.optimizer import exchange_of

pytestmark = pytest.mark.check  # the quick tier: make check

BATCH = 4
STEPS = 3
ATOL = 1e-5


class Net(nn.Module):
    def __init__(self, unused_branch: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4) if unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def data(size: int, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(STEPS, passes, size * BATCH, 8, generator=generator)
    y = torch.randn(STEPS, passes, size * BATCH, 4, generator=generator)
    return x, y


def train(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    for step in range(x.shape[0]):
        optimizer.zero_grad()
        for micro in range(x.shape[1]):
            nn.functional.mse_loss(model(x[step, micro]), y[step, micro]).backward()
        optimizer.step()


def reference(size: int, passes: int, unused_branch: bool) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = Net(unused_branch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data(size, passes)
    train(model, optimizer, x, y)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def _distributed(passes: int, unused_branch: bool, options: dict[str, object]) -> dict[str, np.ndarray]:
    hvd.init()
    torch.manual_seed(hvd.rank())  # different on purpose: the broadcast must fix it
    model = Net(unused_branch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if options.pop("same_init", True):
        torch.manual_seed(0)
        model.load_state_dict(Net(unused_branch).state_dict())
    if options.pop("num_groups", 0):
        options["num_groups"] = 2
    if "overlap" in options:  # the overlap_backward setting, as SHOAL_OVERLAP_BACKWARD would give it
        handles.engine().config.overlap_backward = bool(options.pop("overlap"))
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=passes, **options
    )  # type: ignore[arg-type]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    x, y = data(hvd.size(), passes)
    rows = slice(hvd.rank() * BATCH, (hvd.rank() + 1) * BATCH)
    train(model, optimizer, x[:, :, rows], y[:, :, rows])
    return {k: v.numpy() for k, v in model.state_dict().items()}


CASES = {
    "plain": (1, False, {}),
    "backward_passes_per_step=2": (2, False, {}),
    "gradient_predivide_factor=2": (1, False, {"gradient_predivide_factor": 2.0}),
    "num_groups=2": (1, False, {"num_groups": 2}),
    "unused branch": (1, True, {}),
    # One gradient per bucket: each leaves as soon as it is final, or every one waits for the end of backward.
    "buckets overlapping backward": (2, True, {"bucket_bytes": 1, "overlap": True}),
    "buckets held to the end of backward": (2, True, {"bucket_bytes": 1, "overlap": False}),
}


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_n_ranks_match_one_process_with_n_times_the_batch(size: int, case: str) -> None:
    passes, unused, options = CASES[case]
    expected = reference(size, passes, unused)
    for rank, weights in enumerate(run_ranks(_distributed, size, args=(passes, unused, dict(options)), timeout_s=120)):
        for name, value in expected.items():
            np.testing.assert_allclose(weights[name], value, atol=ATOL, err_msg=f"{case}: rank {rank}, {name}")


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_stays_close_to_fp32(compression: str) -> None:
    expected = reference(2, 1, False)
    options = {"compression": getattr(hvd.Compression, compression)}
    tolerance = {"fp16": 2e-3, "bf16": 2e-2}[compression]  # stated: fp16 ~ 11 bits, bf16 ~ 8 bits of mantissa
    for weights in run_ranks(_distributed, 2, args=(1, False, options)):
        for name, value in expected.items():
            np.testing.assert_allclose(weights[name], value, atol=tolerance, err_msg=name)


def _broadcast_state() -> dict[str, object]:
    hvd.init()
    torch.manual_seed(100 + hvd.rank())
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1), betas=(0.8 + 0.05 * hvd.rank(), 0.99))
    nn.functional.mse_loss(model(torch.randn(3, 8)), torch.randn(3, 4)).backward()
    optimizer.step()  # rank-specific, non-empty state
    fresh = torch.optim.SGD(Net().parameters(), lr=0.3 + hvd.rank(), momentum=0.5 * hvd.rank())  # empty state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    state = optimizer.state_dict()
    return {
        "weights": {k: v.numpy() for k, v in model.state_dict().items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        "state": {
            i: {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for i, s in state["state"].items()
        },
        "fresh": [{k: v for k, v in g.items() if k != "params"} for g in fresh.state_dict()["param_groups"]],
        "fresh_state": len(fresh.state_dict()["state"]),
    }


def test_broadcast_makes_parameters_and_optimizer_state_identical() -> None:
    results = run_ranks(_broadcast_state, 3)
    root = results[0]
    assert root["groups"][0]["lr"] == 0.01 and root["fresh"][0]["lr"] == 0.3  # type: ignore[index]
    for result in results[1:]:
        for name, value in root["weights"].items():  # type: ignore[attr-defined]
            np.testing.assert_array_equal(result["weights"][name], value)  # type: ignore[index]
        assert result["groups"] == root["groups"] and result["fresh"] == root["fresh"]
        assert result["fresh_state"] == 0
        for index, state in root["state"].items():  # type: ignore[attr-defined]
            for key, value in state.items():
                np.testing.assert_array_equal(result["state"][index][key], value)  # type: ignore[index]


def _sync_batch_norm(x_all: torch.Tensor) -> dict[str, np.ndarray]:
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    rows = x_all.shape[0] // size
    x = x_all[rank * rows : (rank + 1) * rows].clone().requires_grad_(True)
    torch.manual_seed(0)
    layer = hvd.SyncBatchNorm(3)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        layer.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    out = layer(x)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).add(rank * out.numel())).sum().backward()
    grad_w = hvd.allreduce(layer.weight.grad, op=hvd.Sum)
    grad_b = hvd.allreduce(layer.bias.grad, op=hvd.Sum)
    return {
        "out": out.detach().numpy(),
        "grad_x": x.grad.numpy(),
        "grad_w": grad_w.numpy(),
        "grad_b": grad_b.numpy(),
        "running_mean": layer.running_mean.numpy(),
        "running_var": layer.running_var.numpy(),
    }


@pytest.mark.parametrize("size", [2, 3])
def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(size: int) -> None:
    x_all = torch.randn(size * 4, 3, 5, generator=torch.Generator().manual_seed(7)) * 3 + 1
    results = run_ranks(_sync_batch_norm, size, args=(x_all,))
    reference_layer = nn.BatchNorm1d(3)
    with torch.no_grad():
        reference_layer.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        reference_layer.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = x_all.clone().requires_grad_(True)
    out = reference_layer(x)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    rows = x_all.shape[0] // size
    for rank, result in enumerate(results):
        part = slice(rank * rows, (rank + 1) * rows)
        np.testing.assert_allclose(result["out"], out.detach().numpy()[part], atol=1e-5)
        np.testing.assert_allclose(result["grad_x"], x.grad.numpy()[part], atol=1e-3, rtol=1e-4)
        np.testing.assert_allclose(result["grad_w"], reference_layer.weight.grad.numpy(), rtol=1e-4)
        np.testing.assert_allclose(result["grad_b"], reference_layer.bias.grad.numpy(), rtol=1e-4)
        np.testing.assert_allclose(result["running_mean"], reference_layer.running_mean.numpy(), atol=1e-6)
        np.testing.assert_allclose(result["running_var"], reference_layer.running_var.numpy(), atol=1e-5)


def _uneven_with_join() -> tuple[int, int, bool]:
    hvd.init()
    torch.manual_seed(0)
    model = Net()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    batches = 5 if hvd.rank() == 0 else 2
    for _ in range(batches):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
        optimizer.step()
    last = hvd.join()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return batches, last, finite


def test_join_with_uneven_batches_does_not_hang() -> None:
    results = run_ranks(_uneven_with_join, 2, timeout_s=60)
    assert results == [(5, 0, True), (2, 0, True)]


def _rank_dependent_unused_branch() -> list[float]:
    hvd.init()
    torch.manual_seed(0)
    model = Net(unused_branch=True)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters())
    with torch.no_grad():
        before = model.unused.weight.clone()  # type: ignore[union-attr]
    hidden = torch.relu(model.fc1(torch.ones(2, 8)))
    loss = model.fc2(hidden).sum()
    if hvd.rank() == 0:  # only rank 0 uses the branch this step
        loss = loss + model.unused(hidden).sum()  # type: ignore[misc]
    loss.backward()
    optimizer.step()
    return (before - model.unused.weight).sum(1).tolist()  # type: ignore[union-attr]


def test_a_parameter_without_gradient_on_some_ranks_does_not_deadlock() -> None:
    results = run_ranks(_rank_dependent_unused_branch, 2, timeout_s=60)
    assert results[0] == pytest.approx(results[1])  # both ranks applied the same averaged update
    assert any(abs(v) > 0 for v in results[0])


def _guards() -> list[str]:
    hvd.init()
    model = Net()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    messages = []
    nn.functional.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
    try:
        optimizer.zero_grad()
    except AssertionError as error:
        messages.append(str(error))
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with optimizer.skip_synchronize():
        optimizer.step()
    messages.append(f"clipped {sum(float(p.grad.norm() ** 2) for p in model.parameters()) ** 0.5:.4f}")
    assert isinstance(optimizer, torch.optim.SGD)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[("a", model.fc1.weight)])
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_zero_grad_guard_skip_synchronize_and_naming_errors() -> None:
    messages = run_ranks(_guards, 2)[0]
    assert "zero_grad() was called after loss.backward()" in messages[0]
    assert messages[1] == "clipped 0.0100"
    assert "not in it" in messages[2]


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 3, sparse=True)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.embedding(index).sum()


def _sparse_adam(distributed: bool, rows: list[list[int]]) -> list[float]:
    """SparseAdam on an embedding with sparse gradients: each rank's rows, or every rank's rows in one process."""
    if distributed:
        hvd.init()
    torch.manual_seed(0)
    model = Embedder()
    optimizer: torch.optim.Optimizer = torch.optim.SparseAdam(model.parameters(), lr=0.1)
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), sparse_as_dense=True)
    for _ in range(2):
        optimizer.zero_grad()
        if distributed:
            model(torch.tensor(rows[hvd.rank()])).backward()
        else:  # the mean of the ranks' losses
            (sum(model(torch.tensor(r)) for r in rows) / len(rows)).backward()
        optimizer.step()
        assert model.embedding.weight.grad is not None and model.embedding.weight.grad.is_sparse
    return model.embedding.weight.detach().reshape(-1).tolist()


def test_sparse_as_dense_gives_sparse_adam_a_sparse_gradient_again() -> None:
    """Horovod turns the densely reduced gradient back into a sparse one before the update."""
    rows = [[1, 2, 2], [2, 7, 9]]
    results = run_ranks(_sparse_adam, 2, args=(True, rows))
    reference = _sparse_adam(False, rows)
    for weights in results:
        np.testing.assert_allclose(weights, reference, atol=ATOL)


class SometimesEmbedded(nn.Module):
    """Two sparse embeddings, the first of which a forward pass may skip (its gradient is then None on that rank),
    and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Embedding(10, 3, sparse=True)
        self.second = nn.Embedding(10, 3, sparse=True)
        self.head = nn.Linear(3, 1)

    def forward(self, index: torch.Tensor, embed: bool) -> torch.Tensor:
        features = self.second(index).mean(0) + (self.first(index).mean(0) if embed else 0.0)
        return self.head(features).sum()


def _skipped_embedding(distributed: bool, case: str, skipped_step: int) -> list[float]:
    """SGD on ``SometimesEmbedded`` for 3 steps, rank 1 skipping the first embedding at ``skipped_step``; without
    ``distributed``, one process with the mean of both ranks' losses. ``case``: the optimizer gets ``model=``
    ("model-given"), also PowerSGD at full rank for every gradient ("compressed"), or no model ("seen-before")."""
    if distributed:
        hvd.init()
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model = SometimesEmbedded()
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if distributed:
        compression = hvd.Compression.powersgd(rank=3, warmup_steps=0, min_compression_rate=0.0)
        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            model=None if case == "seen-before" else model,
            compression=compression if case == "compressed" else hvd.Compression.none,
        )
    rows = [torch.tensor([1, 2, 2]), torch.tensor([2, 7, 9])]
    for step in range(3):
        optimizer.zero_grad()
        embeds = [True, step != skipped_step]
        if distributed:
            model(rows[hvd.rank()], embeds[hvd.rank()]).backward()
        else:
            (sum(model(r, e) for r, e in zip(rows, embeds, strict=True)) / 2).backward()
        optimizer.step()
    return [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]


@pytest.mark.parametrize(
    ("case", "skipped_step"), [("model-given", 0), ("compressed", 0), ("seen-before", 1)], ids=lambda v: str(v)
)
def test_a_rank_without_a_sparse_gradient_stands_in_an_empty_sparse_one(case: str, skipped_step: int) -> None:
    """Where the others allgather a sparse embedding gradient, a rank that skipped the embedding stands in an empty
    sparse gradient (known from the model's sparse embeddings, or from a step that every rank reduced it as sparse),
    also where PowerSGD would take a dense one; a dense zero stood in there waited forever. Its reduction starts
    with the others' before any is waited for (the stand-in comes last on its rank). Weights as one process with
    both ranks' losses (PowerSGD at full rank equals the allreduce)."""
    results = run_ranks(_skipped_embedding, 2, args=(True, case, skipped_step), timeout_s=60)
    reference = _skipped_embedding(False, case, skipped_step)
    for weights in results:
        np.testing.assert_allclose(weights, reference, atol=ATOL)


def _learnt_sparse_across_a_reinit() -> list[bool]:
    """Whether the first embedding's weight is known sparse: before any step, after one, after a re-init."""
    hvd.init()
    model = SometimesEmbedded()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    exchange = exchange_of(optimizer)
    known = [id(model.first.weight) in exchange.sparse.known()]
    model(torch.tensor([1, 2]), True).backward()
    optimizer.step()
    known.append(id(model.first.weight) in exchange.sparse.known())
    hvd.shutdown()
    hvd.init()  # as after an elastic change: new members know nothing of the last session
    known.append(id(model.first.weight) in exchange.sparse.known())
    return known


def test_what_every_rank_learnt_is_sparse_is_forgotten_at_a_reinit() -> None:
    assert run_ranks(_learnt_sparse_across_a_reinit, 1, timeout_s=60)[0] == [False, True, False]


def _step_after_synchronize() -> list[str]:
    import warnings

    hvd.init()
    model = Net()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = hvd.DistributedOptimizer(plain)
    nn.functional.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    # Whatever the step did, the user's optimizer holds only the exchange and Horovod's names; the exchange has no
    # __dict__ to grow.
    added = sorted(set(vars(optimizer)) - set(vars(plain)))
    exchange = optimizer._shoal_exchange  # type: ignore[attr-defined]
    slotted = [str(hasattr(exchange, "__dict__"))]
    names = sorted(optimizer._parameter_names.values())  # type: ignore[attr-defined]
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    return [str(w.message) for w in caught] + added + slotted + names + sorted(named._parameter_names.values())  # type: ignore[attr-defined]


def test_step_after_synchronize_warns_and_parameter_names_exist_without_named_parameters() -> None:
    out = run_ranks(_step_after_synchronize, 2)[0]
    assert out[0].startswith(
        "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize()."
    )
    assert out[1:4] == ["_parameter_names", "_shoal_exchange", "False"]
    assert out[4:8] == ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.0.2", "allreduce.noname.0.3"]
    assert out[8:] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]


def _submitted_during_backward(overlap: bool | None, threads: int) -> tuple[bool, int, bool]:
    """After backward and before step(): whether the decision is to overlap, how many gradients were submitted, and
    whether the step still matches the plain exchange's result."""
    hvd.init()
    torch.set_num_threads(threads)
    handles.engine().config.overlap_backward = overlap
    torch.manual_seed(0)
    model = Net()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), bucket_bytes=1
    )
    x, y = data(hvd.size(), 1)
    rows = slice(hvd.rank() * BATCH, (hvd.rank() + 1) * BATCH)
    nn.functional.mse_loss(model(x[0, 0, rows]), y[0, 0, rows]).backward()
    exchange = exchange_of(optimizer)
    submitted = exchange.sent
    decided = exchange.buckets.overlap
    optimizer.step()
    grads = hvd.allgather(torch.cat([p.grad.flatten() for p in model.parameters()]).unsqueeze(0))
    return decided, submitted, bool(torch.equal(grads[0], grads[-1]))


@pytest.mark.parametrize(
    ("overlap", "threads"),
    [(True, 1), (False, 1), (None, 1), (None, 4)],
    ids=["on", "off", "automatic, 1 thread per rank", "automatic, 4 threads per rank"],
)
def test_overlap_backward_decides_when_buckets_leave(overlap: bool | None, threads: int) -> None:
    """On, each full bucket (here: each gradient) is submitted during backward; off, none is until step(). Unset,
    it is off where the ranks' compute threads fill the host's cores (two ranks on one host, CPU gradients through
    shared memory; on CI's 2 cores that is every case here), on where cores are left over. The gradients agree."""
    import os

    expected = overlap if overlap is not None else 2 * threads < len(os.sched_getaffinity(0))
    for decided, submitted, agreed in run_ranks(_submitted_during_backward, 2, args=(overlap, threads), timeout_s=120):
        assert decided is expected
        assert submitted == (4 if expected else 0), submitted  # fc1 and fc2: weight and bias each
        assert agreed
