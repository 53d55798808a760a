"""Requests, their metadata as negotiated between ranks, and the handles users wait on."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
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

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor this request carries."""
        if not self.dtype:
            return 0
        count = 1
        for dim in self.shape:
            count *= dim
        return count * getattr(torch, self.dtype).itemsize


@dataclass
class Request:
    """A user's request, as the submitting rank holds it until completion."""

    meta: RequestMeta
    tensor: torch.Tensor | None
    """The input, made contiguous."""
    output: torch.Tensor | None
    """Where the result lands: the user's tensor for in-place forms, else a new tensor (may be resized)."""
    submitted_at: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    user_tensor: torch.Tensor | None = None
    """For in-place forms on a non-contiguous tensor: the user's tensor, written back on completion."""

    def complete(self, result: Any) -> None:
        """Record the result and wake whoever waits."""
        if self.user_tensor is not None and isinstance(result, torch.Tensor):
            self.user_tensor.copy_(result)
            result = self.user_tensor
        self.result = result
        self.done.set()

    def fail(self, error: BaseException) -> None:
        """Record the error and wake whoever waits."""
        self.error = error
        self.done.set()
