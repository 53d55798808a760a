"""``BalancedData``: the balanced global batch for Keras 3's ``model.fit`` on the torch backend.

Each ``fit`` batch is this rank's share of one step of a world-size-invariant global batch, joined into one pass
(``shoal.torch.BalancedLoader`` plans the steps: the same schedule, the same shares by measured speed). The
distributed optimizer, given ``loader=``, scales the rank's gradient (the mean over its own samples) by
``size·n/N`` before the average over the ranks (``core.balance.micro_batch_weight``), so the update is one process's
over the whole global batch::

    data = hvd.BalancedData(x, y, global_batch_size=256, micro_batch_size=16)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), loader=data), loss="mse")
    model.fit(data, epochs=5)

A rank's compute time runs from handing out its batch to the start of the gradient reduction. Keras asks for one
batch before training starts (to learn its structure); that step is planned, dropped at ``on_epoch_end`` and
planned again, on every rank alike.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import torch
from torch.utils.data import TensorDataset

from shoal.core import basics
from shoal.core.balance import StepPlan, micro_batch_weight
from shoal.torch.balanced_loader import BalancedLoader, Step


class BalancedData(keras.utils.PyDataset):
    """``x`` and ``y`` (arrays of the same length) served to ``model.fit`` as balanced steps, one pass each.

    Args:
        x: the inputs, an array (or anything ``np.asarray`` takes) whose first dimension is the samples.
        y: the targets, the same length.
        global_batch_size: B, samples per step on all ranks together, whatever the world size.
        micro_batch_size: b, the unit shared out between ranks (B must be a multiple of b). Every rank needs at
            least one micro-batch per step: B / b must not be below the world size.
        shuffle: permute the samples each epoch with ``seed + epoch`` (``fit``'s own ``shuffle`` does not matter:
            the steps come in the schedule's order).
        seed: the permutation's seed.
        drop_last: drop each epoch's last, short step (needed when it has fewer micro-batches than there are ranks).
        balance: share by measured speed (False: equal shares).
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        global_batch_size: int,
        micro_batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        balance: bool = True,
    ) -> None:
        super().__init__()
        inputs, targets = torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y))
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"x has {inputs.shape[0]} samples and y {targets.shape[0]}")
        self.loader = BalancedLoader(
            TensorDataset(inputs, targets),
            global_batch_size,
            micro_batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            balance=balance,
            max_pass_size=global_batch_size,
        )
        self._check_shares()
        self.loader.attach(self)
        self.plan: StepPlan | None = None
        self._step: Step | None = None
        """The step handed out to ``fit`` and not reduced yet."""

    def _check_shares(self) -> None:
        """Keras cannot run a rank on zero samples: every step needs a micro-batch per rank."""
        schedule, size = self.loader.schedule, basics.size()
        rest = schedule.length % schedule.global_batch_size
        fewest = schedule.global_batch_size // schedule.micro_batch_size
        if rest and not schedule.drop_last:
            fewest = min(fewest, -(-rest // schedule.micro_batch_size))
        if fewest < size:
            raise ValueError(
                f"a step has only {fewest} micro-batch(es) for {size} ranks, and Keras cannot run a rank on zero "
                "samples: lower micro_batch_size, or drop_last=True when it is the epoch's short last step"
            )

    # ----- what the loader tells its listener -----

    def begin_step(self, plan: StepPlan, sizes: tuple[int, ...]) -> None:
        self.plan = plan

    def begin_pass(self, index: int) -> None:
        """Nothing to do: a Keras batch is one pass."""

    # ----- keras.utils.PyDataset -----

    def __len__(self) -> int:
        return len(self.loader)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The next step's batch for this rank (``index`` is ignored: steps come in the schedule's order)."""
        if self._step is not None:
            raise RuntimeError(
                "model.fit asked for the next BalancedData batch before the last one's gradients were reduced: pass "
                "loader=<this BalancedData> to hvd.DistributedOptimizer, and keep steps_per_execution=1"
            )
        step = self._step = self.loader.next_step()
        if not len(step):
            raise RuntimeError(f"rank {basics.rank()} got no micro-batch in step {step.plan.step}")
        x, y = next(iter(step))
        return x.numpy(), y.numpy()

    def on_epoch_end(self) -> None:
        """After a finished epoch, the next one; after Keras's look at one batch before training, nothing."""
        self._step = None
        if self.loader.step >= len(self.loader):
            self.loader.set_epoch(self.loader.epoch + 1)

    # ----- asked by the distributed optimizer -----

    def skip_step(self) -> None:
        """A loss-scale optimizer skips this step's update on every rank (non-finite gradients): the step is spent
        all the same, as its batch is in any Keras job."""
        if self._step is not None:
            self._step.finish()
            self._step = None

    def end_step(self, set_size: int) -> float:
        """Called as the step's gradients are about to be reduced: ends this rank's compute time and returns the
        factor its gradient (a mean over its own samples) takes before the average over ``set_size`` ranks."""
        step = self._step
        if step is None:
            raise RuntimeError("BalancedData: the optimizer reduces gradients of no step handed out by this data")
        step.finish()
        self._step = None
        samples = len(step.passes[0])
        return micro_batch_weight(set_size, samples, step.plan.total_samples)
