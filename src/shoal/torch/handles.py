"""The engine's life (started by init, stopped by shutdown), request submission, and handles."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.comm.shm import job_token
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.request import Request
from shoal.runtime import context

_engine: Engine | None = None
_handles: dict[int, _HandleEntry] = {}
_handles_lock = threading.Lock()
_handle_ids = itertools.count(1)


@dataclass
class _HandleEntry:
    requests: list[Request]
    finish: Callable[[list[Any]], Any]


def _start_engine(ctx: context.Context) -> None:
    global _engine
    _engine = Engine(ctx.topology, EngineConfig.from_env(), ctx.store, job_token(ctx.launch.secret))


def _stop_engine() -> None:
    global _engine
    engine, _engine = _engine, None
    if engine is not None:
        engine.stop()


context.register_init_hook(_start_engine)
context.register_shutdown_hook(_stop_engine)


def engine() -> Engine:
    """The running engine; raises Horovod's ValueError when init() was not called."""
    context.current()
    if _engine is None:
        raise ValueError("Shoal has not been initialized; use shoal.torch.init() (hvd.init()).")
    return _engine


def submit(requests: list[Request], finish: Callable[[list[Any]], Any]) -> int:
    """Queue requests as one handle; ``finish`` turns their results into what ``synchronize`` returns."""
    engine().submit(requests)
    handle = next(_handle_ids)
    with _handles_lock:
        _handles[handle] = _HandleEntry(requests, finish)
    return handle


def _entry(handle: int) -> _HandleEntry:
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"handle {handle} is unknown or was already synchronized")
    return entry


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished, so that ``synchronize`` will not block."""
    return all(request.done.is_set() for request in _entry(handle).requests)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its result; raises the operation's error if it failed."""
    entry = _entry(handle)
    for request in entry.requests:
        request.done.wait()
    with _handles_lock:
        _handles.pop(handle, None)
    for request in entry.requests:
        if request.error is not None:
            raise request.error
    return entry.finish([request.result for request in entry.requests])


def discard(handle: int) -> None:
    """Forget a handle whose result is no longer wanted (elastic training drops a failed step's handles)."""
    with _handles_lock:
        _handles.pop(handle, None)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording the engine timeline to ``file_path`` (Chrome trace / Perfetto JSON)."""
    engine().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    engine().stop_timeline()
