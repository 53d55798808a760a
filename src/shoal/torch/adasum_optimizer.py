"""``DistributedOptimizer(op=hvd.Adasum)``: Horovod's delta optimizer.

Each parameter takes its local optimizer step as soon as its gradient is final (in the backward hook, so the
exchange overlaps backprop), the step's delta (new value minus old) is combined across ranks with Adasum, and
``step()`` sets every parameter to its old value plus the combined delta. Adasum adapts to how aligned the ranks'
updates are, which is what lets it take larger learning rates than averaging.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.core import session as handles
from shoal.engine.request import ReduceOp
from shoal.torch import functions
from shoal.torch.compression import Compressor
from shoal.torch.layer_comm.schemes import gradient_request_name
from shoal.torch.optimizer_class import computed_too_often, mix_into


class _AdasumOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (see ``DistributedOptimizer``)."""

    _shoal_base: type[torch.optim.Optimizer]

    def _shoal_adasum_setup(self, names: dict[int, str], compression: type[Compressor], passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self._shoal_names = names
        self._shoal_compression = compression
        self._shoal_passes = passes
        self._shoal_params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._parameter_names = {p: names[id(p)] for p in self._shoal_params}  # Horovod's attribute
        self._shoal_counts = {id(p): 0 for p in self._shoal_params}
        self._shoal_starts = {id(p): torch.zeros_like(p, requires_grad=False) for p in self._shoal_params}
        self._shoal_handles: dict[int, tuple[torch.Tensor, int, Any, torch.Tensor]] = {}
        self._shoal_hooks = [p.register_post_accumulate_grad_hook(self._shoal_on_grad) for p in self._shoal_params]

    def _shoal_on_grad(self, param: torch.Tensor) -> None:
        key = id(param)
        if key in self._shoal_handles:
            raise computed_too_often(self._shoal_names[key], self._shoal_passes, "increase backward_passes_per_step")
        self._shoal_counts[key] += 1
        if self._shoal_counts[key] == self._shoal_passes:
            self._shoal_start_exchange(param)

    def _shoal_start_exchange(self, param: torch.Tensor) -> None:
        """Step this parameter alone, turn it into its delta, and start the Adasum of the deltas."""
        key = id(param)
        start = self._shoal_starts[key]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p for p in group["params"] if p is param]
        try:
            start.copy_(param.detach())
            with torch.no_grad():
                self._shoal_base.step(self)
                param.sub_(start)
        finally:
            for group, params in zip(self.param_groups, stashed, strict=True):
                group["params"] = params
        compressed, ctx = self._shoal_compression.compress(param.detach())
        handle = functions.allreduce_async_(compressed, name=gradient_request_name(self._shoal_names[key]), op=ReduceOp.Adasum)
        self._shoal_handles[key] = (param, handle, ctx, compressed)

    def synchronize(self) -> None:
        """Horovod's Adasum optimizer synchronizes in ``step()``; this does nothing, as there."""

    def skip_synchronize(self) -> Any:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def step(self, closure: Any = None) -> Any:
        """Exchange any delta not started yet (no gradient this step), then apply old value + combined delta."""
        loss = closure() if closure is not None else None
        for param in self._shoal_params:
            if id(param) not in self._shoal_handles:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._shoal_start_exchange(param)
        for key, (param, handle, ctx, _) in list(self._shoal_handles.items()):
            delta = self._shoal_compression.decompress(handles.synchronize(handle), ctx)
            start = self._shoal_starts[key]
            with torch.no_grad():
                start.add_(delta.to(start.dtype))
                param.copy_(start)
            self._shoal_counts[key] = 0
        self._shoal_handles.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refuses while exchanges are in flight."""
        if self._shoal_handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        self._shoal_base.zero_grad(self, set_to_none)


def wrap(
    optimizer: torch.optim.Optimizer, names: dict[int, str], compression: type[Compressor], backward_passes_per_step: int
) -> torch.optim.Optimizer:
    """The Adasum form of ``DistributedOptimizer``: a subclass of ``optimizer``'s class sharing its state."""
    wrapped = mix_into(optimizer, _AdasumOptimizer)
    wrapped._shoal_adasum_setup(names, compression, backward_passes_per_step)
    return wrapped
