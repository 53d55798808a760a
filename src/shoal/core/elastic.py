"""Elastic training's neutral part (Horovod's ``hvd.elastic``), shared by every front end: ``State``,
``ObjectState`` and ``run``.

As in Horovod, ``commit()`` copies the state in memory (no disk) and then asks whether the set of workers changed;
``restore()`` rolls back to the last commit after a failed collective; ``sync()`` makes every worker equal to rank
0 (the driver keeps rank 0 on a worker that was already training, so newcomers receive real progress). Each front
end adds the state of its own framework (``TorchState``, ``KerasState``, ``TensorFlowState``).
"""

from __future__ import annotations

import copy
import functools
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from shoal.comm.store import secret_namespace
from shoal.core import requests
from shoal.core.rules import Kind
from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt, WorkerRemovedError
from shoal.log import get_logger
from shoal.runtime import context, elastic_rendezvous, preemption

Result = TypeVar("Result")


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
        if not elastic_rendezvous.is_elastic_worker():
            return
        ctx = context.current()
        newest = 0
        if ctx.topology.rank == 0:
            keys = elastic_rendezvous.ElasticKeys(secret_namespace(ctx.launch.secret))
            newest = elastic_rendezvous.current_round(ctx.job_store, keys)
        call = requests.Call(Kind.BROADCAST, root_rank=0)
        newest_round = torch.tensor([newest], dtype=torch.int64)
        newest = int(requests.run(call, [newest_round], "elastic.check_host_updates")[0])
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
        bcast_object: ``f(obj, root_rank) -> obj``, e.g. ``shoal.core.objects.broadcast_object``.
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


def _reset() -> None:
    """Leave the broken (or outgrown) job and join the driver's next round with a fresh process group."""
    context.shutdown()
    context.init()


def run(func: Callable[..., Result]) -> Callable[..., Result]:
    """Decorate ``train(state, ...)`` so that it survives workers dying and joining (Horovod's ``elastic.run``).

    On entry, and after every reset, ``state.sync()`` makes all workers equal to rank 0. When a collective fails
    (``HorovodInternalError``: a peer died), the state rolls back to its last commit; when ``state.commit()`` reports
    changed membership (``HostsUpdatedInterrupt``), the committed state stands. Either way the worker leaves the job,
    joins shoalrun's next round at the new size, runs the reset callbacks and calls ``train`` again. A worker that
    the new round leaves out exits with status 0. Outside an elastic shoalrun job errors propagate unchanged.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Result:
        elastic = elastic_rendezvous.is_elastic_worker()
        reset_required = False
        while True:
            try:
                if reset_required:
                    try:
                        _reset()
                    except HorovodInternalError as error:
                        if not elastic:
                            raise
                        # A member of the round died while it formed: the state was restored already, and this
                        # worker has no job to restore it in; it joins the round after that one.
                        get_logger().warning("joining the re-formed job failed (%s); joining the next round", error)
                        continue
                    state.reset()
                    state.on_reset()
                state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as error:
                if not elastic:
                    raise
                get_logger().warning("a collective failed (%s); restoring the last commit", error)
                state.restore()
            except HostsUpdatedInterrupt:
                if not elastic:
                    raise
            except WorkerRemovedError as error:
                notice = preemption.noticed()
                if notice is not None:
                    get_logger().warning("left the job after a %s notice, at a commit", signal.Signals(notice).name)
                else:
                    get_logger().info("%s; this worker exits", error)
                sys.exit(0)
            reset_required = True

    return wrapper
