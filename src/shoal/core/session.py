"""The torch front end's session: one per ``init()``, holding the engine, the open handles and the name counters.

Everything that ``shutdown()`` must forget lives in the one ``Session`` that ``init()`` creates (STYLE habit 13):
the engine, the handles not yet synchronized, the counters behind ``<op>.noname.<n>`` names and process-set
registrations. A re-init (``shutdown()``/``init()``, or an elastic re-form, which is the same two calls) starts a
new session, so survivors and newcomers count unnamed requests from zero alike and name them the same way.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.comm.shm import job_token
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine, EngineStoppedError
from shoal.engine.request import Request, RequestMeta
from shoal.exceptions import NotInitializedError
from shoal.runtime import context
from shoal.runtime.elastic_rendezvous import is_elastic_worker, round_connect_timeout

_session_ids = itertools.count(1)
_handle_ids = itertools.count(1)
"""Handles are numbered across sessions, so that a handle from before a re-init is never mistaken for a new one."""


@dataclass
class _HandleEntry:
    requests: list[Request]
    finish: Callable[[list[Any]], Any]


@dataclass
class Session:
    """What one ``init()`` established for the torch API; ``shutdown()`` drops it whole."""

    engine: Engine
    id: int = field(default_factory=lambda: next(_session_ids))
    """Stamped on process sets registered in this session, so that a stale one is recognised."""
    handles: dict[int, _HandleEntry] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _counters: dict[tuple[str, int], itertools.count[int]] = field(default_factory=dict)
    metas: dict[tuple[Any, ...], RequestMeta] = field(default_factory=dict)
    """Checked request metadata by what it was made from (``requests.build_meta``): a repeating call builds and
    checks its metadata once per session."""

    def next_number(self, kind: str, process_set: int) -> int:
        """The next number of an unnamed request of ``kind`` on ``process_set``: 0, 1, 2, ... per session."""
        with self.lock:
            counter = self._counters.setdefault((kind, process_set), itertools.count())
            return next(counter)

    def new_handle(self, entry: _HandleEntry) -> int:
        with self.lock:
            handle = next(_handle_ids)
            self.handles[handle] = entry
            return handle


_PART = "torch.session"
"""This module's part of the process context."""


def _start_session(ctx: context.Context) -> None:
    # An elastic worker's callers never wait inside a collective themselves: a round that loses a member for good
    # then fails their requests at once (``Engine.abandon``), whichever thread the collective blocks.
    # Its groups wait for a member's connection only briefly (the round's members are all running; one that died
    # while the round formed never connects, and the worker then joins the next round instead).
    callers_drive, connect_timeout_s = not is_elastic_worker(), round_connect_timeout()
    config = EngineConfig.from_env()
    engine = Engine(ctx.topology, config, ctx.store, job_token(ctx.launch.secret), callers_drive, connect_timeout_s)
    ctx.set_part(_PART, Session(engine))


def _end_session() -> bool:
    """Stop the engine and fail whatever was still outstanding; False if the engine thread would not stop."""
    ctx = context.peek()
    session: Session | None = ctx.parts.pop(_PART, None) if ctx is not None else None
    if session is None:
        return True
    stopped = session.engine.stop()
    with session.lock:
        entries = list(session.handles.values())
        session.handles.clear()
    for entry in entries:
        for request in entry.requests:
            if not request.done.is_set():
                request.fail(EngineStoppedError("Shoal was shut down before this request completed"))
    return stopped


def _abandon_session(ctx: context.Context, message: str) -> bool:
    """``ctx``'s job can no longer complete a collective: fail its pending requests now (``Engine.abandon``); False
    while its session is not started yet."""
    session: Session | None = ctx.parts.get(_PART)
    if session is None:
        return False
    session.engine.abandon(message)
    return True


context.register_init_hook(_start_session)
context.register_shutdown_hook(_end_session)
context.register_abandon_hook(_abandon_session)


def session() -> Session:
    """The current session; raises Horovod's ValueError when init() was not called."""
    current: Session | None = context.current().part(_PART)
    if current is None:
        raise NotInitializedError("Shoal has not been initialized; use shoal.torch.init() (hvd.init()).")
    return current


def current_session() -> Session | None:
    """The current session, or None outside init()/shutdown() (never raises)."""
    ctx = context.peek()
    return None if ctx is None else ctx.part(_PART)


def engine() -> Engine:
    """The running engine; raises Horovod's ValueError when init() was not called."""
    return session().engine


def submit(requests: list[Request], finish: Callable[[list[Any]], Any], blocking: bool = False) -> int:
    """Queue requests as one handle; ``finish`` turns their results into what ``synchronize`` returns.

    The engine validates the requests on this thread: a bad one raises here and nothing is queued. ``blocking``:
    the caller synchronizes at once, and runs the engine's cycles itself if no other thread is (``Engine.drive``).
    """
    current = session()
    current.engine.submit(requests, wake=not blocking)
    return current.new_handle(_HandleEntry(requests, finish))


def _entry(handle: int) -> _HandleEntry:
    current = session()
    with current.lock:
        entry = current.handles.get(handle)
    if entry is None:
        raise ValueError(f"handle {handle} is unknown or was already synchronized")
    return entry


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished, so that ``synchronize`` will not block."""
    if callable(handle):
        return True
    return all(request.done.is_set() for request in _entry(handle).requests)


def synchronize(handle: int | Callable[[], Any]) -> Any:
    """Wait for the operation behind ``handle`` and return its result; raises the operation's error if it failed.

    A callable handle (what ``sparse_allreduce_async`` returns, as in Horovod) is called.
    """
    if callable(handle):
        return handle()
    current = session()
    entry = _entry(handle)
    current.engine.drive(entry.requests)
    for request in entry.requests:
        request.done.wait()
    with current.lock:
        current.handles.pop(handle, None)
    for request in entry.requests:
        if request.error is not None:
            raise request.error
    return entry.finish([request.result for request in entry.requests])


def discard(handle: int) -> None:
    """Forget a handle whose result is no longer wanted (elastic training drops a failed step's handles)."""
    current = current_session()
    if current is not None:
        with current.lock:
            current.handles.pop(handle, None)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording the engine timeline to ``file_path`` (Chrome trace / Perfetto JSON)."""
    engine().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    engine().stop_timeline()
