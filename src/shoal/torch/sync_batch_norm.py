"""SyncBatchNorm: batch normalization whose statistics span the global batch of every rank."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.torch import functions


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        local = x.double()
        # One allreduce carries count, sum and sum of squares (in float64, so var = E[x^2] - mean^2 stays accurate).
        count_local = torch.full((1,), x.numel() / channels, dtype=torch.float64, device=x.device)
        stats = torch.cat([local.sum(dims), (local * local).sum(dims), count_local])
        stats = functions.allreduce(stats, op=functions.Sum, name=None, process_set=process_set)
        count = stats[-1]
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean * mean).clamp_min(0)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * count / max(float(count) - 1, 1.0)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        mean_x = mean.to(x.dtype)
        xhat = (x - mean_x.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count, ctx.process_set, ctx.has_bias = count, process_set, bias is not None
        y = xhat * weight.view(shape) if weight is not None else xhat
        return y + bias.view(shape) if bias is not None else y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        channels = grad.shape[1]
        dims = [d for d in range(grad.dim()) if d != 1]
        shape = [1, channels] + [1] * (grad.dim() - 2)
        sum_dy = grad.sum(dims)
        sum_dy_xhat = (grad * xhat).sum(dims)
        # Local weight and bias gradients (the optimizer averages them); the input gradient needs global sums.
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if ctx.has_bias else None
        totals = functions.allreduce(torch.cat([sum_dy, sum_dy_xhat]).double(), op=functions.Sum, process_set=ctx.process_set)
        mean_dy = (totals[:channels] / ctx.count).to(grad.dtype)
        mean_dy_xhat = (totals[channels:] / ctx.count).to(grad.dtype)
        scale = invstd * (weight if weight is not None else 1.0)
        grad_x = (grad - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm*d`` with statistics computed over every rank's batch (Horovod's ``hvd.SyncBatchNorm``).

    In training mode with more than one rank, the mean and variance come from the global batch; in eval mode (or
    with one rank) it behaves exactly like ``BatchNorm``. Works for any input of shape (N, C, ...).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or self.process_set.size() == 1:
            return super().forward(input)
        momentum = self.momentum if self.momentum is not None else 0.0
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as BatchNorm does
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, momentum, self.process_set
        )
