"""Optimizer state, and optionally gradients, sharded across ranks (ZeRO stages 1 and 2, arXiv 1910.02054), behind
``DistributedOptimizer(..., shard=...)``.

- ``stage``: ``Shard``, what ``shard=`` names (stage 1: the optimizer state; stage 2: the gradients too);
- ``layout``: ``ShardLayout``, which rank owns which elements (fixed buckets, each split into one block per rank);
- ``shards``: ``ShardedOptimizer``, this rank's shards stepped by the user's optimizer class, the allgather of the
  updated values, and the state gathered whole for ``state_dict()``.

Stage 2's reduce-scatter is a part of the gradient exchange (``exchange.scattered``).
"""

from __future__ import annotations

import torch

from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.plan.schemes import Planned, Play, Scheme, row_of, takes_outer
from shoal.torch.param_names import parameter_names
from shoal.torch.sharding.layout import ShardLayout
from shoal.torch.sharding.shards import ShardedOptimizer, check_shardable
from shoal.torch.sharding.stage import Shard


def shard_optimizer(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    named_parameters: list[tuple[str, torch.Tensor]] | None,
    shard: Shard,
    mode: Scheme | Planned,
    overridden: bool,
    process_set: ProcessSet,
    bucket_bytes: int,
) -> ShardedOptimizer | None:
    """This rank's ``ShardedOptimizer`` for ``optimizer`` (None for ``Shard.NONE``), after refusing what sharding
    cannot serve.

    Args:
        named_parameters: as given to ``DistributedOptimizer`` (the requests are named after the first parameter).
        mode: the optimizer's ``comm``; ``overridden``: it has ``comm_overrides`` or a compressed scheme.

    Raises:
        ValueError: an optimizer, a ``comm`` or a process set that sharding does not serve.
    """
    if shard is Shard.NONE:
        return None
    if process_set is not global_process_set:
        raise ValueError("shard= shares the state over every rank: it does not take a process_set")
    row = row_of(mode)
    if takes_outer(mode) or (row is not None and row.on_servers):
        raise ValueError(f"shard= cannot go with comm={mode.value!r}: that scheme keeps the optimizer state its own way")
    if shard is Shard.GRADIENTS and (row is None or row.play is not Play.BUCKET or overridden):
        raise ValueError(
            "shard='gradients' reduce-scatters every gradient in fixed buckets: use comm='allreduce' (or 'fp16'/'bf16') "
            "without comm_overrides, or shard='optimizer', which keeps every scheme"
        )
    base = type(optimizer)
    check_shardable(base, params)
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    element_bytes = params[0].element_size() if params else 4
    layout = ShardLayout(
        [p.numel() for p in params],
        [group_of[id(p)] for p in params],
        element_bytes,
        bucket_bytes,
        process_set.size(),
        process_set.rank(),
    )
    # The engine matches requests by name on every rank: the first parameter's name is the same everywhere.
    name = "shoal.shard." + (parameter_names(optimizer.param_groups, named_parameters)[id(params[0])] if params else "")
    return ShardedOptimizer(shard, base, dict(optimizer.defaults), optimizer.param_groups, params, layout, process_set, name)


__all__ = ["Shard", "ShardLayout", "ShardedOptimizer", "shard_optimizer"]
