"""Sufficient factor broadcasting (Poseidon): send a fully-connected layer's factors, not its gradient.

For ``y = x Wᵀ + b`` with K rows per step, W's gradient is ``gᵀ x`` with g = dL/dy (K×M) and x the input (K×N).
Each rank allgathers its two factors, K·(M+N) numbers instead of the M·N gradient, and every rank rebuilds the exact
sum ``Σ_r g_rᵀ x_r``; the bias gradient is the sum of the output gradients. Worth it when P·K ≪ 2MN/(M+N).

The inputs are known at forward time, so their allgather starts there and travels during the rest of forward and
all of backward; the output gradients' allgather starts when backward reaches the layer.

Autograd would also compute this rank's own ``g_rᵀ x_r``, only for the rebuild to overwrite it: a matmul as large as
the rebuild's share of it, for nothing. So while an SFB layer with a trainable bias runs forward, its weight is
marked as not requiring a gradient (and marked back right after): autograd leaves the weight out of that call's
graph, and the input and bias gradients flow as before.

A layer that runs twice in a step on some rank has no exact factors there. Every rank must then allreduce the layer's
gradients instead, together: the output gradients' allgather carries one more column, each row holding its rank's
forward count, so every rank sees whether any ran the layer more than once and all take the same path. Where a call's
weight gradient was left out of autograd's graph, it is summed from that call's own factors first. A weight that
another module also holds (tied weights) is never given SFB: the rebuild would overwrite the other module's share of
its gradient (``shoal.torch.layer_comm.layers.tied_modules``).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import nn

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet
from shoal.torch import functions
from shoal.torch.layer_comm.layers import spares_local_gradient


class SufficientFactorLayer:
    """Captures one ``nn.Linear``'s factors during a step and rebuilds its averaged gradient at synchronize."""

    __slots__ = (
        "_grad_handle",
        "_hooks",
        "_input_handle",
        "_inputs",
        "_own_grads",
        "_restore",
        "_rows",
        "calls",
        "module",
        "name",
        "process_set",
        "rebuild_seconds",
    )

    def __init__(self, name: str, module: nn.Linear, process_set: ProcessSet) -> None:
        self.name = name
        self.rebuild_seconds = 0.0
        """How long the last step's gradient rebuild (the matmul) took; part of SFB's cost for the planner."""
        self.module = module
        self.process_set = process_set
        self.calls = 0
        self._rows = 0
        """K: this step's rows of the layer's input on this rank."""
        self._input_handle: int | None = None
        self._grad_handle: int | None = None
        self._inputs: list[torch.Tensor | None] = []
        """Per call this step: its input rows when autograd skipped that call's weight gradient."""
        self._own_grads: torch.Tensor | None = None
        """This rank's output gradients when the layer ran once (its local weight gradient, should all fall back)."""
        self._restore = False
        """The weight was marked as not requiring a gradient for the call now running."""
        self._hooks = [
            module.register_forward_pre_hook(self._before_forward),
            module.register_forward_hook(self._on_forward, always_call=True),
        ]

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The layer's trainable parameters (weight, and bias if present)."""
        return [p for p in (self.module.weight, self.module.bias) if p is not None and p.requires_grad]

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        weight = self.module.weight
        # With a trainable bias every call's output requires a gradient without the weight, so its hook still fires.
        if torch.is_grad_enabled() and module.training and weight.requires_grad and spares_local_gradient(self.module):
            weight.requires_grad_(False)
            self._restore = True

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        skipped, self._restore = self._restore, False
        if skipped:
            self.module.weight.requires_grad_(True)
        if not (torch.is_grad_enabled() and module.training and isinstance(output, torch.Tensor) and output.requires_grad):
            return  # (output is None when forward raised: the weight is marked back all the same)
        self.calls += 1
        inputs = args[0].detach().reshape(-1, self.module.in_features)
        self._inputs.append(inputs if skipped else None)
        if self.calls == 1:
            inputs = inputs.contiguous()
            self._rows = inputs.shape[0]
            self._input_handle = functions.allgather_async(inputs, name=self.exchange_names[0], process_set=self.process_set)
        output.register_hook(functools.partial(self._on_output_grad, self.calls - 1))

    def _on_output_grad(self, call: int, grad: torch.Tensor) -> None:
        factor = grad.detach().reshape(-1, self.module.out_features)
        if self.calls == 1:
            if self._input_handle is not None and self._grad_handle is None:
                self._own_grads = factor
                self._send_output_grads(factor)
            return
        # Called several times this step: one row tells every rank to allreduce instead; add what autograd skipped.
        if self._grad_handle is None:
            self._send_output_grads(factor.new_zeros(1, self.module.out_features))
        inputs = self._inputs[call] if call < len(self._inputs) else None
        if inputs is not None:
            self._add_local_weight_grad(factor, inputs)

    def _add_local_weight_grad(self, output_grads: torch.Tensor, inputs: torch.Tensor) -> None:
        """Add ``output_gradsᵀ inputs``, the weight gradient of a call autograd left out, to ``.grad``."""
        weight = self.module.weight
        local = output_grads.t().mm(inputs).to(weight.dtype)
        if weight.grad is None:
            weight.grad = local
        else:
            weight.grad.add_(local)

    def _send_output_grads(self, factor: torch.Tensor) -> None:
        """Allgather the output gradients with one more column: this rank's forward count in every row."""
        counted = torch.cat([factor, factor.new_full((factor.shape[0], 1), float(self.calls))], dim=1)
        self._grad_handle = functions.allgather_async(counted, name=self.exchange_names[1], process_set=self.process_set)

    @property
    def exchange_names(self) -> tuple[str, str]:
        """The engine request names of the two allgathers: the inputs, then the output gradients."""
        return f"{self._request_base}.input", f"{self._request_base}.output_grad"

    @property
    def _request_base(self) -> str:
        """What this layer's engine request names start with."""
        return f"DistributedOptimizer.sfb.{self.name}"

    def finish(self, average: bool) -> None:
        """Wait for the factors and write the rebuilt (averaged) gradients into ``.grad``; or, when some rank ran the
        layer more than once, allreduce the layer's gradients on every rank instead.

        A rank on which the layer did not run this step contributes zero rows, and one whose output took no part in
        the loss contributes zero output gradients, so the others never wait.
        """
        dtype = self.module.weight.dtype
        if self._input_handle is None:
            empty = torch.zeros(0, self.module.in_features, dtype=dtype)
            self._input_handle = functions.allgather_async(empty, name=self.exchange_names[0], process_set=self.process_set)
        if self._grad_handle is None:
            self._send_output_grads(torch.zeros(self._rows, self.module.out_features, dtype=dtype))
        assert self._grad_handle is not None
        inputs = handles.synchronize(self._input_handle)
        counted = handles.synchronize(self._grad_handle)
        started = time.perf_counter()
        if counted.shape[0] and float(counted[:, -1].max()) > 1:
            self._allreduce_instead(average)
        else:
            self._rebuild(inputs, counted[:, :-1], average)
        self.rebuild_seconds = time.perf_counter() - started
        self.reset()

    def _rebuild(self, inputs: torch.Tensor, output_grads: torch.Tensor, average: bool) -> None:
        """The exact gradients from every rank's factors."""
        if average:  # scale the small K×M factor, not the M×N product: one pass over the gradient fewer
            output_grads = output_grads.mul(1.0 / self.process_set.size())
        weight = self.module.weight
        grad = weight.grad
        if grad is not None and grad.dtype == output_grads.dtype and grad.is_contiguous() and not grad.requires_grad:
            torch.mm(output_grads.t(), inputs, out=grad)  # straight into an existing .grad (set_to_none=False, or
            # a layer without a trainable bias, whose local gradient autograd still computes)
        else:
            weight_grad = output_grads.t().mm(inputs)
            if grad is None:
                weight.grad = weight_grad.to(weight.dtype)
            else:
                grad.copy_(weight_grad)
        if self.module.bias is not None:
            bias_grad = output_grads.sum(0)
            if self.module.bias.grad is None:
                self.module.bias.grad = bias_grad.to(self.module.bias.dtype)
            else:
                self.module.bias.grad.copy_(bias_grad)

    def _allreduce_instead(self, average: bool) -> None:
        """Some rank ran the layer more than once: its factors are not exact. Complete this rank's local gradients
        (a single call whose weight gradient autograd skipped gets it from its own factors) and allreduce them."""
        own_inputs = self._inputs[0] if self.calls == 1 and self._inputs else None
        if own_inputs is not None and self._own_grads is not None:
            self._add_local_weight_grad(self._own_grads, own_inputs)
        grads = []
        for param in self.parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        op = functions.Average if average else functions.Sum
        functions.grouped_allreduce_(grads, name=f"{self._request_base}.fallback", op=op, process_set=self.process_set)

    def reset(self) -> None:
        """Forget this step's factors (called after every synchronize)."""
        for handle in (self._input_handle, self._grad_handle):
            if handle is not None:
                handles.discard(handle)
        self.calls = 0
        self._rows = 0
        self._inputs = []
        self._own_grads = None
        self._input_handle = None
        self._grad_handle = None

    def remove(self) -> None:
        """Detach the hooks."""
        for hook in self._hooks:
            hook.remove()
