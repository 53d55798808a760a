"""What engines send each other while negotiating: JSON with a fixed shape, checked on receipt, never pickle.

A peer's bytes are decoded into ``RequestMeta`` objects field by field; anything of the wrong type, an unknown kind
or an absurd size is a ``ValueError`` naming the sending rank (the engine then stops: its peers no longer speak
the same protocol). Unpickling a peer's data would let whoever gets into a group run code in every rank.
"""

from __future__ import annotations

import json
from typing import Any

from shoal.engine.request import Kind, RequestMeta

_MAX_NAME = 4096
_MAX_DIMS = 64


def encode_requests(metas: list[RequestMeta]) -> bytes:
    """One rank's new requests, for the negotiation allgather."""
    rows = [
        [
            m.name,
            m.kind.value,
            m.process_set,
            m.dtype,
            list(m.shape),
            m.op,
            m.root,
            m.prescale,
            m.postscale,
            None if m.splits is None else list(m.splits),
            m.device,
            None if m.payload is None else list(m.payload),
            None if m.shared is None else [m.shared[0], m.shared[1]],
        ]
        for m in metas
    ]
    return json.dumps(rows, separators=(",", ":")).encode()


def _int(value: Any, what: str) -> int:
    if type(value) is not int:
        raise ValueError(f"{what} must be an integer, got {type(value).__name__}")
    return value


def _optional_int(value: Any, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 1 << 16:
        raise ValueError(f"{what} must be a list of integers")
    return tuple(_int(v, what) for v in value)


def _number(value: Any, what: str) -> float:
    if type(value) not in (int, float):
        raise ValueError(f"{what} must be a number, got {type(value).__name__}")
    return float(value)


def _text(value: Any, what: str, limit: int = 64) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{what} must be a string of at most {limit} characters")
    return value


def _decode_meta(row: Any) -> RequestMeta:
    if not isinstance(row, list) or len(row) != 13:
        raise ValueError("a request must be a list of 13 fields")
    name, kind, process_set, dtype, shape, op, root, prescale, postscale, splits, device, payload, shared = row
    dims = _ints(shape, "shape")
    if len(dims) > _MAX_DIMS or any(d < 0 for d in dims):
        raise ValueError(f"invalid shape {dims}")
    try:
        kind_value = Kind(_text(kind, "kind"))
    except ValueError:
        raise ValueError(f"unknown request kind {kind!r}") from None
    return RequestMeta(
        name=_text(name, "name", _MAX_NAME),
        kind=kind_value,
        process_set=_int(process_set, "process set"),
        dtype=_text(dtype, "dtype"),
        shape=dims,
        op=_optional_int(op, "op"),
        root=_optional_int(root, "root"),
        prescale=_number(prescale, "prescale"),
        postscale=_number(postscale, "postscale"),
        splits=None if splits is None else _ints(splits, "splits"),
        device=_text(device, "device"),
        payload=None if payload is None else _ints(payload, "payload"),
        shared=None if shared is None else _shared(shared),
    )


def _shared(value: Any) -> tuple[str, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("shared must be [arena, byte offset]")
    offset = _int(value[1], "shared offset")
    if offset < 0:
        raise ValueError(f"invalid shared offset {offset}")
    return _text(value[0], "shared arena"), offset


def decode_requests(data: bytes, rank: int) -> list[RequestMeta]:
    """A peer's new requests; ValueError naming ``rank`` when the message is malformed."""
    try:
        rows = json.loads(data)
        if not isinstance(rows, list):
            raise ValueError("expected a list of requests")
        return [_decode_meta(row) for row in rows]
    except (ValueError, TypeError, RecursionError) as error:
        raise ValueError(f"malformed negotiation message from rank {rank}: {error}") from None


def encode_stall_report(report: list[tuple[int, str, float]]) -> bytes:
    """One rank's pending requests and their ages, for the stall inspector."""
    return json.dumps([list(entry) for entry in report], separators=(",", ":")).encode()


def decode_stall_report(data: bytes, rank: int) -> list[tuple[int, str, float]]:
    """A peer's stall report; ValueError naming ``rank`` when the message is malformed."""
    try:
        rows = json.loads(data)
        if not isinstance(rows, list):
            raise ValueError("expected a list")
        report = []
        for row in rows:
            if not isinstance(row, list) or len(row) != 3:
                raise ValueError("an entry must be [process set, name, seconds]")
            report.append((_int(row[0], "process set"), _text(row[1], "name", _MAX_NAME), _number(row[2], "seconds")))
        return report
    except (ValueError, TypeError, RecursionError) as error:
        raise ValueError(f"malformed stall report from rank {rank}: {error}") from None
