"""What both forms of ``DistributedOptimizer`` (averaging and Adasum) build on: a subclass of the user's optimizer
class carrying Shoal's methods, sharing the optimizer's state, and the error for a gradient computed too often."""

from __future__ import annotations

from typing import Any

import torch


def mix_into(optimizer: torch.optim.Optimizer, mixin: type) -> Any:
    """``optimizer`` as an instance of a subclass of its own class with ``mixin``'s methods added.

    ``isinstance`` still holds, and the result shares the optimizer's state, param groups and hyperparameters: no
    second ``__init__`` runs. ``_shoal_base`` names the original class, for calling its own ``step``.
    """
    base = type(optimizer)
    methods = {k: v for k, v in vars(mixin).items() if k not in ("__dict__", "__weakref__", "__annotations__")}
    cls: Any = type(base.__name__, (base,), methods)
    cls._shoal_base = base
    cls._shoal_mixin = mixin
    wrapped = object.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    return wrapped


def is_mixed_with(optimizer: object, mixin: type) -> bool:
    """True when ``optimizer`` came out of ``mix_into(..., mixin)`` (its class copies the methods; it does not
    inherit them, so ``isinstance`` cannot tell)."""
    return getattr(type(optimizer), "_shoal_mixin", None) is mixin


def computed_too_often(name: str, passes: int, advice: str) -> AssertionError:
    """The error for a gradient computed more than ``backward_passes_per_step`` times before ``step()``."""
    return AssertionError(
        f"the gradient of '{name}' was computed more than backward_passes_per_step={passes} times before step(); {advice}"
    )
