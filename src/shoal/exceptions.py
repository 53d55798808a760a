"""Exceptions a training script may catch, under the names Horovod gives them (``horovod.common.exceptions``)."""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective could not complete because the job broke (a peer died, a connection dropped).

    Elastic training catches it, restores the last commit and re-forms the job with the workers that are left.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Raised at a commit when workers joined or left: the job re-forms at the new size from the committed state.

    Args:
        skip_sync: True when no new worker needs the state (Horovod's field; Shoal always synchronises anyway).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of workers changed; re-forming the job at the next commit")
        self.skip_sync = skip_sync


class WorkerRemovedError(RuntimeError):
    """This worker is not part of the re-formed job (its host was removed, or the job shrank below it)."""


class ElasticRendezvousError(RuntimeError):
    """An elastic worker could not join a new round (the driver is gone, or the round never formed in time)."""


class CollectiveMismatchError(RuntimeError):
    """The ranks submitted disagreeing requests under one name (shape, dtype, op, root rank, scale factors).

    Found in negotiation, so every rank that submitted the request gets it at once, and the next request works.
    Horovod's torch front end raises such errors as ``RuntimeError``, its TensorFlow one as
    ``tf.errors.FailedPreconditionError``.
    """


class UnsupportedOperationError(RuntimeError):
    """An operation Horovod does not run, such as reducescatter with Adasum (Horovod's torch: ``RuntimeError``)."""


class NotInitializedError(ValueError):
    """A call that needs ``init()`` came before it (or after ``shutdown()``); Horovod raises ``ValueError``."""
