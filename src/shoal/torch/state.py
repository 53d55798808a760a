"""Make every rank start identical: broadcast model parameters and optimizer state from a root rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from shoal.core import session as handles
from shoal.core.basics import rank
from shoal.core.objects import broadcast_object
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.torch import functions


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Overwrite, in place, every tensor in ``params`` with ``root_rank``'s value.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: the rank whose values everyone takes.
        process_set: the ranks taking part.
    """
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    pending = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: '{name}' is a {type(tensor).__name__}, not a tensor")
        pending.append(
            functions.broadcast_async_(tensor, root_rank, name=f"broadcast_parameters.{name}", process_set=process_set)
        )
    for handle in pending:
        handles.synchronize(handle)


class _TensorSlot:
    """Stands for a tensor in the broadcast skeleton of an optimizer state dict."""

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.device = str(tensor.device)


def _strip_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1, value)
    if isinstance(value, dict):
        return {k: _strip_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_strip_tensors(v, tensors) for v in value)
    return value


def _fill_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_fill_tensors(v, tensors) for v in value)
    return value


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Give every rank ``root_rank``'s optimizer state: per-parameter tensors, scalar state and hyperparameters.

    Works for any ``torch.optim`` optimizer, including one that has not stepped yet (empty state). The structure
    and scalars travel as one pickled object; tensors travel as tensors, in place.
    """
    sharded = getattr(optimizer, "_shoal_shards", None)
    if sharded is None and not optimizer.state_dict()["state"]:
        _materialize_state(optimizer)
    tensors: list[torch.Tensor] = []
    skeleton = _strip_tensors(_root_state(optimizer), tensors) if rank() == root_rank else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state.skeleton", process_set=process_set)
    if rank() != root_rank:
        slots: list[_TensorSlot] = []
        _collect_slots(skeleton, slots)
        tensors = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in sorted(slots, key=lambda s: s.index)]
    pending = [
        functions.broadcast_async_(t, root_rank, name=f"broadcast_optimizer_state.{i}", process_set=process_set)
        for i, t in enumerate(tensors)
    ]
    for handle in pending:
        handles.synchronize(handle)
    if rank() != root_rank:
        given = _fill_tensors(skeleton, tensors)
        if sharded is not None and not given["state"]:  # the root loaded nothing alone: keep each rank's own shard
            optimizer._shoal_base.load_state_dict(optimizer, given)  # type: ignore[attr-defined]
        else:
            optimizer.load_state_dict(given)


def _root_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the root hands out: its state dict; for a sharded optimizer (whose ``state_dict()`` gathers from every
    rank), the whole state it loaded alone since its last step, if any, else its hyperparameters only: every rank
    already holds its own shard of the state they share."""
    sharded = getattr(optimizer, "_shoal_shards", None)
    if sharded is None:
        return optimizer.state_dict()
    if sharded.loaded is not None:
        return sharded.loaded
    return optimizer._shoal_base.state_dict(optimizer)  # type: ignore[attr-defined]


def _materialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state, as Horovod does: zero gradients, then one local step.

    Every rank then holds the same state buffers (momentum, Adam's moments) for the broadcast to fill, and every
    trainable parameter has a gradient tensor afterwards. Like Horovod's, the step is the wrapped optimizer's own
    (no gradient exchange), and with weight decay it moves the parameters; broadcast_parameters after it, or
    before training, makes them equal again.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    param.grad = param.grad.to_sparse()
    base_step = getattr(optimizer, "_shoal_base", None)
    if base_step is not None:  # a DistributedOptimizer: step without exchanging the zero gradients
        base_step.step(optimizer)
    else:
        optimizer.step()


def _collect_slots(value: Any, slots: list[_TensorSlot]) -> None:
    if isinstance(value, _TensorSlot):
        slots.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_slots(item, slots)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect_slots(item, slots)
