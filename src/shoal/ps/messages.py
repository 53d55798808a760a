"""The parameter server's wire format: a small float64 header, then (for some kinds) one payload tensor.

Every message goes over one connection of the point-to-point group, so a header and its payload arrive in order;
headers and payloads travel under different tags so each side posts exactly the receive it expects. A header is
``[kind, session, piece, clock, lr, extra]``; float64 holds integers exactly up to 2**53 and a learning rate as is.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

HEADER_LENGTH = 6
TAG_TO_SERVER = 11
"""Worker to server: headers."""
TAG_TO_SERVER_PAYLOAD = 12
"""Worker to server: the payload that follows an INIT or PUSH header."""
TAG_TO_WORKER = 13
"""Server to worker: headers."""
TAG_TO_WORKER_PAYLOAD = 14
"""Server to worker: the parameter values that follow a REPLY header."""


class Kind(enum.IntEnum):
    """What a header announces."""

    INIT = 1
    """Worker 0 to server: a piece's initial values (payload), sent before the piece's first push."""
    PUSH = 2
    """Worker to server: a piece's gradient (payload) for the worker's ``clock`` (its step count)."""
    BYE = 3
    """Worker to server: this worker will send nothing more."""
    REPLY = 4
    """Server to worker: a piece's fresh values (payload); ``clock`` is the piece's version."""
    ERROR = 5
    """Server to worker: the server stopped because worker ``extra`` vanished."""
    BYE_ACK = 6
    """Server to worker: the last message on this connection."""


def header(kind: Kind, session: int = 0, piece: int = 0, clock: int = 0, lr: float = 0.0, extra: int = 0) -> torch.Tensor:
    """A header tensor for one message."""
    return torch.tensor([float(kind), session, piece, clock, lr, extra], dtype=torch.float64)


def empty_header() -> torch.Tensor:
    """A buffer to receive a header into."""
    return torch.empty(HEADER_LENGTH, dtype=torch.float64)


def unpack(received: torch.Tensor) -> tuple[Kind, int, int, int, float, int]:
    """(kind, session, piece, clock, lr, extra) of a received header."""
    kind, session, piece, clock, lr, extra = received.tolist()
    return Kind(int(kind)), int(session), int(piece), int(clock), lr, int(extra)


@dataclass(frozen=True)
class SessionSpec:
    """What worker 0 publishes in the store (``session/<id>``, JSON) for the servers: one optimizer's PS layers."""

    optimizer: str
    """The server-side optimizer (``describe_optimizer``'s name: sgd, adam, adamw)."""
    groups: list[dict[str, Any]]
    """Hyperparameters per param group of the wrapped optimizer."""
    param_groups: list[int]
    """Per served parameter, the index of its group."""
    mode: str
    """bsp, ssp or async."""
    staleness: int
    average: bool
    """Average the workers' gradients (else sum)."""
    pieces: list[list[int]] = field(default_factory=list)
    """Per piece: [parameter index, start, numel, itemsize, server]."""
    names: list[str] = field(default_factory=list)
    """Per served parameter, its name."""
    dtypes: list[str] = field(default_factory=list)
    """Per served parameter, its torch dtype without the ``torch.`` prefix."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SessionSpec:
        return cls(**json.loads(text))
