"""Broadcast and allgather of arbitrary picklable Python objects (and, for Shoal's own set-up, of JSON), over the tensor
collectives."""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

import torch

from shoal.core import requests
from shoal.core.basics import rank
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import Kind


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
    call = requests.Call(Kind.BROADCAST, process_set, root_rank=root_rank)
    length = requests.run(call, [torch.tensor([payload.numel()], dtype=torch.int64)], f"{base}.size")
    if rank() != root_rank:
        payload = torch.empty(int(length), dtype=torch.uint8)
    data = requests.run(call, [payload], f"{base}.data")
    return _from_bytes(data)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every rank's ``obj``, in rank order."""
    base = name or "allgather_object"
    payload = _to_bytes(obj)
    call = requests.Call(Kind.ALLGATHER, process_set)
    lengths = requests.run(call, [torch.tensor([payload.numel()], dtype=torch.int64)], f"{base}.size")
    data = requests.run(call, [payload], f"{base}.data")
    objects, offset = [], 0
    for length in lengths.tolist():
        objects.append(_from_bytes(data[offset : offset + length]))
        offset += length
    return objects


def allgather_json(obj: Any, name: str, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order: what Shoal itself exchanges (never unpickled: a peer's bytes
    run no code here). A peer's malformed bytes raise ``ValueError``."""
    payload = torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)
    call = requests.Call(Kind.ALLGATHER, process_set)
    lengths = requests.run(call, [torch.tensor([payload.numel()], dtype=torch.int64)], f"{name}.size")
    data = requests.run(call, [payload], f"{name}.data")
    objects, offset = [], 0
    for length in lengths.tolist():
        objects.append(json.loads(data[offset : offset + length].numpy().tobytes()))
        offset += length
    return objects
