"""The torch side of ``shoal.plan.memory``: what a model and its optimizer hold, read from the objects themselves."""

from __future__ import annotations

import torch

from shoal.plan.memory import ModelMemory, in_flight


def state_per_element(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer state elements per parameter element for ``optimizer``'s class and hyperparameters (its first param
    group's): Adam's two moments, SGD's momentum if any, and so on; 2 for a class this table does not know (the
    most any of torch's elementwise optimizers keeps, and more than most)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if isinstance(optimizer, torch.optim.SGD):
        return 1.0 if group.get("momentum", 0) else 0.0
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1.0 + (1.0 if group.get("momentum", 0) else 0.0) + (1.0 if group.get("centered") else 0.0)
    if isinstance(optimizer, torch.optim.Adagrad | torch.optim.ASGD):
        return 1.0
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and group.get("amsgrad"):
        return 3.0
    return 2.0  # Adam, AdamW, Adamax, NAdam, RAdam, Adadelta, Rprop, and any other


def model_memory(
    optimizer: torch.optim.Optimizer, bucket_bytes: int, local_size: int, activation_bytes: int = 0
) -> ModelMemory:
    """``shoal.plan.memory``'s view of ``optimizer``'s trainable parameters and its state, with buckets of
    ``bucket_bytes`` and ``local_size`` ranks on this host."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    backward_order = [p.numel() * p.element_size() for p in reversed(params)]
    return ModelMemory(
        sum(backward_order),
        state_per_element(optimizer),
        activation_bytes=activation_bytes,
        in_flight_bytes=in_flight(backward_order, bucket_bytes),
        adopts_shared=local_size > 1,
    )
