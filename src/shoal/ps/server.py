"""A parameter-server shard: owns some pieces of the parameters, applies pushed gradients, answers pulls.

One thread per worker receives that worker's messages (gloo notices a dead peer only on a receive that names it, so
each worker gets its own receive loop). A push is applied under its piece's lock according to the session's
consistency model, and the replies it releases are sent from the same thread, header and payload back to back
under the destination's send lock. When a worker vanishes, every other worker is told which one (an ERROR header),
and the server stops: nobody waits for a gradient that will never come.

Run as a dedicated process with ``python -m shoal.ps.server`` (``shoalrun --num-servers S`` does this; the
environment contract is in ``shoal.ps.launch``), or as a thread inside each worker (co-located, see ``client``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import torch

from shoal.comm.p2p import PeerGroup, PeerLostError, arrive_and_wait, connect_job_store
from shoal.config import JobAddress, ServerIdentity, env_name, worker_setting
from shoal.log import get_logger
from shoal.ps.consistency import PieceClocks, PullRecorder
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
from shoal.ps.optimizers import apply_update, build_server_optimizer


class WorkerLostError(RuntimeError):
    """A worker vanished (its connection closed without a goodbye), so this server stopped."""


class _PieceState:
    """One piece on this server: its values, its optimizer, and its consistency state."""

    __slots__ = ("arrived", "clocks", "cond", "grads", "index", "initialized", "optimizer", "sum", "value", "version")

    def __init__(
        self, index: int, numel: int, dtype: torch.dtype, optimizer_name: str, hyper: dict[str, Any], workers: int
    ) -> None:
        self.index = index
        self.value = torch.zeros(numel, dtype=dtype)
        self.optimizer = build_server_optimizer(optimizer_name, hyper, self.value)
        self.cond = threading.Condition()
        self.initialized = False
        self.clocks = PieceClocks(workers)
        self.grads: list[torch.Tensor | None] = [None] * workers
        self.sum = torch.zeros(numel, dtype=dtype)
        self.arrived: set[int] = set()
        self.version = 0


class _Session:
    """One DistributedOptimizer's parameters on this server (pieces it owns), as described by worker 0's spec."""

    def __init__(self, spec: SessionSpec, server_index: int, workers: int) -> None:
        self.mode = spec.mode
        self.staleness = spec.staleness
        self.average = spec.average
        self.pieces: dict[int, _PieceState] = {}
        for index, (param, _start, numel, _itemsize, server) in enumerate(spec.pieces):
            if server == server_index:
                dtype = getattr(torch, spec.dtypes[param])
                hyper = spec.groups[spec.param_groups[param]]
                self.pieces[index] = _PieceState(index, numel, dtype, spec.optimizer, hyper, workers)


class ShardServer:
    """Serves this shard to every worker until all of them said goodbye (or one vanished)."""

    def __init__(
        self, group: PeerGroup, workers: int, server_index: int, store: Any, recorder: PullRecorder | None = None
    ) -> None:
        """Args:
        group: the point-to-point group; workers are ranks 0..P-1, this server is ``group.rank``.
        workers: P.
        server_index: this server's index (0..S-1), as the shard plan names servers.
        store: the store where worker 0 publishes each session's spec (``session/<id>``).
        recorder: notes (worker, clock, slowest clock) at every pull served.
        """
        self.group = group
        self.workers = workers
        self.server_index = server_index
        self.store = store
        self.recorder = recorder if recorder is not None else PullRecorder()
        self._sessions: dict[int, _Session] = {}
        self._sessions_lock = threading.Lock()
        self._send_locks = [threading.Lock() for _ in range(workers)]
        self._retired: set[int] = set()
        self._failure: str | None = None
        self._state_lock = threading.Lock()
        self._finished = threading.Event()
        self._running = workers

    @property
    def name(self) -> str:
        """How messages name this server."""
        return f"parameter server {self.server_index} (PS rank {self.group.rank})"

    def serve(self) -> None:
        """Block until every worker said goodbye.

        Raises:
            WorkerLostError: a worker vanished; every other worker was told which one.
        """
        for worker in range(self.workers):
            threading.Thread(
                target=self._handle, args=(worker,), name=f"shoal-ps{self.server_index}-w{worker}", daemon=True
            ).start()
        self._finished.wait()
        if self._failure is not None:
            raise WorkerLostError(self._failure)

    # ----- receiving -----

    def _handle(self, worker: int) -> None:
        received = empty_header()
        try:
            while self._failure is None:
                self.group.recv(received, worker, TAG_TO_SERVER)
                kind, session_id, piece, clock, lr, _ = unpack(received)
                if kind == Kind.BYE:
                    self._retire(worker)
                    self._send(worker, header(Kind.BYE_ACK))
                    break
                state = self._session(session_id).pieces[piece]
                if kind == Kind.INIT:
                    values = torch.empty_like(state.value)
                    self.group.recv(values, worker, TAG_TO_SERVER_PAYLOAD)
                    with state.cond:
                        state.value.copy_(values)
                        state.initialized = True
                        state.cond.notify_all()
                elif kind == Kind.PUSH:
                    grad = state.grads[worker]
                    if grad is None:
                        grad = state.grads[worker] = torch.empty_like(state.value)
                    self.group.recv(grad, worker, TAG_TO_SERVER_PAYLOAD)
                    self._apply(self._session(session_id), session_id, state, worker, clock, lr, grad)
                else:
                    raise ValueError(f"{self.name}: unexpected message {kind.name} from worker {worker}")
        except PeerLostError as error:
            self._lose(worker, f"worker {worker} (PS rank {worker}) vanished: {error}")
        except Exception as error:  # a bug or a bad message: stop loudly rather than leave workers waiting
            self._lose(worker, f"{self.name} failed handling worker {worker}: {type(error).__name__}: {error}")
        finally:
            with self._state_lock:
                self._running -= 1
                if self._running == 0:
                    self._finished.set()

    def _session(self, session_id: int) -> _Session:
        with self._sessions_lock:
            session = self._sessions.get(session_id)
            if session is None:
                spec = SessionSpec.from_json(self.store.get(f"session/{session_id}").decode())
                session = self._sessions[session_id] = _Session(spec, self.server_index, self.workers)
            return session

    # ----- applying -----

    def _apply(
        self, session: _Session, session_id: int, state: _PieceState, worker: int, clock: int, lr: float, grad: torch.Tensor
    ) -> None:
        with state.cond:
            state.cond.wait_for(lambda: state.initialized or self._failure is not None)
            if self._failure is not None:
                return
            if session.mode == "bsp":
                if state.arrived:
                    state.sum.add_(grad)
                else:
                    state.sum.copy_(grad)
                state.arrived.add(worker)
                state.clocks.advance(worker, clock)
                self._finish_bsp_round(session, session_id, state, lr)
                return
            if session.average:
                grad.div_(self.workers)  # each of the P gradients of a step counts 1/P, as in the average
            apply_update(state.optimizer, state.value, grad, lr)
            state.version += 1
            state.clocks.advance(worker, clock)
            state.clocks.pending.append((worker, clock + 1))
            self._serve_pending(session, session_id, state)

    def _finish_bsp_round(self, session: _Session, session_id: int, state: _PieceState, lr: float | None) -> None:
        """Once every worker still here pushed this step's gradient: one averaged update, then reply to all."""
        expected = set(range(self.workers)) - self._retired
        if not state.arrived or not expected <= state.arrived:
            return
        if session.average:
            state.sum.div_(len(state.arrived))
        rate = lr if lr is not None else state.optimizer.param_groups[0]["lr"]
        apply_update(state.optimizer, state.value, state.sum, rate)
        state.version += 1
        for worker in sorted(state.arrived):
            self._reply(session_id, state, worker, state.version, state.clocks.slowest)
        state.arrived.clear()

    def _serve_pending(self, session: _Session, session_id: int, state: _PieceState) -> None:
        staleness = session.staleness if session.mode == "ssp" else None
        slowest = state.clocks.slowest
        for worker, clock in state.clocks.take_servable(staleness):
            self._reply(session_id, state, worker, clock, slowest)

    def _reply(self, session_id: int, state: _PieceState, worker: int, clock: int, slowest: float) -> None:
        self.recorder.record(worker, clock, slowest)
        try:
            self._send(worker, header(Kind.REPLY, session_id, state.index, clock), state.value)
        except PeerLostError:
            pass  # that worker's own receive loop reports it

    def _send(self, worker: int, message: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        with self._send_locks[worker]:
            sends = [self.group.send(message, worker, TAG_TO_WORKER)]
            if payload is not None:
                sends.append(self.group.send(payload, worker, TAG_TO_WORKER_PAYLOAD))
            for pending in sends:
                pending.wait()

    # ----- leaving -----

    def _retire(self, worker: int) -> None:
        """A goodbye: the worker no longer holds back BSP rounds or SSP pulls of the others."""
        with self._state_lock:
            self._retired.add(worker)
        with self._sessions_lock:
            sessions = list(self._sessions.items())
        for session_id, session in sessions:
            for state in session.pieces.values():
                with state.cond:
                    state.clocks.retire(worker)
                    if session.mode == "bsp":
                        self._finish_bsp_round(session, session_id, state, None)
                    else:
                        self._serve_pending(session, session_id, state)

    def _lose(self, worker: int, message: str) -> None:
        with self._state_lock:
            if worker in self._retired or self._failure is not None:
                return
            self._failure = message
        get_logger().error("%s: %s", self.name, message)
        for other in range(self.workers):
            if other != worker and other not in self._retired:
                try:
                    self._send(other, header(Kind.ERROR, extra=worker))
                except PeerLostError:
                    pass
        with self._sessions_lock:
            states = [s for session in self._sessions.values() for s in session.pieces.values()]
        for state in states:
            with state.cond:
                state.cond.notify_all()
        self._finished.set()


def main() -> None:
    """``python -m shoal.ps.server``: serve one shard as a dedicated process (environment: ``shoal.ps.launch``)."""
    identity = ServerIdentity.from_env(os.environ)
    if identity is None:
        sys.exit(f"shoal.ps.server: {env_name('PS_ROLE')}=server is not set; shoalrun --num-servers starts this module")
    index, servers, workers = identity.index, identity.num_servers, identity.num_workers
    if not 0 <= index < servers or workers < 1:
        sys.exit(
            f"shoal.ps.server: bad environment: {env_name('PS_SERVER_INDEX')}={index} {env_name('NUM_SERVERS')}={servers} "
            f"{env_name('PS_NUM_WORKERS')}={workers}"
        )
    address = JobAddress.from_env(os.environ)
    if address is None:
        sys.exit(
            f"shoal.ps.server: {env_name('RENDEZVOUS_ADDR')} and {env_name('RENDEZVOUS_PORT')} are not both set; "
            "shoalrun --num-servers starts this module"
        )
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the launcher ends an idle server when the job ends
    torch.set_num_threads(1)
    timeout_s = worker_setting("start_timeout")
    store = connect_job_store(address.addr, address.port, address.secret, timeout_s)
    server = build_dedicated_server(store, workers, servers, index)
    try:
        server.serve()
    except WorkerLostError as error:
        print(f"shoal.ps.server: {server.name}: {error}", file=sys.stderr, flush=True)
        os._exit(1)  # other workers' receive loops may still block inside gloo; do not wait for them
    print(f"shoal.ps.server: {server.name}: every worker said goodbye", flush=True)
    os._exit(0)


def build_dedicated_server(
    store: Any, workers: int, servers: int, index: int, recorder: PullRecorder | None = None
) -> ShardServer:
    """Join the job's parameter-server group as server ``index`` (waits, unbounded, for the workers to come)."""
    group = PeerGroup(store, workers + index, workers + servers)
    arrive_and_wait(store, "arrived", workers + servers, None, f"parameter server {index}")
    return ShardServer(group, workers, index, store, recorder)


if __name__ == "__main__":
    main()
