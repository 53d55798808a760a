"""Elastic state: what a worker commits in memory, restores after a failure, and hands to newcomers.

As in Horovod, ``commit()`` copies the state in memory (no disk) and then asks whether the set of workers changed;
``restore()`` rolls back to the last commit after a failed collective; ``sync()`` makes every worker equal to rank
0 (the driver keeps rank 0 on a worker that was already training, so newcomers receive real progress).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from shoal.exceptions import HostsUpdatedInterrupt
from shoal.log import get_logger
from shoal.torch.optimizer import drop_unfinished_step


class State:
    """Base class: reset callbacks, commit and host-update checks. Subclasses say how to save, restore and sync."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset (for example, to rescale the lr to the new world size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``elastic.run`` once the job has re-formed."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory, then raise ``HostsUpdatedInterrupt`` on every worker if workers joined or left."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every worker, together, when the elastic driver has re-formed the job.

        Rank 0 reads the driver's newest round and broadcasts it, so all workers decide the same at the same commit.
        Outside an elastic shoalrun job this does nothing.
        """
        from shoal.runtime import context, elastic_rendezvous
        from shoal.torch.functions import broadcast

        if not elastic_rendezvous.is_elastic_worker():
            return
        ctx = context.current()
        newest = 0
        if ctx.topology.rank == 0:
            from shoal.comm.store import secret_namespace

            keys = elastic_rendezvous.ElasticKeys(secret_namespace(ctx.launch.secret))
            newest = elastic_rendezvous.current_round(ctx.job_store, keys)
        newest = int(broadcast(torch.tensor([newest], dtype=torch.int64), 0, name="elastic.check_host_updates")[0])
        if newest > ctx.generation:
            get_logger().info("workers joined or left (round %d -> %d); re-forming at this commit", ctx.generation, newest)
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Copy the current state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Roll back to the last ``save()``."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every worker's state equal to rank 0's, and save it."""
        raise NotImplementedError

    def reset(self) -> None:
        """Hook for subclasses: called after the job re-formed, before ``sync()``."""


class ObjectState(State):
    """Plain picklable attributes, committed by deep copy and synchronised by ``bcast_object`` from rank 0.

    Args:
        bcast_object: ``f(obj, root_rank) -> obj``, e.g. ``shoal.torch.broadcast_object``.
        get_rank: returns this worker's rank.
        **kwargs: the attributes (``state.epoch``, ``state.batch`` ...).
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        super().__init__()
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._saved_state = dict(kwargs)
        self.__dict__.update(copy.deepcopy(kwargs))

    def _current(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._saved_state}

    def save(self) -> None:
        """Deep-copy every attribute."""
        self._saved_state = copy.deepcopy(self._current())

    def restore(self) -> None:
        """Put the saved attributes back."""
        self.__dict__.update(copy.deepcopy(self._saved_state))

    def sync(self) -> None:
        """Take rank 0's attributes."""
        if self._saved_state:
            self.__dict__.update(self._bcast_object(self._current(), 0))
        self.save()


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
        from shoal.torch.basics import rank
        from shoal.torch.objects import broadcast_object

        self.model = model
        self.optimizer = optimizer
        self._handled = {name: value for name, value in kwargs.items() if _has_state_dict(value)}
        plain = {name: value for name, value in kwargs.items() if name not in self._handled}
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)
        self.__dict__.update(self._handled)
        self._saved_model: dict[str, torch.Tensor] = {}
        self._saved_optimizer: dict[str, Any] = {}
        self._saved_handled: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        """Copy model parameters and buffers, optimizer state and the other values."""
        super().save()
        if self.model is not None:
            self._saved_model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        self._saved_handled = {name: copy.deepcopy(value.state_dict()) for name, value in self._handled.items()}

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

    def sync(self) -> None:
        """Broadcast rank 0's model, optimizer state and values; re-shard samplers over the new world; save."""
        from shoal.torch.elastic.sampler import ElasticSampler
        from shoal.torch.objects import allgather_object, broadcast_object
        from shoal.torch.state import broadcast_optimizer_state, broadcast_parameters

        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            drop_unfinished_step(self.optimizer)
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for name, value in self._handled.items():
            if isinstance(value, ElasticSampler):
                # Rank 0's record, plus any indices a rank recorded alone (record_indices with local indices).
                states = allgather_object(value.state_dict(), name=f"elastic.sync.{name}")
                merged = dict(states[0])
                merged["processed_indices"] = sorted(set().union(*(st["processed_indices"] for st in states)))
                value.load_state_dict(merged)
            else:
                value.load_state_dict(broadcast_object(value.state_dict(), 0, name=f"elastic.sync.{name}"))
        super().sync()  # the plain values, then save() of everything
