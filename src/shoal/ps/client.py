"""The worker's side of the parameter server: push gradients as backprop makes them, pull fresh values in step().

``PSClient`` is this process's connection to the servers (one per process and ``hvd.init()``): one receive loop
per server takes replies as they come, so pulls overlap the rest of backprop. ``PSSession`` is one
DistributedOptimizer's parameters: ``push(param)`` (from the post-accumulate-grad hook) sends the parameter's
pieces to their servers, and ``finish()`` (from ``step()``) waits for the replies and copies them into ``p.data``.

A server or worker that dies surfaces as ``ParameterServerError`` naming it, on every survivor, at the next
``step()``; nothing waits for ever.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from shoal.comm.p2p import PeerGroup, PeerLostError, PendingSend
from shoal.config import engine_setting
from shoal.log import get_logger
from shoal.ps.messages import (
    TAG_TO_SERVER,
    TAG_TO_SERVER_PAYLOAD,
    TAG_TO_WORKER,
    TAG_TO_WORKER_PAYLOAD,
    Kind,
    SessionSpec,
    empty_header,
    header,
    unpack,
)
from shoal.ps.sharding import Piece, build_shard_plan

_CLOSE_WAIT_S = 60.0


class ParameterServerError(RuntimeError):
    """A parameter server or another worker vanished; the message names which."""


class PSClient:
    """One worker's connection to every server of the job's parameter-server group."""

    def __init__(self, group: PeerGroup, worker: int, workers: int, servers: int, dedicated: bool) -> None:
        """Args:
        group: the point-to-point group; workers are ranks 0..P-1, servers P..P+S-1.
        worker: this worker's index (its rank in the group and in the Horovod world).
        workers: P.
        servers: S.
        dedicated: whether servers are separate processes (only changes how errors are worded).
        """
        self.group = group
        self.worker = worker
        self.workers = workers
        self.servers = servers
        self.dedicated = dedicated
        self.error: str | None = None
        self.cond = threading.Condition()
        self._stall_period_s = float(engine_setting("stall_check_time_s"))
        """How often a long wait for the servers is reported (the engine's stall check time)."""
        self._sessions: dict[int, PSSession] = {}
        self._next_session = 0
        self._send_locks = [threading.Lock() for _ in range(servers)]
        self._closed = False
        self._receivers = [
            threading.Thread(target=self._receive, args=(s,), name=f"shoal-ps-recv{s}", daemon=True) for s in range(servers)
        ]
        for thread in self._receivers:
            thread.start()

    def server_name(self, server: int) -> str:
        """How messages name server ``server``."""
        where = "dedicated process" if self.dedicated else f"co-located in worker {server}"
        return f"parameter server {server} (PS rank {self.workers + server}, {where})"

    # ----- sessions -----

    def open_session(self, params: list[torch.Tensor], names: list[str], spec: SessionSpec, store: Any) -> PSSession:
        """Register one optimizer's PS-managed parameters; every worker opens sessions in the same order."""
        session_id = self._next_session
        self._next_session += 1
        pieces = build_shard_plan([(p.numel(), p.element_size()) for p in params], self.servers)
        spec = replace(
            spec,
            pieces=[[q.param, q.start, q.numel, q.itemsize, q.server] for q in pieces],
            names=names,
            dtypes=[str(p.dtype).removeprefix("torch.") for p in params],
        )
        key = f"session/{session_id}"
        if self.worker == 0:
            store.set(key, spec.to_json())
        else:
            published = SessionSpec.from_json(store.get(key).decode())
            if published.pieces != spec.pieces or published.names != names:
                raise ValueError(
                    "comm='ps': worker 0 and this worker route different parameters (or shapes) through the "
                    "parameter server; every worker must build the same model and the same comm= choices"
                )
        session = PSSession(self, session_id, params, pieces)
        self._sessions[session_id] = session
        return session

    # ----- sending -----

    def send(self, server: int, message: torch.Tensor, payload: torch.Tensor | None = None) -> list[PendingSend]:
        """Send a header (and its payload) to a server, back to back; returns the sends in flight."""
        self.raise_if_failed()
        peer = self.workers + server
        try:
            with self._send_locks[server]:
                sends = [self.group.send(message, peer, TAG_TO_SERVER)]
                if payload is not None:
                    sends.append(self.group.send(payload, peer, TAG_TO_SERVER_PAYLOAD))
        except PeerLostError as error:
            self.fail(f"{self.server_name(server)} vanished: {error}")
            self.raise_if_failed()
        return sends

    def wait_sends(self, sends: list[PendingSend]) -> None:
        """Wait until these messages are out; a dead server becomes a ParameterServerError naming it."""
        for pending in sends:
            try:
                pending.wait()
            except PeerLostError as error:
                self.fail(f"{self.server_name(pending.peer - self.workers)} vanished: {error}")
        self.raise_if_failed()

    # ----- receiving -----

    def _receive(self, server: int) -> None:
        received = empty_header()
        peer = self.workers + server
        try:
            while True:
                self.group.recv(received, peer, TAG_TO_WORKER)
                kind, session_id, piece, _, _, extra = unpack(received)
                if kind == Kind.BYE_ACK:
                    return
                if kind == Kind.ERROR:
                    self.fail(f"{self.server_name(server)} stopped: worker {extra} (PS rank {extra}) vanished")
                    return
                session = self._sessions[session_id]
                self.group.recv(session.replies[piece], peer, TAG_TO_WORKER_PAYLOAD)
                session.arrived(piece)
        except PeerLostError as error:
            if not self._closed:
                self.fail(f"{self.server_name(server)} vanished: {error}")
        except Exception as error:  # a malformed message: fail loudly, or finish() would wait forever
            self.fail(f"receiving from {self.server_name(server)} failed: {error!r}")

    def wait_for_replies(self, done: Callable[[], bool], missing: Callable[[], list[int]]) -> None:
        """Wait until ``done()`` or a failure; a wait past the stall check time is reported again and again.

        A dead server fails the wait within seconds (its connection drops); a live one that is slow to answer is
        waited for, as the engine waits for a busy peer, and named in a warning every period.
        """
        period_s = self._stall_period_s
        started = time.monotonic()
        with self.cond:
            while not self.cond.wait_for(lambda: self.error is not None or done(), timeout=period_s):
                get_logger().warning(
                    "shoal.ps: worker %d has waited %.0f s for the servers' replies to pieces %s",
                    self.worker,
                    time.monotonic() - started,
                    missing()[:8],
                )

    def fail(self, message: str) -> None:
        """Record the first failure and wake everything that waits."""
        with self.cond:
            if self.error is None:
                self.error = message
                get_logger().error("shoal.ps: worker %d: %s", self.worker, message)
            self.cond.notify_all()

    def raise_if_failed(self) -> None:
        """Raise ParameterServerError when a server or worker was lost."""
        if self.error is not None:
            raise ParameterServerError(f"worker {self.worker}: {self.error}")

    def close(self) -> None:
        """Say goodbye to every server and wait for their acknowledgements (skipped after a failure)."""
        if self._closed:
            return
        self._closed = True
        if self.error is not None or exiting_on_error():
            return  # no goodbye: the servers see the connection drop and name this worker to the others
        try:
            for server in range(self.servers):
                self.wait_sends(self.send(server, header(Kind.BYE)))
        except ParameterServerError as error:
            get_logger().warning("shoal.ps: goodbye failed: %s", error)
            return
        for thread in self._receivers:
            thread.join(_CLOSE_WAIT_S)


_uncaught: list[BaseException] = []
"""Set by the excepthook installed below: the process is ending on an uncaught exception."""


def _install_excepthook() -> None:
    previous = sys.excepthook

    def record(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        _uncaught.append(value)
        previous(kind, value, traceback)

    sys.excepthook = record


_install_excepthook()


def exiting_on_error() -> bool:
    """True once an uncaught exception is ending the process (atexit then runs hvd.shutdown)."""
    return bool(_uncaught)


class PSSession:
    """One DistributedOptimizer's parameters routed through the servers."""

    def __init__(self, client: PSClient, session_id: int, params: list[torch.Tensor], pieces: list[Piece]) -> None:
        self.client = client
        self.session_id = session_id
        self.params = params
        self.index_of = {id(p): i for i, p in enumerate(params)}
        self.pieces_of: list[list[Piece]] = [[] for _ in params]
        for piece in pieces:
            self.pieces_of[piece.param].append(piece)
        self.replies = [torch.empty(q.numel, dtype=params[q.param].dtype) for q in pieces]
        self.clock = 0
        self._initialized: set[int] = set()
        self._expected: set[int] = set()
        self._arrived: set[int] = set()
        self._sends: list[PendingSend] = []

    def manages(self, param: torch.Tensor) -> bool:
        """True when ``param`` goes through the servers."""
        return id(param) in self.index_of

    def push(self, param: torch.Tensor, lr: float) -> None:
        """Send the parameter's gradient, piece by piece, to the owning servers (worker 0 first sends the values)."""
        index = self.index_of[id(param)]
        grad = param.grad
        assert grad is not None
        if grad.is_sparse:
            grad = grad.to_dense()
        # gloo's point-to-point is CPU-only: stage a CUDA gradient on the host (a copy that also frees p.grad for
        # in-place edits such as clipping while the send is in flight).
        flat_grad = grad.detach().reshape(-1)
        flat_grad = flat_grad.cpu() if flat_grad.is_cuda else flat_grad
        flat_grad = flat_grad if flat_grad.is_contiguous() else flat_grad.contiguous()
        first = index not in self._initialized and self.client.worker == 0
        self._initialized.add(index)
        flat_value = param.detach().reshape(-1).cpu() if first else None
        for piece in self.pieces_of[index]:
            span = slice(piece.start, piece.start + piece.numel)
            if flat_value is not None:
                message = header(Kind.INIT, self.session_id, piece.index)
                self._sends += self.client.send(piece.server, message, flat_value[span].clone())
            with self.client.cond:
                self._expected.add(piece.index)
            message = header(Kind.PUSH, self.session_id, piece.index, self.clock, lr)
            self._sends += self.client.send(piece.server, message, flat_grad[span])

    def arrived(self, piece: int) -> None:
        """Called by a receive loop when a piece's fresh values are in ``replies``."""
        with self.client.cond:
            self._arrived.add(piece)
            self.client.cond.notify_all()

    def wait_pushes(self) -> None:
        """Wait until this step's gradients are sent, so that ``p.grad`` may be edited (clipping) afterwards."""
        self.client.wait_sends(self._sends)
        self._sends = []

    def finish(self) -> None:
        """Wait for every reply of this step and copy the fresh values into the parameters."""
        client = self.client
        client.wait_sends(self._sends)
        self._sends = []
        client.wait_for_replies(lambda: self._expected <= self._arrived, lambda: sorted(self._expected - self._arrived))
        client.raise_if_failed()
        updated = {piece for piece in self._expected}
        for index, param in enumerate(self.params):
            pieces = [q for q in self.pieces_of[index] if q.index in updated]
            if not pieces:
                continue
            flat = param.data.reshape(-1)  # a copy when the parameter is not contiguous (channels_last)
            for piece in pieces:
                flat[piece.start : piece.start + piece.numel].copy_(self.replies[piece.index])
            if flat.data_ptr() != param.data.data_ptr() or flat.device != param.device:
                param.data.copy_(flat.view(param.shape))
        with client.cond:
            self._expected.clear()
            self._arrived.clear()
        self.clock += 1
