"""What ``DistributedOptimizer``'s arguments mean once checked: the bucket size, the compression, the balanced
loader's needs and Horovod's ``groups``."""

from __future__ import annotations

from typing import Any

import torch

from shoal.config import worker_setting
from shoal.core.balance import check_balanced_reduction
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import ReduceOp, resolve_groups, split_groups
from shoal.plan.schemes import Compressed
from shoal.torch.balanced_loader import BalancedLoader
from shoal.torch.compression import Compression, Compressor
from shoal.torch.micro_batch_grads import check_ordered_params


def bucket_bytes_of(given: int | None) -> int:
    """The bucket size: ``given``, else the ``bucket_bytes`` setting; never negative."""
    chosen: int = worker_setting("bucket_bytes") if given is None else given
    if chosen < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {chosen}")
    return chosen


def split_compression(compression: type[Compressor] | Compressed, comm: str) -> tuple[Compressed | None, type[Compressor], str]:
    """``compression=Compression.powersgd(...)`` or ``.topk(...)``: that scheme for every layer (with the default
    ``comm="allreduce"``), or its settings for ``comm="auto-lossy"``'s plan; the buckets then send plain gradients.
    Returns (the compressed scheme or None, the buckets' compressor, comm)."""
    if not isinstance(compression, Compressed):
        return None, compression, comm
    if comm == "allreduce":
        return compression, Compression.none, compression.scheme.value
    if comm in ("auto-lossy", compression.scheme.value):
        return compression, Compression.none, comm
    raise ValueError(
        f"compression={compression.scheme.value} sets the scheme of every layer, or its settings with comm='auto-lossy'; "
        f"it cannot go with comm={comm!r}"
    )


def check_balanced(
    loader: BalancedLoader | None,
    op: ReduceOp,
    passes: int,
    process_set: ProcessSet,
    comm: str,
    overrides: dict[Any, str] | None,
    compression: type[Compressor],
    params: list[torch.Tensor],
) -> None:
    """What ``loader=`` needs of the optimizer's other arguments and parameters (nothing without a loader).

    Raises:
        ValueError: an argument the balanced global batch cannot honour.
    """
    if loader is None:
        return
    if not isinstance(loader, BalancedLoader):
        raise ValueError(f"loader must be a shoal.torch.BalancedLoader, got {type(loader).__name__}")
    check_balanced_reduction(op, passes, process_set, "backward_passes_per_step")
    if loader.deterministic and (comm != "allreduce" or overrides or compression is not Compression.none):
        raise ValueError("BalancedLoader(deterministic=True) sums exact rows: use comm='allreduce' and no compression")
    if loader.deterministic:
        check_ordered_params(params)


def checked_groups(
    params: list[torch.Tensor], groups: list[list[torch.Tensor]] | int | None, num_groups: int
) -> list[list[torch.Tensor]] | None:
    """Horovod's ``groups``/``num_groups`` (``rules.resolve_groups``): the parameter lists reduced together, checked,
    or None."""
    groups = resolve_groups(num_groups, groups)
    if isinstance(groups, int):
        groups = split_groups(params, min(groups, len(params)))
    if groups:
        listed = [id(p) for group in groups for p in group]
        if len(set(listed)) != len(listed):
            raise ValueError("a parameter appears in more than one group")
        known = {id(p) for p in params}
        if any(key not in known for key in listed):
            raise ValueError("groups contain a tensor that is not a trainable parameter of this optimizer")
    return groups or None
