"""The global batch as micro-batches, shared out by measured speed: the framework-neutral rules.

A step's global batch of B samples is cut into micro-batches of b samples (the last one of an epoch may be short).
Which samples a step holds depends only on the epoch's seeded permutation and the step's number, never on the world
size, so a run's sequence of global batches is the same on 1, 2 or 3 ranks and through elastic changes (VirtualFlow,
MLSys'22, calls them virtual nodes). Each step, rank r runs a contiguous range of the step's micro-batches; how many
(its share) follows its measured compute time per micro-batch, agreed by every rank from the same gathered figures,
so every rank computes the same shares without a coordinator.

The gradient rule: with a mean loss per micro-batch, micro-batch j of n_j samples contributes n_j / N of the global
batch's mean gradient (N samples in the step). A rank scales what it accumulated by ``micro_batch_weight`` before the
average over ranks, so that the average is exactly one process's gradient over all N samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import ReduceOp


@dataclass(frozen=True)
class MicroBatchSchedule:
    """Which dataset indices every micro-batch of every step holds: a function of the epoch and step alone."""

    length: int
    """Samples in the dataset."""
    global_batch_size: int
    """B: samples per step, whatever the world size."""
    micro_batch_size: int
    """b: samples per micro-batch, the unit shared out between ranks."""
    shuffle: bool = True
    """Permute the samples each epoch (with ``seed + epoch``), the same permutation on every rank."""
    seed: int = 0
    drop_last: bool = False
    """Drop the epoch's last, short global batch (else it runs, with a short last micro-batch if b does not divide
    it)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.global_batch_size < self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be >= micro_batch_size ({self.micro_batch_size})"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size}): a step is a whole number of micro-batches"
            )
        if self.length < 1:
            raise ValueError("the dataset is empty")

    @property
    def steps_per_epoch(self) -> int:
        """Steps in one epoch (the last may be short unless ``drop_last``)."""
        full, rest = divmod(self.length, self.global_batch_size)
        return full if self.drop_last or not rest else full + 1

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order."""
        if not self.shuffle:
            return np.arange(self.length)
        return np.random.default_rng(self.seed + epoch).permutation(self.length)

    def micro_batches(self, epoch: int, step: int, order: np.ndarray | None = None) -> list[list[int]]:
        """Every micro-batch of step ``step`` of ``epoch``, as dataset indices, in order. ``order``: the epoch's
        ``order(epoch)``, when the caller keeps it."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside the epoch's {self.steps_per_epoch} steps")
        order = self.order(epoch) if order is None else order
        chosen = order[step * self.global_batch_size : (step + 1) * self.global_batch_size].tolist()
        b = self.micro_batch_size
        return [chosen[i : i + b] for i in range(0, len(chosen), b)]


def split_by_cost(count: int, costs: Sequence[float], minimum: int = 0) -> list[int]:
    """Shares of ``count`` micro-batches that minimize the step's slowest rank, given each rank's seconds per
    micro-batch: each rank first gets ``minimum``, then every further micro-batch goes to the rank that would finish
    it first (ties to the lower rank). Greedy is optimal here, as every micro-batch costs the same on a given rank.
    Deterministic: every rank computes the same shares from the same costs."""
    size = len(costs)
    if size < 1:
        raise ValueError("no ranks to share between")
    minimum = min(minimum, count // size)
    shares = [minimum] * size
    for _ in range(count - minimum * size):
        finish = [(shares[r] + 1) * costs[r] for r in range(size)]
        shares[finish.index(min(finish))] += 1
    return shares


def equal_shares(count: int, size: int) -> list[int]:
    """Shares as even as they go (the extra micro-batches to the lowest ranks)."""
    base, extra = divmod(count, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def makespan(shares: Sequence[int], costs: Sequence[float]) -> float:
    """The predicted compute time of a step: its slowest rank's."""
    return max(k * c for k, c in zip(shares, costs, strict=True))


class ShareBalancer:
    """Each rank's smoothed seconds per micro-batch, and the shares they lead to. Every rank holds one and feeds it
    the same gathered figures, so all of them agree on the shares.

    Args:
        size: ranks.
        smoothing: weight of the newest measurement in the moving average (1: no smoothing).
        threshold: the shares change only when the new ones are predicted to make the step at least this much
            shorter (so measurement noise does not make them flap).
        balance: False keeps equal shares (the comparison a benchmark makes).
    """

    __slots__ = ("balance", "costs", "current", "size", "smoothing", "threshold")

    def __init__(self, size: int, smoothing: float = 0.5, threshold: float = 0.04, balance: bool = True) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.size = size
        self.smoothing = smoothing
        self.threshold = threshold
        self.balance = balance
        self.costs: list[float | None] = [None] * size
        """Each rank's smoothed seconds per micro-batch (None until it ran one)."""
        self.current: list[int] = []

    def observe(self, seconds: Sequence[float], counts: Sequence[int]) -> None:
        """Every rank's compute seconds and micro-batches in the step just run (a rank that ran none keeps its
        estimate)."""
        for rank, (spent, count) in enumerate(zip(seconds, counts, strict=True)):
            if count <= 0 or spent <= 0.0:
                continue
            measured = spent / count
            old = self.costs[rank]
            self.costs[rank] = measured if old is None else old + self.smoothing * (measured - old)

    def choose_shares(self, count: int) -> list[int]:
        """The next step's shares of ``count`` micro-batches. While some rank has no estimate, or balancing is off:
        equal shares. Every rank keeps at least one micro-batch when there are enough, so that its speed stays
        measured. The choice is kept as the current shares: the next call keeps them unless a new split is
        ``threshold`` faster."""
        costs = self.costs
        if not self.balance or any(c is None for c in costs):
            chosen = equal_shares(count, self.size)
        else:
            known = [float(c) for c in costs if c is not None]
            proposed = split_by_cost(count, known, minimum=1)
            current = self.current
            keep = sum(current) == count and makespan(proposed, known) > (1.0 - self.threshold) * makespan(current, known)
            chosen = current if keep else proposed
        self.current = list(chosen)
        return list(chosen)


def micro_batch_weight(set_size: int, unit_samples: int, total_samples: int) -> float:
    """What a rank multiplies its accumulated gradient by before the average over ``set_size`` ranks, when that
    gradient is the sum of mean-loss gradients of micro-batches of ``unit_samples`` samples each and the step holds
    ``total_samples`` in all: each micro-batch then weighs unit / total of the global mean, and the average's
    division by the set size is undone."""
    return set_size * unit_samples / total_samples


@dataclass(frozen=True)
class StepPlan:
    """One step as a rank sees it: every micro-batch of the step and each rank's share, in rank order."""

    epoch: int
    step: int
    micro_batches: tuple[tuple[int, ...], ...]
    """Every micro-batch of the step (dataset indices), in order."""
    shares: tuple[int, ...]
    """Micro-batches per rank; rank r runs the contiguous range after ranks 0..r-1's."""
    rank: int

    def __post_init__(self) -> None:
        if sum(self.shares) != len(self.micro_batches):
            raise ValueError(f"shares {self.shares} do not add up to the step's {len(self.micro_batches)} micro-batches")

    @property
    def total_samples(self) -> int:
        """N: samples in the whole step."""
        return sum(len(m) for m in self.micro_batches)

    @property
    def first(self) -> int:
        """The index of this rank's first micro-batch."""
        return sum(self.shares[: self.rank])

    @property
    def mine(self) -> tuple[tuple[int, ...], ...]:
        """This rank's micro-batches."""
        return self.micro_batches[self.first : self.first + self.shares[self.rank]]

    def passes(self, max_samples: int) -> list[tuple[int, ...]]:
        """This rank's micro-batches joined into forward/backward passes of at most ``max_samples`` samples (a
        micro-batch is never split): consecutive ones, in order, so that a pass is a contiguous run of the step."""
        joined: list[tuple[int, ...]] = []
        for micro in self.mine:
            if joined and len(joined[-1]) + len(micro) <= max_samples:
                joined[-1] = joined[-1] + micro
            else:
                joined.append(micro)
        return joined


def check_balanced_reduction(op: int, accumulation: int, process_set: ProcessSet, accumulation_name: str) -> None:
    """What a balanced global batch (``loader=``) needs of the gradient reduction, in every front end: the mean
    (the gradient rule above), no accumulation of its own (the loader decides each step's passes) and the global
    process set (it shares the batch over every rank).

    Raises:
        ValueError: an argument the balanced global batch cannot honour (``accumulation_name`` names the front end's).
    """
    if ReduceOp(op) != ReduceOp.Average:
        raise ValueError(f"loader= gives the global batch's mean gradient and needs op=Average, not {ReduceOp(op).name}")
    if accumulation != 1:
        raise ValueError(f"loader= decides each step's backward passes (its micro-batches): leave {accumulation_name} at 1")
    if process_set is not global_process_set:
        raise ValueError("loader= shares the global batch over every rank: use the global process set")
