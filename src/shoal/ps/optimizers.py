"""Server-side optimizers: the wrapped optimizer's own class and hyperparameters, applied to flat pieces.

A server updates a contiguous flat slice of a parameter. That is exact only for optimizers whose update is
element-wise, so those are the ones accepted (SGD with momentum, dampening, weight decay and Nesterov; Adam and
AdamW); anything else (LBFGS, Adafactor's factored moments, custom subclasses) is refused with a ValueError. The
torch implementation itself runs on the server, so a BSP update is the very update the worker would have made.
"""

from __future__ import annotations

from typing import Any

import torch

_HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "Adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "AdamW": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
}
_RUNTIME_ONLY = ("foreach", "fused", "capturable", "differentiable")
"""How torch runs the update, not what it computes: the servers pick their own."""
_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "SGD": torch.optim.SGD,
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}


def describe_optimizer(optimizer_class: type, param_groups: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The class name and, per param group, the hyperparameters a server needs (JSON-friendly).

    Raises:
        ValueError: for an optimizer whose update a server cannot apply to a flat slice.
    """
    name = next((n for n, cls in _CLASSES.items() if optimizer_class is cls), None)
    if name is None:
        raise ValueError(
            f"comm='ps' runs the optimizer on the parameter servers, which supports {sorted(_CLASSES)} only "
            f"(element-wise updates); got {optimizer_class.__name__}. Use comm='allreduce' for this optimizer."
        )
    groups = []
    for group in param_groups:
        defaults = optimizer_class([torch.zeros(1, requires_grad=True)]).defaults
        ignored = sorted(
            k
            for k, v in group.items()
            if k in defaults and k not in _HYPERPARAMETERS[name] and k not in _RUNTIME_ONLY and v != defaults[k]
        )
        if ignored:
            raise ValueError(
                f"comm='ps' cannot run {name} with {', '.join(f'{k}={group[k]!r}' for k in ignored)} on the servers "
                "(only the defaults of those settings); use comm='allreduce' for this optimizer"
            )
        values = {}
        for key in _HYPERPARAMETERS[name]:
            value = group[key]
            if isinstance(value, torch.Tensor):
                value = value.item()
            values[key] = list(value) if isinstance(value, tuple) else value
        groups.append(values)
    return name, groups


def build_server_optimizer(name: str, hyperparameters: dict[str, Any], tensor: torch.Tensor) -> torch.optim.Optimizer:
    """An optimizer of class ``name`` over one flat piece (a leaf tensor the server owns)."""
    values = dict(hyperparameters)
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    return _CLASSES[name]([tensor], **values)


def apply_update(optimizer: torch.optim.Optimizer, tensor: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    """One optimizer step on ``tensor`` with gradient ``grad`` at the worker's current learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    tensor.grad = grad
    optimizer.step()
    tensor.grad = None
