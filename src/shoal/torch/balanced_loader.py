"""BalancedLoader: the global batch as micro-batches, each rank's share following its measured speed.

The answer to "my workers are not equal" and "my batch size changes under elastic"::

    loader = hvd.BalancedLoader(dataset, global_batch_size=256, micro_batch_size=16, shuffle=True, seed=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), loader=loader)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for step in loader:              # one step of the global batch
            optimizer.zero_grad()
            for x, y in step:            # this rank's micro-batches of it
                loss_fn(model(x), y).backward()
            optimizer.step()             # the mean gradient over all global_batch_size samples

Which samples a step holds depends on the epoch's seeded permutation and the step number only (``core.balance``), so
the run's global batches, and with them its weights, are the same on any number of ranks. When its part of a step is
computed, every rank starts an allgather of what it cost (compute seconds and micro-batches, from handing out the
first micro-batch to the end of the last, so waits for other ranks are not counted); it travels with the step's
gradients, and before the next step all ranks derive the same shares from it: a rank slowed
by a busy neighbour gets fewer micro-batches, and more again when the neighbour leaves.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sized
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import TensorDataset, default_collate

from shoal.core import basics
from shoal.core import session as handles
from shoal.core.balance import MicroBatchSchedule, ShareBalancer, StepPlan
from shoal.log import warn_user
from shoal.torch import functions

SPEEDS_NAME = "BalancedLoader.{index}.speeds"
"""The engine request name of the per-step allgather of costs (each loader of a process its own, by the order in
which the loaders were made, the same on every rank)."""

_made = itertools.count()


class StepListener(Protocol):
    """What the loader tells the optimizer that reduces the step's gradients."""

    def begin_step(self, plan: StepPlan, sizes: tuple[int, ...]) -> None: ...

    def begin_pass(self, index: int) -> None: ...


class BalancedLoader:
    """Yields steps of a world-size-invariant global batch; each step yields this rank's micro-batches.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``; a ``TensorDataset`` is sliced without per-sample calls).
        global_batch_size: B, samples per step on all ranks together, whatever the world size.
        micro_batch_size: b, samples per micro-batch (B must be a multiple of b); the unit of work given to a rank.
        shuffle: permute the samples each epoch with ``seed + epoch``.
        seed: the permutation's seed.
        drop_last: drop each epoch's last, short step (else it runs, its last micro-batch short if need be).
        collate_fn: makes a micro-batch from a list of samples (default: torch's ``default_collate``).
        balance: share micro-batches by measured speed (False: equal shares, as synchronous training does).
        deterministic: sum the micro-batches' gradients in a fixed order, so that CPU runs are bitwise identical on
            any number of ranks (costs a copy of the gradients per micro-batch and V/size times an allreduce's
            traffic; see ``micro_batch_grads``).
        smoothing: weight of the newest measurement in each rank's moving average cost.
        threshold: the shares change only when the new ones promise a step at least this much shorter.
        max_pass_size: the most samples one forward/backward pass may take (default ``micro_batch_size``: one pass per
            micro-batch). Larger, a rank's consecutive micro-batches are joined into passes up to this size: the
            micro-batch stays the unit of balancing, while the pass, the unit of compute, can be as large as memory
            allows, and large batches run faster per sample. The gradient is the same within float reassociation;
            layers that see the whole batch (BatchNorm) then see the pass, which depends on the shares.
    """

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        micro_batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        balance: bool = True,
        deterministic: bool = False,
        smoothing: float = 0.5,
        threshold: float = 0.04,
        max_pass_size: int | None = None,
    ) -> None:
        if max_pass_size is not None and max_pass_size < micro_batch_size:
            raise ValueError(f"max_pass_size ({max_pass_size}) must be >= micro_batch_size ({micro_batch_size})")
        if deterministic and max_pass_size not in (None, micro_batch_size):
            raise ValueError("deterministic=True keeps one pass per micro-batch: leave max_pass_size unset")
        self.max_pass_size = max_pass_size or micro_batch_size
        self.dataset = dataset
        self.schedule = MicroBatchSchedule(len(dataset), global_batch_size, micro_batch_size, shuffle, seed, drop_last)
        self.collate_fn = collate_fn or default_collate
        self.balance = balance
        self.deterministic = deterministic
        self.smoothing = smoothing
        self.threshold = threshold
        self.epoch = 0
        self.step = 0
        """The next step of the epoch to run (steps before it are done)."""
        self.plan: StepPlan | None = None
        """The step running now (or last run): every micro-batch and each rank's share."""
        self.balancer: ShareBalancer | None = None
        """Every rank's smoothed cost and the shares (made at the first step, and again when the world changes)."""
        self._listener: StepListener | None = None
        self._order: tuple[int, np.ndarray] | None = None
        self._epoch_chosen = False
        """``set_epoch`` was called since the last iteration began (a finished epoch then stays finished)."""
        self._restored = False
        """The position came from ``load_state_dict`` (an elastic restore), and neither ``set_epoch`` nor an iteration
        has come since."""
        self._gathering: tuple[Any, int] | None = None
        """The session and handle of the allgather of every rank's last step cost, started when this rank's step was
        computed."""
        self._name = SPEEDS_NAME.format(index=next(_made))
        """The handle of the allgather of every rank's last step cost, started when this rank's step was computed."""

    # ----- set-up -----

    def attach(self, listener: StepListener) -> None:
        """Called by ``DistributedOptimizer(loader=...)``: the optimizer that weighs this loader's gradients."""
        if self._listener is not None and self._listener is not listener:
            raise ValueError("this BalancedLoader already belongs to another DistributedOptimizer")
        self._listener = listener

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first step. If the loader is already in that epoch (restored from an elastic
        commit) it keeps its position: the rest of the epoch, or nothing if the epoch was finished. Asking again for
        an epoch this loader finished itself (a loop run twice) warns: it would train no step."""
        if epoch != self.epoch:
            self.epoch, self.step = int(epoch), 0
        elif self.step >= len(self) and not self._restored:
            warn_user(
                f"BalancedLoader.set_epoch({epoch}): epoch {epoch} is already finished on this loader, so iterating it "
                "trains no step; call set_epoch with the next epoch (after an elastic restore a finished epoch stays "
                "finished on purpose, and says nothing)"
            )
        self._epoch_chosen = True
        self._restored = False

    def __len__(self) -> int:
        """Steps per epoch."""
        return self.schedule.steps_per_epoch

    @property
    def global_batch_size(self) -> int:
        return self.schedule.global_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.schedule.micro_batch_size

    # ----- elastic state -----

    def state_dict(self) -> dict[str, Any]:
        """The position a commit saves: the epoch and the next step (a step is never half committed)."""
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to a committed position; the shares are measured afresh (the world may have changed)."""
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._epoch_chosen = False
        self._restored = True
        self.balancer = None
        self._gathering = None  # it belonged to the world before the reset

    # ----- steps -----

    def __iter__(self) -> Iterator[Step]:
        """The epoch's remaining steps, from ``self.step`` on."""
        if self._listener is None:
            raise RuntimeError(
                "BalancedLoader needs the optimizer that reduces its gradients: pass loader= to hvd.DistributedOptimizer"
            )
        if self.step >= len(self) and not self._epoch_chosen:  # iterated again without set_epoch: the next epoch
            self.epoch, self.step = self.epoch + 1, 0
        self._epoch_chosen = False
        self._restored = False  # what this iteration finishes, this loader finished itself
        while self.step < len(self):
            step = self.next_step()
            yield step
            if not step.finished and not len(step):
                step.finish()  # a step with no pass for this rank, not iterated: nothing was left out
            if not step.finished:
                raise RuntimeError(
                    f"step {self.step} was left after {step.handed_out} of this rank's {len(step)} passes: run every "
                    "micro-batch of a step before asking for the next one"
                )

    def next_step(self) -> Step:
        """Plan the epoch's next step (every rank together: it gathers the last step's costs). Iterating the loader
        calls it; a front end that hands steps out itself (Keras's ``fit``) calls it directly. A step that is never
        finished is planned again by the next call."""
        if self._listener is None:
            raise RuntimeError(
                "BalancedLoader needs the optimizer that reduces its gradients: pass loader= to hvd.DistributedOptimizer"
            )
        if self.step >= len(self):
            raise IndexError(f"epoch {self.epoch} is over ({len(self)} steps): call set_epoch for the next one")
        return Step(self, self._agree())

    def _agree(self) -> StepPlan:
        """Every rank's cost of its last step, gathered; the same shares derived on every rank."""
        size, rank = basics.size(), basics.rank()
        balancer = self.balancer
        if balancer is None or balancer.size != size:
            balancer = self.balancer = ShareBalancer(size, self.smoothing, self.threshold, self.balance)
        gathered, self._gathering = self._gathering, None
        if gathered is not None and gathered[0] is not handles.current_session():
            gathered = None  # started before a re-init: its session and handle are gone
        if gathered is not None:
            every = handles.synchronize(gathered[1])  # long done: it travelled with the last step's gradients
            if every.shape[0] == size:
                balancer.observe(every[:, 0].tolist(), [int(c) for c in every[:, 1].tolist()])
        micro_batches = self.schedule.micro_batches(self.epoch, self.step, self._epoch_order())
        shares = balancer.choose_shares(len(micro_batches))
        self.plan = StepPlan(self.epoch, self.step, tuple(tuple(m) for m in micro_batches), tuple(shares), rank)
        return self.plan

    def _epoch_order(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.schedule.order(self.epoch))
        return self._order[1]

    def _step_done(self, seconds: float, count: int) -> None:
        """This rank's part of the step is computed: start gathering its cost now, so that it travels with the
        step's gradients and the next step's shares need no round of their own."""
        self.step += 1
        if basics.size() > 1:
            mine = torch.tensor([[seconds, float(count)]], dtype=torch.float64)
            self._gathering = (handles.current_session(), functions.allgather_async(mine, name=self._name))

    def fetch(self, indices: tuple[int, ...]) -> Any:
        """One micro-batch: the samples at ``indices``, collated."""
        dataset = self.dataset
        if isinstance(dataset, TensorDataset) and self.collate_fn is default_collate:
            index = torch.tensor(indices, dtype=torch.long)
            return [t[index] for t in dataset.tensors]
        getitems = getattr(dataset, "__getitems__", None)
        samples = getitems(list(indices)) if getitems is not None else [dataset[i] for i in indices]  # type: ignore[index]
        return self.collate_fn(samples)


class Step:
    """One step of the global batch on this rank: iterate over it for this rank's passes (its micro-batches, one per
    pass unless the loader's ``max_pass_size`` joins them)."""

    __slots__ = ("_started", "finished", "handed_out", "loader", "passes", "plan")

    def __init__(self, loader: BalancedLoader, plan: StepPlan) -> None:
        self.loader = loader
        self.plan = plan
        self.passes = plan.passes(loader.max_pass_size)
        """This rank's passes, as dataset indices."""
        self.handed_out = 0
        self.finished = False
        self._started: float | None = None
        assert loader._listener is not None
        loader._listener.begin_step(plan, tuple(len(p) for p in self.passes))

    def __len__(self) -> int:
        """This rank's passes in the step (0 is possible: the rank then only takes part in the reduction)."""
        return len(self.passes)

    @property
    def indices(self) -> list[int]:
        """The dataset indices of this rank's samples in the step."""
        return [i for micro in self.plan.mine for i in micro]

    def __iter__(self) -> Iterator[Any]:
        if self.handed_out:
            raise RuntimeError("a step's micro-batches can be iterated once")
        listener = self.loader._listener
        assert listener is not None
        self._started = time.perf_counter()
        for index, indices in enumerate(self.passes):
            listener.begin_pass(index)
            self.handed_out = index + 1
            yield self.loader.fetch(indices)
        self.finish()

    def finish(self) -> None:
        """This rank's part of the step is computed: record its cost (from the first pass handed out to now: the end
        of the last pass's backward, before any wait for other ranks) and start gathering it. Iterating the step to
        its end calls it; calling it again does nothing."""
        if self.finished:
            return
        self.finished = True
        started = time.perf_counter() if self._started is None else self._started
        self.loader._step_done(time.perf_counter() - started, len(self.plan.mine))
