"""Elastic state for torch: ``TorchState`` (a model, its optimizer and other values) on the core's ``ObjectState``.

As in Horovod, ``commit()`` copies the state in memory (no disk) and then asks whether the set of workers changed;
``restore()`` rolls back to the last commit after a failed collective; ``sync()`` makes every worker equal to rank
0 (the driver keeps rank 0 on a worker that was already training, so newcomers receive real progress). With local
steps the outer state goes with the model, and the hosts' progress since the round's start is merged
(``shoal.torch.elastic.outer``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from shoal.core.basics import rank, size
from shoal.core.elastic import ObjectState
from shoal.core.process_sets import global_process_set
from shoal.torch.elastic.outer import ElasticOuter
from shoal.torch.optimizer import drop_unfinished_step, reshard, rounds_of


def _has_state_dict(value: Any) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


class TorchState(ObjectState):
    """A model, its optimizer, and any other state (epoch, batch, an ElasticSampler, an lr scheduler).

    Values with ``state_dict``/``load_state_dict`` (samplers, schedulers) are committed through their state dicts;
    everything else by deep copy. After ``sync()`` an ``ElasticSampler`` re-shards the epoch over the new world.

    Args:
        model: the ``nn.Module`` being trained, or None.
        optimizer: its optimizer (a ``DistributedOptimizer``), or None.
        **kwargs: more state, reachable as attributes (``state.epoch``).
    """

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any
    ) -> None:
        from shoal.core.objects import broadcast_object

        self.model = model
        self.optimizer = optimizer
        self._handled = {name: value for name, value in kwargs.items() if _has_state_dict(value)}
        plain = {name: value for name, value in kwargs.items() if name not in self._handled}
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)
        self.__dict__.update(self._handled)
        self._saved_model: dict[str, torch.Tensor] = {}
        self._saved_optimizer: dict[str, Any] = {}
        self._saved_handled: dict[str, Any] = {}
        self._saved_lossy: tuple[int, dict[str, Any]] | None = None
        rounds = rounds_of(optimizer) if optimizer is not None else None
        self._outer = ElasticOuter(rounds, optimizer._shoal_exchange) if rounds is not None else None  # type: ignore[union-attr]
        """With local steps: their outer state, committed and synced with the model."""
        self.save()

    def save(self) -> None:
        """Copy model parameters and buffers, optimizer state and the other values."""
        super().save()
        if self.model is not None:
            self._saved_model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        self._saved_handled = {name: copy.deepcopy(value.state_dict()) for name, value in self._handled.items()}
        lossy = self._lossy()
        if lossy is not None:
            self._saved_lossy = (size(), lossy.state_dict())
        if self._outer is not None:
            self._outer.save()

    def _lossy(self) -> Any:
        """The optimizer's compressed schemes' state (residuals, bases, step count), if it is a DistributedOptimizer."""
        exchange = getattr(self.optimizer, "_shoal_exchange", None)
        router = getattr(exchange, "router", None)
        return getattr(router, "lossy", None)

    def restore(self) -> None:
        """Roll everything back to the last commit, and drop gradient exchanges of the failed step."""
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            drop_unfinished_step(self.optimizer)
            self.optimizer.load_state_dict(copy.deepcopy(self._saved_optimizer))
        for name, value in self._handled.items():
            value.load_state_dict(copy.deepcopy(self._saved_handled[name]))
        lossy = self._lossy()
        if lossy is not None and self._saved_lossy is not None:
            lossy.load_state_dict(self._saved_lossy[1])
        if self._outer is not None:
            self._outer.restore()

    def reset(self) -> None:
        """After the job re-formed: local steps register the new job's host groups (collective, before the sync); a
        sharded optimizer takes its pieces of the new world, from the last commit."""
        if self._outer is not None:
            self._outer.regroup()
        if self.optimizer is not None:
            reshard(self.optimizer, self._saved_optimizer)

    def sync(self) -> None:
        """Broadcast rank 0's model, optimizer state and values; re-shard samplers over the new world; save."""
        from shoal.core.objects import allgather_object, broadcast_object
        from shoal.torch.elastic.sampler import ElasticSampler
        from shoal.torch.state import broadcast_optimizer_state, broadcast_parameters

        if self._outer is not None:  # before the model's broadcast: it reads each host's own progress
            self._outer.prepare()
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            drop_unfinished_step(self.optimizer)
            broadcast_optimizer_state(self.optimizer, root_rank=0)
            lossy = self._lossy()
            if lossy is not None:  # what the residuals owe the model, shared among the ranks training now
                lossy.pool(self._saved_lossy[0] if self._saved_lossy is not None else size(), global_process_set)
        for name, value in self._handled.items():
            if isinstance(value, ElasticSampler):
                # Rank 0's record, plus any indices a rank recorded alone (record_indices with local indices).
                states = allgather_object(value.state_dict(), name=f"elastic.sync.{name}")
                merged = dict(states[0])
                merged["processed_indices"] = sorted(set().union(*(st["processed_indices"] for st in states)))
                value.load_state_dict(merged)
            else:
                value.load_state_dict(broadcast_object(value.state_dict(), 0, name=f"elastic.sync.{name}"))
        if self._outer is not None:
            self._outer.apply()
        super().sync()  # the plain values, then save() of everything
