"""torch.distributed's own data parallelism, for benchmarks that compare Shoal against it in the same run."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(model: nn.Module) -> nn.Module:
    """``model`` under DistributedDataParallel on the default process group (CPU: gloo; default bucket size)."""
    return DistributedDataParallel(model)
