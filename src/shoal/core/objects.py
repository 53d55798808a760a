"""Broadcast and allgather of arbitrary picklable Python objects, over the tensor collectives."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from shoal.core import requests, session
from shoal.core.basics import rank
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import Kind


def _broadcast(tensor: torch.Tensor, root_rank: int, name: str, process_set: ProcessSet) -> torch.Tensor:
    call = requests.Call(Kind.BROADCAST, process_set, root_rank=root_rank)
    return session.synchronize(requests.submit(call, [tensor], name))


def _allgather(tensor: torch.Tensor, name: str, process_set: ProcessSet) -> torch.Tensor:
    return session.synchronize(requests.submit(requests.Call(Kind.ALLGATHER, process_set), [tensor], name))


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    pickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled; the object need not exist on the other ranks)."""
    base = name or "broadcast_object"
    payload = _to_bytes(obj) if rank() == root_rank else torch.empty(0, dtype=torch.uint8)
    length = _broadcast(torch.tensor([payload.numel()], dtype=torch.int64), root_rank, f"{base}.size", process_set)
    if rank() != root_rank:
        payload = torch.empty(int(length), dtype=torch.uint8)
    data = _broadcast(payload, root_rank, f"{base}.data", process_set)
    return _from_bytes(data)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every rank's ``obj``, in rank order."""
    base = name or "allgather_object"
    payload = _to_bytes(obj)
    lengths = _allgather(torch.tensor([payload.numel()], dtype=torch.int64), f"{base}.size", process_set)
    data = _allgather(payload, f"{base}.data", process_set)
    objects, offset = [], 0
    for length in lengths.tolist():
        objects.append(_from_bytes(data[offset : offset + length]))
        offset += length
    return objects
