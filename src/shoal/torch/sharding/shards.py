"""This rank's shard of the optimizer (ZeRO, arXiv 1910.02054): the user's optimizer class stepping only the
elements this rank owns, then every rank's updated elements gathered back into the parameters.

Each param group has one flat shard tensor here (``ShardLayout``: this rank's pieces of the group's parameters),
and an optimizer of the user's own class, built with the user's hyperparameters, steps those tensors. Its state
(momentum, Adam's moments) is therefore 1/N of the whole on each of N ranks. The optimizers this works for are the
ones whose update of an element reads only that element and the group's scalars (``ELEMENTWISE``); any other is
refused before training, since its update would silently change on a shard.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import ReduceOp
from shoal.torch import functions
from shoal.torch.sharding.layout import Bucket, GatherChunk, ShardLayout
from shoal.torch.sharding.stage import Shard

GATHER_CHUNK_BYTES = 8 << 20
"""About how many bytes of parameters one allgather of updated values carries (at least a bucket): fewer requests
than one per bucket, and two such runs held at once at most, never the whole model."""

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
"""The torch optimizers whose update of an element reads only that element's gradient and state and the group's
scalars, so that stepping a flat shard gives the same values as stepping the whole parameters."""


def check_shardable(base: type[torch.optim.Optimizer], params: list[torch.Tensor]) -> None:
    """Refuse what a shard cannot step as the whole would be stepped.

    Raises:
        ValueError: the optimizer's update reads more than an element (LBFGS, Adafactor, a custom class), or the
            parameters differ in dtype or device.
    """
    if not issubclass(base, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(
            f"shard= needs an optimizer whose update is elementwise ({names}, or a subclass); {base.__name__} may read "
            "more than its shard of a parameter, so it is not sharded: use shard=None"
        )
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"shard= needs the trainable parameters in one dtype on one device, got {sorted(map(str, kinds))}")


class ShardedOptimizer:
    """This rank's shards, their optimizer, and the gather of every rank's updated elements after its step.

    Args:
        stage: stage 1 (the gradients arrive whole) or stage 2 (each rank's block arrives from a reduce-scatter).
        base: the user's optimizer class.
        defaults: the user's optimizer's ``defaults``.
        param_groups: the user's param groups (their hyperparameters are given again at every step).
        params: the trainable parameters, in the optimizer's order (the layout's indices).
        layout: who owns what.
        process_set: the ranks that share the state.
        name: a prefix for this optimizer's requests to the engine.
    """

    __slots__ = (
        "_build",
        "_chunks",
        "_runs",
        "inner",
        "layout",
        "loaded",
        "name",
        "params",
        "process_set",
        "shards",
        "stage",
    )

    def __init__(
        self,
        stage: Shard,
        base: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        param_groups: list[dict[str, Any]],
        params: list[torch.Tensor],
        layout: ShardLayout,
        process_set: ProcessSet,
        name: str,
    ) -> None:
        self.stage, self.params, self.process_set, self.name = stage, params, process_set, name
        self.loaded: dict[str, Any] | None = None
        """A full state dict loaded on this rank alone, kept until ``broadcast_optimizer_state`` hands it out."""
        self._build = lambda shards: _build(
            base, defaults, [{**_hyper(group), "params": [shard]} for group, shard in zip(param_groups, shards, strict=True)]
        )
        self.relayout(layout)

    def relayout(self, layout: ShardLayout) -> None:
        """Own ``layout``'s pieces from now on (an elastic job re-formed over another world): new shards from the
        parameters' values, and a new optimizer over them, with no state (load the committed state next)."""
        like = self.params[0] if self.params else torch.empty(0)
        self.layout = layout
        self.shards = [torch.zeros(n, dtype=like.dtype, device=like.device) for n in layout.shard_sizes]
        self._runs = layout.runs()
        self._chunks = layout.gather_chunks(max(layout.bucket_bytes, GATHER_CHUNK_BYTES) // layout.element_bytes)
        self.copy_values_in()
        self.inner = self._build(self.shards)

    @property
    def state_numel(self) -> int:
        """Elements of optimizer state this rank holds (its shards' per-element state)."""
        return sum(t.numel() for state in self.inner.state.values() for t in state.values() if _per_element(t))

    def copy_values_in(self) -> None:
        """Copy the parameters' current values of this rank's pieces into its shards."""
        for bucket_pieces in self.layout.pieces:
            for piece in bucket_pieces:
                source = self.params[piece.param].detach().reshape(-1)[piece.start : piece.start + piece.length]
                self.shards[piece.group][piece.shard_start : piece.shard_start + piece.length].copy_(source)

    # ----- gradients in -----

    def take_grads(self) -> None:
        """Stage 1: the reduced gradients are whole in ``p.grad``; copy this rank's pieces of them (zeros for a
        parameter without one)."""
        grads = self._grad_buffers()
        for bucket_pieces in self.layout.pieces:
            for piece in bucket_pieces:
                grad = self.params[piece.param].grad
                target = grads[piece.group][piece.shard_start : piece.shard_start + piece.length]
                if grad is None:
                    target.zero_()
                else:
                    target.copy_(grad.reshape(-1)[piece.start : piece.start + piece.length])

    def take_block(self, bucket: Bucket, block: torch.Tensor) -> None:
        """Stage 2: ``block`` is this rank's reduced block of ``bucket``; copy it into the shards' gradients."""
        grads = self._grad_buffers()
        for piece in self.layout.pieces[bucket.index]:
            target = grads[piece.group][piece.shard_start : piece.shard_start + piece.length]
            target.copy_(block[piece.block_start : piece.block_start + piece.length])

    def _grad_buffers(self) -> list[torch.Tensor]:
        for shard in self.shards:
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
        return [s.grad for s in self.shards]  # type: ignore[misc]  # every shard has one now

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Stage 2: scale the shards' gradients so that the norm of the whole reduced gradient, taken across every
        rank's shards, is at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s rule); return that norm."""
        grads = [s.grad.reshape(-1) for s in self.shards if s.grad is not None]
        flat = torch.cat(grads) if grads else torch.zeros(0)
        if norm_type == float("inf"):
            mine = flat.abs().max() if flat.numel() else torch.zeros(())
            total = functions.allreduce(
                mine.reshape(1), name=f"{self.name}.norm", op=ReduceOp.Max, process_set=self.process_set
            )[0]
        else:
            mine = flat.abs().pow(norm_type).sum() if flat.numel() else torch.zeros(())
            summed = functions.allreduce(
                mine.reshape(1), name=f"{self.name}.norm", op=ReduceOp.Sum, process_set=self.process_set
            )
            total = summed[0].pow(1.0 / norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return total

    # ----- the step -----

    def step(self, closure: Callable[[], Any] | None, param_groups: list[dict[str, Any]]) -> Any:
        """Step this rank's shards with the current hyperparameters of the user's ``param_groups`` (an LR scheduler
        changes them), then gather every rank's updated elements into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner, outer in zip(self.inner.param_groups, param_groups, strict=True):
            inner.update(_hyper(outer))
        # The parameters are the truth: a broadcast, a checkpoint or an elastic roll-back may have changed them.
        self.copy_values_in()
        self.inner.step()
        if self.stage is Shard.OPTIMIZER:  # the whole gradients stay in p.grad: hold the shard's copy only for the step
            for shard in self.shards:
                shard.grad = None
        self.loaded = None
        self.gather_values()
        return loss

    def gather_values(self) -> None:
        """Allgather every rank's updated blocks and write them into the parameters, a run of buckets per request
        (``GATHER_CHUNK_BYTES``): the next run is on its way while this one is written, and no rank ever holds the
        whole gathered model."""
        mine = self._owned(self.shards)
        previous = None
        for index, chunk in enumerate(self._chunks):
            part = mine[chunk.owned_start : chunk.owned_stop]
            handle = functions.allgather_async(part, name=f"{self.name}.values.{index}", process_set=self.process_set)
            if previous is not None:
                self._write(*previous)
            previous = (handle, chunk)
        if previous is not None:
            self._write(*previous)

    def _write(self, handle: int, chunk: GatherChunk) -> None:
        whole = handles.synchronize(handle)
        with torch.no_grad():
            for param, start, length, at in chunk.runs:
                self.params[param].view(-1)[start : start + length].copy_(whole[at : at + length])

    def _owned(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's blocks of every bucket, in bucket order, read from per-group flat ``tensors`` laid out as the
        shards (with one group, that is its tensor itself)."""
        if len(tensors) == 1:
            return tensors[0]
        blocks = [self._block(bucket, tensors) for bucket in self.layout.buckets]
        return torch.cat(blocks) if blocks else torch.empty(0)

    def _block(self, bucket: Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's block of ``bucket``, read from per-group flat ``tensors`` laid out as the shards."""
        pieces = self.layout.pieces[bucket.index]
        if not pieces:
            return tensors[0].new_empty(0) if tensors else torch.empty(0)
        return torch.cat([tensors[p.group][p.shard_start : p.shard_start + p.length] for p in pieces])

    # ----- the state, whole -----

    def full_state(self, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        """Every parameter's state in torch's own form (``Optimizer.state_dict()['state']``), gathered from every
        rank: call it on every rank. ``index_of``: each parameter's index in the state dict, by ``id``."""
        per_group = [self.inner.state.get(shard, {}) for shard in self.shards]
        keys = sorted({k for state in per_group for k, v in state.items() if _per_element(v)})
        gathered: dict[str, list[torch.Tensor]] = {}
        for key in keys:
            tensors = [state.get(key, torch.zeros(0)) for state in per_group]
            whole = functions.allgather(self._owned(tensors), name=f"{self.name}.state.{key}", process_set=self.process_set)
            full = [torch.empty(p.numel(), dtype=whole.dtype) for p in self.params]
            for param, start, length, at in self._runs:
                full[param][start : start + length].copy_(whole[at : at + length])
            gathered[key] = [f.view(p.shape) for f, p in zip(full, self.params, strict=True)]
        result: dict[int, dict[str, Any]] = {}
        for param, tensor in enumerate(self.params):
            state = per_group[self.layout.groups[param]]
            if not state:
                continue
            entry = {k: (gathered[k][param] if k in gathered else _copy(v)) for k, v in state.items()}
            result[index_of[id(tensor)]] = entry
        return result

    def load_full_state(self, state: dict[int, dict[str, Any]], index_of: dict[int, int]) -> None:
        """Keep this rank's pieces of a whole state (torch's form, ``state_dict()['state']``); no communication."""
        group_of = self.layout.groups
        per_group: list[dict[str, Any]] = [{} for _ in self.shards]
        for param, tensor in enumerate(self.params):
            entry = state.get(index_of[id(tensor)])
            if not entry:
                continue
            target = per_group[group_of[param]]
            for key, value in entry.items():
                if _per_param(value, tensor):
                    target.setdefault(key, torch.zeros_like(self.shards[group_of[param]], dtype=value.dtype))
                else:
                    target.setdefault(key, _copy(value))
        for bucket_pieces in self.layout.pieces:
            for piece in bucket_pieces:
                entry = state.get(index_of[id(self.params[piece.param])]) or {}
                for key, value in entry.items():
                    if _per_param(value, self.params[piece.param]):
                        flat = value.reshape(-1)[piece.start : piece.start + piece.length]
                        per_group[piece.group][key][piece.shard_start : piece.shard_start + piece.length].copy_(flat)
        self.inner.state.clear()
        for shard, entry in zip(self.shards, per_group, strict=True):
            if entry:
                self.inner.state[shard] = entry


def _per_element(value: object) -> bool:
    """A state tensor holding a value per element (momentum, moments), not a scalar (the step count)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1


def _per_param(value: object, param: torch.Tensor) -> bool:
    """A state tensor of a whole parameter holding a value per element (what a shard keeps pieces of)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == param.numel()


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def _build(base: type[torch.optim.Optimizer], defaults: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of the user's class over the shards, built by its own constructor with the user's defaults."""
    accepted = inspect.signature(base.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    try:
        return base(groups, **kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"shard= could not build a {base.__name__} over this rank's shards: {error}") from error
