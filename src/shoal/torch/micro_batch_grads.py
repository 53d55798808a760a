"""What ``DistributedOptimizer`` does with the micro-batches of a ``BalancedLoader``: weigh each rank's accumulated
gradient so that the average over ranks is one process's gradient over the whole global batch.

Each micro-batch's loss is a mean over its own samples. A rank accumulates the gradients of its micro-batches, so its
``.grad`` is ``G = Σ_j g_j``. When all of them hold ``u`` samples, ``u·G`` is the gradient of the *sum* of their
losses, and scaling by ``size·u/N`` before the average over ``size`` ranks leaves exactly the mean gradient over the
step's ``N`` samples (``core.balance.micro_batch_weight``). A micro-batch of another size (the epoch's short last one)
first rescales what was accumulated by ``u/m`` and makes ``m`` the unit, so the invariant ``u·G = Σ n_j g_j`` holds
after every micro-batch. The scale is applied once per gradient, when it is final (before its bucket leaves, so
wait-free overlap is kept on the last micro-batch), with every scheme that sends the optimizer's gradient.

The deterministic mode (``OrderedSum``) fixes the order of the sum instead: each micro-batch's gradient, weighted by
``n_j/N``, is kept apart as one row; the rows of every rank are allgathered (in rank order, which is the step's
micro-batch order) and added one after the other, the same float operations whatever the world size. CPU runs are
then bitwise identical on 1, 2 or 3 ranks. It costs a copy of the gradients per micro-batch and V/size times the
traffic of an allreduce (each rank receives every row), so it is a tool for checking and reproducing, not for speed.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.core.balance import StepPlan, micro_batch_weight
from shoal.torch import functions

ORDERED_SUM_NAME = "DistributedOptimizer.ordered_sum"
"""The engine request name of the deterministic mode's allgather."""


class MicroBatchWeights:
    """One step's bookkeeping for a ``GradientExchange``: how many backward passes this rank runs (its micro-batches,
    one or several per pass) and the scale each final gradient gets."""

    __slots__ = ("_weighted", "began", "ordered", "plan", "set_size", "sizes", "unit")

    def __init__(self, deterministic: bool) -> None:
        self.ordered = OrderedSum() if deterministic else None
        """The deterministic mode's rows, or None."""
        self.plan: StepPlan | None = None
        self.sizes: tuple[int, ...] = ()
        """The samples of each of this rank's passes in the step."""
        self.set_size = 1
        self.unit = 0
        """u: the pass size the accumulated gradients are counted in."""
        self.began = 0
        """This rank's passes begun in this step."""
        self._weighted: set[int] = set()

    @property
    def passes(self) -> int:
        """Backward passes this rank runs in the step."""
        return len(self.sizes)

    def begin_step(self, plan: StepPlan, set_size: int, sizes: tuple[int, ...]) -> None:
        """A new step, in which this rank runs passes of ``sizes`` samples: forget the last one."""
        self.plan = plan
        self.sizes = sizes
        self.set_size = set_size
        self.unit = sizes[0] if sizes else len(plan.micro_batches[0])
        self.began = 0
        self._weighted.clear()
        if self.ordered is not None:
            self.ordered.begin_step()

    def begin_pass(self, index: int, params: list[torch.Tensor]) -> None:
        """This rank's ``index``-th pass of the step is about to run (the ones before it are done)."""
        plan = self.current_plan()
        size = self.sizes[index]
        if self.ordered is not None:
            if index > 0:
                self.ordered.keep(params, self.sizes[index - 1] / plan.total_samples)
        elif index > 0 and size != self.unit:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.unit / size)
        self.unit = size
        self.began = index + 1

    def weigh(self, param: torch.Tensor) -> None:
        """Scale a final gradient (once per step) by ``micro_batch_weight``."""
        key = id(param)
        if key in self._weighted or param.grad is None:
            return
        self._weighted.add(key)
        scale = micro_batch_weight(self.set_size, self.unit, self.current_plan().total_samples)
        if scale != 1.0:
            param.grad.mul_(scale)

    def weigh_rest(self, params: list[torch.Tensor]) -> None:
        """Scale every gradient not scaled yet (parameters that did not take part in every pass)."""
        for param in params:
            self.weigh(param)

    def last_weight(self) -> float | None:
        """The deterministic mode: the last pass's share of the step's samples (None if this rank ran none)."""
        return self.sizes[-1] / self.current_plan().total_samples if self.sizes else None

    def check_complete(self) -> None:
        """Raises when the step ends before this rank ran all of its passes (its gradient would be short)."""
        plan = self.current_plan()
        if self.began != len(self.sizes):
            raise RuntimeError(
                f"the optimizer stepped after {self.began} of this rank's {len(self.sizes)} passes of step "
                f"{plan.step}: run every micro-batch the BalancedLoader's step yields before optimizer.step()"
            )

    def current_plan(self) -> StepPlan:
        if self.plan is None:
            raise RuntimeError("the BalancedLoader has not started a step: iterate over the loader to get its steps")
        return self.plan


class OrderedSum:
    """The deterministic mode: each micro-batch's weighted gradient as one row, summed in micro-batch order."""

    __slots__ = ("rows", "summed")

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.summed = False
        """This step's rows were summed already (a second ``synchronize()`` changes nothing)."""

    def begin_step(self) -> None:
        """A new step: no rows yet, and not summed."""
        self.rows.clear()
        self.summed = False

    def keep(self, params: list[torch.Tensor], weight: float) -> None:
        """Take the gradients of the micro-batch just run, times ``weight``, as a row; zero them for the next."""
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise ValueError("BalancedLoader(deterministic=True) needs dense gradients; this model makes sparse ones")
        parts = [torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None else p.grad.detach().reshape(-1) for p in params]
        self.rows.append(torch.cat(parts).mul_(weight))
        for param in params:
            if param.grad is not None:
                param.grad.zero_()

    def finish(self, params: list[torch.Tensor], process_set: Any, last_weight: float | None) -> None:
        """Keep the last micro-batch's row (``last_weight``: its n/N, None if this rank ran none), gather every rank's
        rows and write their in-order sum into every ``.grad``."""
        if self.summed:
            return
        self.summed = True
        if last_weight is not None:
            self.keep(params, last_weight)
        width = sum(p.numel() for p in params)
        dtype = params[0].dtype
        mine = torch.stack(self.rows) if self.rows else torch.zeros(0, width, dtype=dtype)
        every = functions.allgather(mine, name=ORDERED_SUM_NAME, process_set=process_set)
        total = torch.zeros(width, dtype=dtype)
        for row in every:  # one add after the other: the same association on any number of ranks
            total.add_(row)
        offset = 0
        for param in params:
            values = total[offset : offset + param.numel()].view_as(param)
            if param.grad is None:
                param.grad = values.clone()
            else:
                param.grad.copy_(values)
            offset += param.numel()
        self.rows.clear()


def check_ordered_params(params: list[torch.Tensor]) -> None:
    """The deterministic mode keeps rows of one dtype on the CPU.

    Raises:
        ValueError: parameters of several dtypes, or off the CPU.
    """
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1 or any(p.device.type != "cpu" for p in params):
        raise ValueError("BalancedLoader(deterministic=True) needs CPU parameters of one dtype")
