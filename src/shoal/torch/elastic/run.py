"""``shoal.torch.elastic.run``: retry the training function across failures and membership changes."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt, WorkerRemovedError
from shoal.log import get_logger
from shoal.torch.elastic.state import State

Result = TypeVar("Result")


def _reset() -> None:
    """Leave the broken (or outgrown) job and join the driver's next round with a fresh process group."""
    from shoal.runtime import context

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
        from shoal.runtime import elastic_rendezvous

        elastic = elastic_rendezvous.is_elastic_worker()
        reset_required = False
        while True:
            try:
                if reset_required:
                    _reset()
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
                get_logger().info("%s; this worker exits", error)
                sys.exit(0)
            reset_required = True

    return wrapper
