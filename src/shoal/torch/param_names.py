"""Every parameter's name, as Horovod's ``DistributedOptimizer`` names them (the gradient requests carry them)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def parameter_names(
    param_groups: list[dict[str, Any]], named_parameters: Iterable[tuple[str, torch.Tensor]] | None, adasum: bool = False
) -> dict[int, str]:
    """Every parameter's name by ``id``: from ``named_parameters`` (checked: unique, and covering every parameter of
    the optimizer), else Horovod's names for unnamed ones (``allreduce.noname.<group>.<index>``; the Adasum
    optimizer numbers them by position alone, ``allreduce.noname.<index>``)."""
    params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        if adasum:
            trainable = [p for p in params if p.requires_grad]
            return {id(p): f"allreduce.noname.{i}" for i, p in enumerate(trainable)}
        return {
            id(p): f"allreduce.noname.{i}.{j}" for i, group in enumerate(param_groups) for j, p in enumerate(group["params"])
        }
    pairs = list(named_parameters)
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"named_parameters has duplicate names: {duplicates}")
    by_id = {id(p): name for name, p in pairs}
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id and (p.requires_grad or not adasum)]
    if unnamed:
        raise ValueError(
            "named_parameters was given, but the optimizer has parameters that are not in it "
            f"(positions {unnamed[:5]}{'...' if len(unnamed) > 5 else ''}); pass model.named_parameters() "
            "for the same model the optimizer was built on"
        )
    return {id(p): by_id[id(p)] for p in params if id(p) in by_id}
