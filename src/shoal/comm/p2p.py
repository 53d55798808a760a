"""Point-to-point messages between parameter-server parties, over a gloo process group of their own.

The parameter server (``shoal.ps``) needs a group that is independent of the Horovod world: in dedicated mode its
servers are not Horovod ranks at all. This module builds that group straight from a store
(``ProcessGroupGloo(PrefixStore(...))``), and wraps gloo's tagged send and receive.

Two properties of gloo's point-to-point calls shape everything above this module (measured on torch 2.13):

* a receive from a named peer fails promptly with "Connection closed by peer" when that peer dies, but a receive
  from *any* source never notices a dead peer; so every receive here names its peer;
* a wait that times out closes the connection for good, and ``is_completed()`` is not updated before ``wait()``;
  so there is no polling: a receive blocks in its own thread until the peer sends or dies, and the group is built
  with a timeout long enough for a worker that is merely busy.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.comm import store as store_module

_LAZY_INIT_ENV = "TORCH_GLOO_LAZY_INIT"
_LAZY_INIT_LOCK = threading.Lock()
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
"""How long a receive may wait for a live peer that has nothing to say (a worker evaluating, say)."""


class PeerLostError(RuntimeError):
    """A peer of the point-to-point group closed its connection (it died, or left without saying goodbye)."""

    def __init__(self, peer: int, detail: str) -> None:
        super().__init__(f"point-to-point peer {peer} is gone: {detail}")
        self.peer = peer

    @classmethod
    def from_gloo(cls, peer: int, error: RuntimeError) -> PeerLostError:
        """The error for gloo's, without the generic advice gloo appends."""
        return cls(peer, str(error).split(". This is typically")[0])


@dataclass
class PendingSend:
    """A send in flight; ``tensor`` stays referenced until ``wait`` returns, as gloo reads it in the background."""

    work: Any
    tensor: torch.Tensor
    peer: int

    def wait(self) -> None:
        """Block until the bytes are out; raises ``PeerLostError`` when the receiver is gone."""
        try:
            self.work.wait()
        except RuntimeError as error:
            raise PeerLostError.from_gloo(self.peer, error) from error


class PeerGroup:
    """One party's handle on a gloo group used only for tagged point-to-point messages."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float = IDLE_TIMEOUT_S) -> None:
        """Join the group (connections open lazily: call ``arrive_and_wait`` before the first message).

        Args:
            store: a store that every party reaches, already scoped to this group (for example a PrefixStore).
            rank: this party's rank in the group.
            size: number of parties.
            timeout_s: how long any single receive may wait (gloo applies one timeout to everything).
        """
        self.rank = rank
        self.size = size
        # Lazy connections: a co-located worker builds two groups (its client rank and its server rank), and an
        # eager gloo group blocks its constructor, holding the GIL, until every rank connected: the second group
        # of the same process could never join. Connections then open on first use (after arrive_and_wait).
        with _LAZY_INIT_LOCK:
            previous = os.environ.get(_LAZY_INIT_ENV)
            os.environ[_LAZY_INIT_ENV] = "1"
            try:
                self._group: Any = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
            finally:
                if previous is None:
                    del os.environ[_LAZY_INIT_ENV]
                else:
                    os.environ[_LAZY_INIT_ENV] = previous

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingSend:
        """Start sending a contiguous CPU tensor to ``peer`` under ``tag``; wait on the result before reusing it."""
        try:
            work = self._group.send([tensor], peer, tag)
        except RuntimeError as error:
            raise PeerLostError.from_gloo(peer, error) from error
        return PendingSend(work, tensor, peer)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Receive into ``tensor`` (exactly its size) from ``peer`` under ``tag``; blocks until it arrives.

        Raises:
            PeerLostError: when ``peer`` closed its connection (for instance, it was killed).
        """
        try:
            self._group.recv([tensor], peer, tag).wait()
        except RuntimeError as error:
            raise PeerLostError.from_gloo(peer, error) from error


def arrive_and_wait(store: dist.Store, key: str, parties: int, timeout_s: float | None, who: str, ranks: int = 1) -> None:
    """Count this process's ``ranks`` in under ``key`` and wait until ``parties`` have arrived (a store-only barrier).

    Building a gloo group blocks inside C++ until every party is there; counting in first turns a party that never
    comes into a clear error after ``timeout_s`` (None waits for ever, as a dedicated server does for its workers).
    """
    store.add(key, ranks)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 0.001
    while True:
        arrived = store.add(key, 0)
        if arrived >= parties:
            return
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(
                f"shoal.ps: {who} waited {timeout_s:.0f} s for the parameter-server group, but only {arrived} of "
                f"{parties} parties arrived (are the servers running, and do all workers use comm='ps'?)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def connect_job_store(addr: str, port: int, secret: str | None, timeout_s: float) -> dist.Store:
    """A client of the job's rendezvous store (hosted by shoalrun), scoped to the job's parameter-server keys.

    Dedicated servers are not Horovod ranks, so they reach the store with the same address, port and secret that
    workers get; workers use the same scope for the same group.
    """
    return store_module.connect_job_store(addr, port, secret, timeout_s, prefix=f"{store_module.secret_namespace(secret)}/ps/")
