"""torch.distributed's own data parallelism, for benchmarks that compare Shoal against it in the same run."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(model: nn.Module) -> nn.Module:
    """``model`` under DistributedDataParallel on the default process group (CPU: gloo; default bucket size)."""
    return DistributedDataParallel(model)


def wrap_zero_ddp(model: nn.Module, optimizer_class: type[Any], **defaults: Any) -> tuple[nn.Module, Any]:
    """``model`` under DistributedDataParallel with torch's ZeRO stage 1, ``ZeroRedundancyOptimizer``: each rank
    steps the whole parameters it owns (``optimizer_class`` with ``defaults``) and broadcasts them to the others."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    wrapped = DistributedDataParallel(model)
    return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=optimizer_class, **defaults)


def wrap_ddp_powersgd(model: nn.Module, rank: int, start_iter: int = 2) -> nn.Module:
    """``model`` under DistributedDataParallel with torch's PowerSGD communication hook: rank-``rank`` factors with
    error feedback and warm start (the hook's defaults), from iteration ``start_iter`` on (plain allreduce before;
    torch needs at least 2).

    On gloo the hook as it is desynchronises the ranks: it issues its second and third collectives from the callbacks
    of the first (gloo's threads), so with several buckets two ranks can issue them in different orders ("Received
    data size doesn't match expected size"; torch tests the hook on NCCL only, pytorch/pytorch#58467). Here each
    bucket's hook starts once the previous bucket's exchange is complete: the buckets' exchanges run in one order on
    every rank, as they would on one NCCL stream, and each still overlaps the backward pass of the layers before it.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    wrapped = DistributedDataParallel(model)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=max(start_iter, 2)
    )
    previous: list[Any] = []

    # No annotations: torch checks that the bucket's is dist.GradBucket itself, and here they would be strings.
    def in_order(hook_state, bucket):  # type: ignore[no-untyped-def]
        if previous:
            previous.pop().wait()
        future = powerSGD_hook.powerSGD_hook(hook_state, bucket)
        previous.append(future)
        return future

    wrapped.register_comm_hook(state, in_order)
    return wrapped
