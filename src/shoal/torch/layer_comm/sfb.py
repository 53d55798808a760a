"""Sufficient factor broadcasting (Poseidon): send a fully-connected layer's factors, not its gradient.

For ``y = x Wᵀ + b`` with K rows per step, W's gradient is ``gᵀ x`` with g = dL/dy (K×M) and x the input (K×N).
Each rank allgathers its two factors, K·(M+N) numbers instead of the M·N gradient, and every rank rebuilds the exact
sum ``Σ_r g_rᵀ x_r``; the bias gradient is the sum of the output gradients. Worth it when P·K ≪ 2MN/(M+N).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from shoal.torch import functions, handles
from shoal.torch.process_sets import ProcessSet


class SufficientFactorLayer:
    """Captures one ``nn.Linear``'s factors during a step and rebuilds its averaged gradient at synchronize."""

    __slots__ = ("_handles", "_hooks", "_input", "calls", "module", "name", "process_set", "rebuild_seconds")

    def __init__(self, name: str, module: nn.Linear, process_set: ProcessSet) -> None:
        self.name = name
        self.rebuild_seconds = 0.0
        """How long the last step's gradient rebuild (the matmul) took; part of SFB's cost for the planner."""
        self.module = module
        self.process_set = process_set
        self.calls = 0
        self._input: torch.Tensor | None = None
        self._handles: tuple[int, int] | None = None
        self._hooks = [module.register_forward_hook(self._on_forward)]

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The layer's trainable parameters (weight, and bias if present)."""
        return [p for p in (self.module.weight, self.module.bias) if p is not None and p.requires_grad]

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and module.training and output.requires_grad):
            return
        self.calls += 1
        if self.calls == 1:
            self._input = args[0].detach().reshape(-1, self.module.in_features)
            output.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self.calls != 1 or self._input is None or self._handles is not None:
            return  # called twice this step: the optimizer falls back to allreduce for this layer
        factor = grad.detach().reshape(-1, self.module.out_features).contiguous()
        self._handles = self._gather(self._input.contiguous(), factor)

    @property
    def exchange_names(self) -> tuple[str, str]:
        """The engine request names of the two allgathers: the inputs, then the output gradients."""
        base = f"DistributedOptimizer.sfb.{self.name}"
        return f"{base}.input", f"{base}.output_grad"

    def _gather(self, inputs: torch.Tensor, output_grads: torch.Tensor) -> tuple[int, int]:
        input_name, grad_name = self.exchange_names
        return (
            functions.allgather_async(inputs, name=input_name, process_set=self.process_set),
            functions.allgather_async(output_grads, name=grad_name, process_set=self.process_set),
        )

    @property
    def usable(self) -> bool:
        """True when this step's factors are exact: the layer ran forward once (or not at all)."""
        return self.calls <= 1

    def finish(self, average: bool) -> None:
        """Wait for the factors and write the rebuilt (averaged) gradients into ``.grad``.

        A rank on which the layer did not run this step contributes zero rows, so the others never wait.
        """
        if self._handles is None:
            empty_input = torch.zeros(0, self.module.in_features, dtype=self.module.weight.dtype)
            empty_grad = torch.zeros(0, self.module.out_features, dtype=self.module.weight.dtype)
            self._handles = self._gather(empty_input, empty_grad)
        inputs = handles.synchronize(self._handles[0])
        output_grads = handles.synchronize(self._handles[1])
        started = time.perf_counter()
        scale = 1.0 / self.process_set.size() if average else 1.0
        weight_grad = output_grads.t().matmul(inputs).mul_(scale)
        weight = self.module.weight
        if weight.grad is None:
            weight.grad = weight_grad.to(weight.dtype)
        else:
            weight.grad.copy_(weight_grad)
        if self.module.bias is not None:
            bias_grad = output_grads.sum(0).mul_(scale)
            if self.module.bias.grad is None:
                self.module.bias.grad = bias_grad.to(self.module.bias.dtype)
            else:
                self.module.bias.grad.copy_(bias_grad)
        self.rebuild_seconds = time.perf_counter() - started
        self.reset()

    def reset(self) -> None:
        """Forget this step's factors (called after every synchronize)."""
        self.calls = 0
        self._input = None
        self._handles = None

    def remove(self) -> None:
        """Detach the hooks."""
        for hook in self._hooks:
            hook.remove()
