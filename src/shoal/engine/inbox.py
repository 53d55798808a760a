"""The hand-off between the threads that submit requests and the one that runs the cycle."""

from __future__ import annotations

import threading

from shoal.engine.request import Request
from shoal.exceptions import HorovodInternalError


class EngineStoppedError(HorovodInternalError):
    """The engine is no longer running (shut down, or failed); no new request can be served."""


Key = tuple[int, str]
"""A request's (process set, name): unique among outstanding requests."""


class Inbox:
    """Submitted requests not yet taken by a cycle, the names in flight, and whether the engine is stopping or
    stopped; one condition (``lock``) guards them, and the engine's record of who runs cycles too."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.queue: list[Request] = []
        self.in_flight: set[Key] = set()
        self.shutdown_requested = False
        self.stopped: BaseException | None = None
        self._sleepers = 0
        """Threads waiting in ``sleep``: a submission wakes them, and costs no notification when there are none."""

    def sleep(self, timeout_s: float) -> bool:
        """Wait on ``lock`` (held) for a submission or a notification; False when ``timeout_s`` passed first."""
        self._sleepers += 1
        try:
            return self.lock.wait(timeout_s)
        finally:
            self._sleepers -= 1

    def put(self, requests: list[Request], wake: bool) -> None:
        """Queue requests together; nothing is queued when one fails a check.

        Raises:
            ValueError: a name already in flight.
            EngineStoppedError: the engine has stopped.
        """
        keys = [(request.meta.process_set, request.meta.name) for request in requests]
        with self.lock:
            if self.stopped is not None:
                raise EngineStoppedError(f"Shoal's engine is not running: {self.stopped}")
            for request, key in zip(requests, keys, strict=True):
                if key in self.in_flight or keys.count(key) > 1:
                    raise ValueError(
                        f"a request named '{request.meta.name}' is already in flight; names of outstanding "
                        "requests must be unique (wait for it with synchronize(), or pass a different name=)"
                    )
            self.in_flight.update(keys)
            self.queue.extend(requests)
            if wake and self._sleepers:
                self.lock.notify_all()

    def take(self) -> tuple[list[Request], bool]:
        """The requests queued since the last call, and whether a shutdown was asked for."""
        with self.lock:
            new, self.queue = self.queue, []
            return new, self.shutdown_requested

    def release(self, keys: list[Key]) -> None:
        """These requests are about to complete: their names may be used again (before a waiter wakes)."""
        with self.lock:
            for key in keys:
                self.in_flight.discard(key)

    def drain(self, error: BaseException) -> list[Request]:
        """Mark the engine stopped with ``error``; returns the queued requests (to fail). Call under ``lock``."""
        self.stopped = error
        queued, self.queue = self.queue, []
        self.in_flight.clear()
        return queued
