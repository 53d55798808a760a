"""Horovod's Adasum optimizer surface (``DistributedOptimizer(..., op=hvd.Adasum)``), mixed into the user's optimizer
class as the averaging one is, over an ``AdasumExchange``."""

from __future__ import annotations

from typing import Any

import torch

from shoal.torch.compression import Compressor
from shoal.torch.exchange import AdasumExchange
from shoal.torch.optimizer_class import mix_into
from shoal.torch.param_names import parameter_names


class AdasumOptimizer(torch.optim.Optimizer):
    """Horovod's Adasum optimizer surface (see ``AdasumExchange``), mixed in the same way."""

    _shoal_base: type[torch.optim.Optimizer]
    _shoal_exchange: AdasumExchange

    def synchronize(self) -> None:
        """Horovod's Adasum optimizer synchronizes in ``step()``; this does nothing, as there."""

    def skip_synchronize(self) -> Any:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def step(self, closure: Any = None) -> Any:
        """Exchange any delta not started yet (no gradient this step), then apply old value + combined delta."""
        loss = closure() if closure is not None else None
        self._shoal_exchange.apply()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refuses while exchanges are in flight."""
        if self._shoal_exchange.pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        self._shoal_base.zero_grad(self, set_to_none)


def wrap_adasum(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    named_parameters: Any,
    compression: type[Compressor],
    passes: int,
) -> tuple[Any, dict[int, str]]:
    """``optimizer`` mixed with Horovod's Adasum surface over an ``AdasumExchange``, and the parameters' names."""
    names = parameter_names(optimizer.param_groups, named_parameters, adasum=True)
    wrapped = mix_into(optimizer, AdasumOptimizer)
    wrapped._shoal_exchange = AdasumExchange(wrapped, params, names, compression, passes)
    return wrapped, names
