"""The optimizer's spans on the timeline's compute row (FORWARD, BACKWARD, SYNCHRONIZE, CAST, UPDATE)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from shoal.core import session as handles


class ComputeMarks:
    """The optimizer's spans on the timeline's compute row, written only while a timeline is open.

    FORWARD runs from ``zero_grad()`` (or the end of the previous ``step()``) to the first final gradient, so it
    holds data loading, the forward pass, the loss and backward up to that gradient; BACKWARD runs from the first
    final gradient to the last (the span in which reductions start, overlapping the rest of backprop);
    SYNCHRONIZE is the wait for the reduced gradients; UPDATE the local optimizer's step.
    """

    __slots__ = ("_first", "_last", "_since")

    def __init__(self) -> None:
        self._since: float | None = None
        self._first: float | None = None
        self._last = 0.0

    @staticmethod
    def _timeline() -> Any:
        current = handles.current_session()
        return None if current is None else current.engine.timeline

    def gradient(self) -> None:
        """A gradient became final."""
        timeline = self._timeline()
        if timeline is None:
            return
        now = timeline.now_us()
        if self._first is None:
            self._first = now
            if self._since is not None and self._since <= now:
                timeline.compute("FORWARD", self._since, now)
        self._last = now

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """A span named ``name`` around the block (SYNCHRONIZE first closes BACKWARD)."""
        timeline = self._timeline()
        if timeline is None:
            yield
            return
        if name == "SYNCHRONIZE" and self._first is not None:
            timeline.compute("BACKWARD", self._first, self._last)
            self._first = None
        start = timeline.now_us()
        try:
            yield
        finally:
            timeline.compute(name, start, timeline.now_us())

    def step_ended(self) -> None:
        """The step is over: FORWARD starts again from now."""
        timeline = self._timeline()
        self._since = None if timeline is None else timeline.now_us()
        self._first = None
