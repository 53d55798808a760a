"""Horovod's Adasum delta optimizer on the exchange's frame: the hook takes the parameter's local optimizer step at
once and starts the Adasum of the delta; ``apply()`` sets each parameter to its old value plus the combined delta."""

from __future__ import annotations

from typing import Any

import torch

from shoal.core import session as handles
from shoal.core.rules import ReduceOp
from shoal.torch import functions
from shoal.torch.compression import Compressor
from shoal.torch.exchange.hooks import BackwardHooks
from shoal.torch.layer_comm.schemes import gradient_request_name


class AdasumExchange(BackwardHooks):
    """Horovod's Adasum delta optimizer: each parameter steps locally when its gradient is final, and the deltas are
    combined across ranks with Adasum."""

    __slots__ = ("_handles", "_starts", "compression", "optimizer")

    def __init__(
        self, optimizer: Any, params: list[torch.Tensor], names: dict[int, str], compression: type[Compressor], passes: int
    ) -> None:
        super().__init__(params, names, passes, "increase backward_passes_per_step")
        self.optimizer = optimizer
        """The wrapped optimizer, whose own class's ``step`` makes each parameter's local update."""
        self.compression = compression
        self._starts = {id(p): torch.zeros_like(p, requires_grad=False) for p in params}
        self._handles: dict[int, tuple[torch.Tensor, int, Any, torch.Tensor]] = {}

    @property
    def pending(self) -> bool:
        """Deltas of this step are being combined."""
        return bool(self._handles)

    def _started(self, key: int) -> bool:
        return key in self._handles

    def _ready(self, param: torch.Tensor) -> None:
        """Step this parameter alone, turn it into its delta, and start the Adasum of the deltas."""
        key = id(param)
        start = self._starts[key]
        groups = self.optimizer.param_groups
        stashed = [group["params"] for group in groups]
        for group in groups:
            group["params"] = [p for p in group["params"] if p is param]
        try:
            start.copy_(param.detach())
            with torch.no_grad():
                self.optimizer._shoal_base.step(self.optimizer)
                param.sub_(start)
        finally:
            for group, params in zip(groups, stashed, strict=True):
                group["params"] = params
        compressed, ctx = self.compression.compress(param.detach())
        handle = functions.allreduce_async_(compressed, name=gradient_request_name(self.names[key]), op=ReduceOp.Adasum)
        self._handles[key] = (param, handle, ctx, compressed)

    def apply(self) -> None:
        """Exchange any delta not started yet (no gradient this step), then set old value + combined delta."""
        for param in self.params:
            if id(param) not in self._handles:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._ready(param)
        for key, (param, handle, ctx, _) in list(self._handles.items()):
            delta = self.compression.decompress(handles.synchronize(handle), ctx)
            start = self._starts[key]
            with torch.no_grad():
                start.add_(delta.to(start.dtype))
                param.copy_(start)
        self.reset()

    def reset(self, discard: bool = False) -> None:
        """Forget this step (``discard``: it never finished, so drop the exchanges in flight too)."""
        if discard:
            for entry in self._handles.values():
                handles.discard(entry[1])
        super().reset()
        self._handles.clear()
