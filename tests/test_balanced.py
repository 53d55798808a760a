"""BalancedLoader: a world-size-invariant global batch of micro-batches, shared out by speed.

Reference rule: any number of ranks, with any shares of a step's micro-batches (zero included, a short last
micro-batch included), gives the weights of one process that takes the whole global batch in one backward pass.
Tolerance: fp32 weights within atol 1e-5 (only the order of the floating-point sums differs). The deterministic mode
must be bitwise identical across world sizes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

import shoal.torch as hvd
from shoal.core.balance import MicroBatchSchedule, ShareBalancer, StepPlan, equal_shares, split_by_cost
from shoal.testing import run_ranks
from workers.balanced_elastic import GLOBAL_BATCH, MICRO_BATCH, SAMPLES, SEED, Net, dataset, optimizer_for, reference_weights

pytestmark = pytest.mark.check

ATOL = 1e-5


def reference(kind: str, epochs: int) -> dict[str, np.ndarray]:
    """One process, the whole global batch of each step in one backward pass."""
    return {name: np.array(value, dtype=np.float32) for name, value in reference_weights(epochs, kind).items()}


class FixedShares(ShareBalancer):
    """Shares chosen by the test: a rotating list per step (for steps with fewer micro-batches: the first ranks)."""

    def __init__(self, size: int, patterns: list[list[int]]) -> None:
        super().__init__(size)
        self.patterns = patterns
        self.calls = 0

    def choose_shares(self, count: int) -> list[int]:
        fitting = [p for p in self.patterns if sum(p) == count]
        self.calls += 1
        return fitting[self.calls % len(fitting)] if fitting else equal_shares(count, self.size)


def _train(kind: str, epochs: int, options: dict[str, object]) -> dict[str, object]:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    optimizer = optimizer_for(model, kind)
    patterns = options.pop("patterns", None)
    slow_rank = options.pop("slow_rank", None)  # this rank sleeps 20 ms per micro-batch: its share must fall
    scheme = {key: options.pop(key) for key in ("bucket_bytes", "comm", "compression", "shard") if key in options}
    if "compression" in scheme:
        scheme["compression"] = getattr(hvd.Compression, str(scheme["compression"]))
    loader = hvd.BalancedLoader(dataset(), GLOBAL_BATCH, MICRO_BATCH, shuffle=True, seed=SEED, **options)  # type: ignore[arg-type]
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), loader=loader, model=model, **scheme
    )  # type: ignore[arg-type]
    if patterns is not None:
        loader.balancer = FixedShares(hvd.size(), patterns)  # type: ignore[arg-type]
    seen: list[int] = []
    shares = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for step in loader:
            optimizer.zero_grad()
            seen += step.indices
            for x, y in step:
                nn.functional.mse_loss(model(x), y).backward()
                if hvd.rank() == slow_rank:
                    time.sleep(0.02)
            optimizer.step()
            assert loader.plan is not None
            shares.append(loader.plan.shares)
    return {"weights": {k: v.numpy() for k, v in model.state_dict().items()}, "seen": seen, "shares": shares}


# Each step's micro-batches (4, or 2 in the epoch's last step) over the ranks, zero shares included.
PATTERNS = {
    2: [[4, 0], [1, 3], [0, 4], [2, 2], [0, 2], [1, 1]],
    3: [[2, 0, 2], [0, 0, 4], [1, 2, 1], [0, 1, 1], [0, 2, 0]],
}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_uneven_shares_match_one_process_over_the_global_batch(size: int, kind: str) -> None:
    expected = reference(kind, epochs=2)
    results = run_ranks(_train, size, args=(kind, 2, {"patterns": PATTERNS[size]}), timeout_s=120)
    every: list[int] = []
    for rank, result in enumerate(results):
        every += result["seen"]
        for name, value in expected.items():
            np.testing.assert_allclose(result["weights"][name], value, atol=ATOL, err_msg=f"rank {rank}, {name}")
    assert any(0 in s for s in results[0]["shares"]), "no step gave a rank zero micro-batches"
    assert sorted(every) == sorted(list(range(SAMPLES)) * 2), "a sample was lost or repeated"


# Every scheme that sends the optimizer's gradients keeps the rule: one gradient per bucket leaving as soon as it is
# final (overlapping the last micro-batch), fp16 (tolerance 2e-3: an 11-bit mantissa on the wire), the parameter
# server (co-located, BSP), and sfb, which falls back to allreduce under the loader (exact).
SCHEMES = {
    "one gradient per bucket": ({"bucket_bytes": 1}, ATOL),
    "fp16": ({"compression": "fp16"}, 2e-3),
    "parameter server": ({"comm": "ps"}, ATOL),
    "sfb": ({"comm": "sfb"}, ATOL),
    # A rank's micro-batches joined into passes of up to 8 samples (two of 4, or 4 and the short 2).
    "passes of two micro-batches": ({"max_pass_size": 8}, ATOL),
    # Sharded optimizer state (ZeRO stage 1), and the gradients reduce-scattered into shards too (stage 2).
    "shard optimizer": ({"shard": "optimizer"}, ATOL),
    "shard gradients": ({"shard": "gradients", "bucket_bytes": 64}, ATOL),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_scheme_keeps_the_rule(scheme: str) -> None:
    options, tolerance = SCHEMES[scheme]
    expected = reference("sgd", epochs=1)
    for result in run_ranks(_train, 2, args=("sgd", 1, {"patterns": PATTERNS[2], **options}), timeout_s=120):
        for name, value in expected.items():
            np.testing.assert_allclose(result["weights"][name], value, atol=tolerance, err_msg=f"{scheme}: {name}")


def test_measured_shares_give_the_same_weights_on_one_two_and_three_ranks() -> None:
    # 20 steps: 5 epochs of 4 steps, with shares from the ranks' measured speed; rank 0 is slowed (20 ms per
    # micro-batch, against well under 1 ms of compute), so the measured shares must move work off it: equal shares
    # give it 2 of a step's 4 micro-batches (on 2 and on 3 ranks), measured ones the 1 that keeps it measured.
    runs = {size: run_ranks(_train, size, args=("sgd", 5, {"slow_rank": 0}), timeout_s=120)[0] for size in (1, 2, 3)}
    for size in (2, 3):
        shares = runs[size]["shares"]
        assert len(shares) == 20
        assert list(shares[0]) == equal_shares(4, size) and shares[0][0] == 2  # nothing measured before the first step
        full_steps = [s for s in shares[-8:] if sum(s) == 4]  # the epochs' last steps hold 2 micro-batches
        assert full_steps and all(s[0] == 1 for s in full_steps), shares
        for name, value in runs[1]["weights"].items():
            np.testing.assert_allclose(runs[size]["weights"][name], value, atol=ATOL, err_msg=f"{size} ranks, {name}")


def test_deterministic_mode_is_bitwise_identical_across_world_sizes() -> None:
    options = {"deterministic": True}
    runs = {size: run_ranks(_train, size, args=("adam", 3, dict(options)), timeout_s=120) for size in (1, 2, 3)}
    expected = runs[1][0]["weights"]
    for size in (2, 3):
        for rank, result in enumerate(runs[size]):
            for name, value in expected.items():
                assert np.array_equal(result["weights"][name], value), f"{size} ranks, rank {rank}, {name} differs"
    patterned = run_ranks(_train, 3, args=("adam", 3, {"deterministic": True, "patterns": PATTERNS[3]}), timeout_s=120)
    for name, value in expected.items():
        assert np.array_equal(patterned[1]["weights"][name], value), f"zero shares, {name} differs"


# ----- the rules, in one process -----


def test_a_steps_micro_batches_do_not_depend_on_the_world() -> None:
    schedule = MicroBatchSchedule(SAMPLES, GLOBAL_BATCH, MICRO_BATCH, seed=SEED)
    assert schedule.steps_per_epoch == 4
    steps = [schedule.micro_batches(0, s) for s in range(4)]
    assert [len(m) for s in steps for m in s] == [4] * 13 + [2]
    assert sorted(i for s in steps for m in s for i in m) == list(range(SAMPLES))
    assert schedule.micro_batches(1, 0) != steps[0]  # a new permutation each epoch
    dropped = MicroBatchSchedule(SAMPLES, GLOBAL_BATCH, MICRO_BATCH, seed=SEED, drop_last=True)
    assert dropped.steps_per_epoch == 3


def test_shares_follow_cost_and_keep_every_rank_measured() -> None:
    assert split_by_cost(8, [1.0, 1.0]) == [4, 4]
    assert split_by_cost(8, [1.0, 3.0], minimum=1) == [6, 2]
    assert split_by_cost(8, [1.0, 100.0], minimum=1) == [7, 1]
    assert split_by_cost(2, [1.0, 1.0, 1.0], minimum=1) == [1, 1, 0]
    balancer = ShareBalancer(2)
    assert balancer.choose_shares(8) == [4, 4]  # nothing measured yet
    balancer.observe([0.4, 1.2], [4, 4])
    assert balancer.choose_shares(8) == [6, 2]
    balancer.observe([0.6, 0.62], [6, 2])  # noise around the balanced point: the shares stay
    assert balancer.choose_shares(8) == [6, 2]
    off = ShareBalancer(2, balance=False)
    off.observe([0.4, 1.2], [4, 4])
    assert off.choose_shares(8) == [4, 4]


def test_step_plan_ranges_and_checks() -> None:
    plan = StepPlan(0, 0, ((1, 2), (3, 4), (5,)), (1, 0, 2), rank=2)
    assert plan.mine == ((3, 4), (5,)) and plan.first == 1 and plan.total_samples == 5
    assert plan.passes(2) == [(3, 4), (5,)] and plan.passes(3) == [(3, 4, 5)]
    with pytest.raises(ValueError, match="add up"):
        StepPlan(0, 0, ((1,),), (1, 1), rank=0)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        MicroBatchSchedule(10, 6, 4)


def _misuse(case: str) -> str:
    hvd.init()
    model = Net()
    loader = hvd.BalancedLoader(dataset(), GLOBAL_BATCH, MICRO_BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        if case == "no optimizer":
            next(iter(loader))
        elif case == "sum":
            hvd.DistributedOptimizer(optimizer, loader=loader, op=hvd.Sum)
        elif case == "passes":
            hvd.DistributedOptimizer(optimizer, loader=loader, backward_passes_per_step=2)
        elif case == "short step":
            wrapped = hvd.DistributedOptimizer(optimizer, loader=loader)
            step = next(iter(loader))
            for x, y in step:
                nn.functional.mse_loss(model(x), y).backward()
                break
            wrapped.step()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no optimizer", "pass loader= to hvd.DistributedOptimizer"),
        ("sum", "needs op=Average"),
        ("passes", "leave backward_passes_per_step at 1"),
        ("short step", "after 1 of this rank's 4 passes"),
    ],
)
def test_misuse_gets_a_clear_error(case: str, expected: str) -> None:
    assert expected in run_ranks(_misuse, 1, args=(case,), timeout_s=60)[0]


def _set_epoch_twice() -> dict[str, object]:
    import warnings

    hvd.init()
    model = Net()
    loader = hvd.BalancedLoader(dataset(), GLOBAL_BATCH, MICRO_BATCH)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loader=loader)

    def train_on() -> int:
        steps = 0
        for step in loader:
            optimizer.zero_grad()
            for x, y in step:
                nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            steps += 1
        return steps

    def run_epoch(epoch: int) -> tuple[int, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader.set_epoch(epoch)
        return train_on(), [str(w.message) for w in caught]

    first = run_epoch(0)
    again = run_epoch(0)  # the loop run twice: it would train nothing, so it says so
    committed = loader.state_dict()
    loader.load_state_dict(committed)  # an elastic restore at the end of the epoch: nothing left, on purpose
    restored = run_epoch(0)
    following = run_epoch(1)
    loader.load_state_dict({"epoch": 2, "step": 2})  # restored mid-epoch, then finished by iterating it here
    rest = train_on()
    return {"first": first, "again": again, "restored": restored, "next": following, "rest": rest, "over": run_epoch(2)}


def test_asking_again_for_an_epoch_the_loader_finished_warns_that_it_trains_nothing() -> None:
    result = run_ranks(_set_epoch_twice, 1, timeout_s=60)[0]
    assert result["first"] == (4, [])
    steps, messages = result["again"]  # type: ignore[misc]
    assert steps == 0 and len(messages) == 1 and "epoch 0 is already finished" in messages[0], messages
    assert result["restored"] == (0, [])
    assert result["next"] == (4, [])
    assert result["rest"] == 2  # the restored epoch's last two steps
    steps, messages = result["over"]  # type: ignore[misc]
    assert steps == 0 and len(messages) == 1 and "epoch 2 is already finished" in messages[0], messages
