"""Requests, their metadata as negotiated between ranks, and the handles users wait on."""

from __future__ import annotations

import _thread
import enum
import time
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import torch


class ReduceOp(enum.IntEnum):
    """Reduction operations, with Horovod's names."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


class Kind(str, enum.Enum):
    """What a request asks the engine to do."""

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"
    JOIN = "join"
    ADD_PROCESS_SET = "add_process_set"
    REMOVE_PROCESS_SET = "remove_process_set"


DATA_KINDS = (Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL, Kind.REDUCESCATTER)


@dataclass(frozen=True)
class RequestMeta:
    """What every rank must agree on before a collective runs; small and picklable, it is what is negotiated."""

    name: str
    kind: Kind
    process_set: int
    dtype: str = ""
    shape: tuple[int, ...] = ()
    op: int | None = None
    root: int | None = None
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] | None = None
    """alltoall: rows this rank sends to each member of the process set."""
    device: str = "cpu"
    payload: tuple[int, ...] | None = None
    """Process-set management: the ranks of the set (add) or its id (remove)."""
    shared: tuple[str, int] | None = None
    """allreduce: the tensor is the range at this byte offset of the named shared-memory arena (the same range on
    every rank of the host: see ``shoal.comm.shared_arena``); None for an ordinary tensor."""

    @cached_property
    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, entry.name) for entry in fields(self))

    # The response cache looks every cached request up by its meta each cycle: equality and hash over the fields
    # gathered once, rather than over a tuple built per comparison (what dataclass generates).
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not RequestMeta:
            return NotImplemented
        return self._fields == other._fields

    def __hash__(self) -> int:
        return hash(self._fields)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of the tensor this request carries (worked out once: fusion reads it every cycle)."""
        if not self.dtype:
            return 0
        count = 1
        for dim in self.shape:
            count *= dim
        return count * getattr(torch, self.dtype).itemsize


class Latch:
    """A one-shot event, set once and never cleared: what ``Request.done`` needs of ``threading.Event``.

    One lock, held from birth and released by ``set``, instead of an Event's condition and its lock: making one
    costs about a tenth as much, and a small collective makes one per tensor. Any number of threads may wait.
    """

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        """Whether ``set`` was called."""
        return self._flag

    def set(self) -> None:
        """Wake every waiter, now and later; a second call does nothing."""
        if self._flag:
            return
        self._flag = True
        try:
            self._lock.release()
        except RuntimeError:  # set twice at once (a completion racing a failure): the lock is already free
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``set`` (or ``timeout`` seconds); whether it was set."""
        if self._flag:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return self._flag
        try:
            self._lock.release()  # pass the wake-up on to the next waiter
        except RuntimeError:  # a racing second set() released it first: it is free either way
            pass
        return True


@dataclass
class Request:
    """A user's request, as the submitting rank holds it until completion."""

    meta: RequestMeta
    tensor: torch.Tensor | None
    """The input, made contiguous."""
    output: torch.Tensor | None
    """Where the result lands: the user's tensor for in-place forms, else a new tensor (may be resized)."""
    submitted_at: float = field(default_factory=time.monotonic)
    done: Latch = field(default_factory=Latch)
    result: Any = None
    error: BaseException | None = None
    user_tensor: torch.Tensor | None = None
    """For in-place forms on a non-contiguous tensor: the user's tensor, written back on completion."""
    checked: bool = False
    """``meta`` already passed ``check_request`` (the shared builder checks what it builds); the engine checks the rest."""

    def complete(self, result: Any) -> None:
        """Record the result and wake whoever waits."""
        if self.user_tensor is not None and isinstance(result, torch.Tensor):
            self.user_tensor.copy_(result)
            result = self.user_tensor
        self.result = result
        if result is not self.tensor:  # the input is spent: free it now, not when the caller synchronizes
            self.tensor = None
        self.done.set()

    def fail(self, error: BaseException) -> None:
        """Record the error and wake whoever waits."""
        self.error = error
        self.done.set()
