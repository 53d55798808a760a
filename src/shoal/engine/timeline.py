"""The timeline: a Chrome-trace / Perfetto JSON file of what the engine did to every tensor.

Each rank's file starts with a ``shoal_clock`` metadata event: the Unix time (µs) of its zero, so that
``python -m shoal.timeline merge`` can put per-rank files on one clock. Rows: one per tensor (its negotiation,
with an instant mark per rank as that rank's request is seen, then the collective and its inner steps), and a
``compute`` row where ``DistributedOptimizer`` marks forward, backward, synchronize and update spans.

The file is written as a stream: ``[`` then one event per line, each followed by a comma, flushed every cycle. A
file left behind by a killed job therefore lacks only the closing ``]`` and maybe a partial last line; Chrome's
trace viewer accepts the missing bracket, and ``load_timeline`` also drops a partial line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any

COMPUTE_ROW = "compute"
"""The row name (tid 0) of the optimizer's compute markers; tensor rows start at tid 1."""


class Timeline:
    """Writes trace events for one rank: pid is the rank, each tensor gets its own row (tid)."""

    def __init__(self, path: str, rank: int, mark_cycles: bool) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self._rank = rank
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._start = time.perf_counter()
        unix_zero_us = time.time() * 1e6  # read right after the perf_counter zero: the two clocks' offset
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file: IO[str] | None = open(path, "w")
        self._file.write("[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        self._emit({"name": "shoal_clock", "ph": "M", "pid": rank, "args": {"unix_us_at_zero": unix_zero_us}})
        self._emit({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": COMPUTE_ROW}})

    def now_us(self) -> float:
        """Microseconds since this timeline started (the clock of every event in it)."""
        return (time.perf_counter() - self._start) * 1e6

    def _emit(self, event: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def _tid(self, tensor_name: str) -> int:
        tid = self._tids.get(tensor_name)
        if tid is None:
            tid = len(self._tids) + 1
            self._tids[tensor_name] = tid
            self._emit({"name": "thread_name", "ph": "M", "pid": self._rank, "tid": tid, "args": {"name": tensor_name}})
        return tid

    def begin(self, tensor_name: str, phase: str, args: dict[str, Any] | None = None, ts_us: float | None = None) -> None:
        """Open a phase on a tensor's row, now or at ``ts_us`` (on this timeline's clock) when given."""
        with self._lock:
            ts = self.now_us() if ts_us is None else ts_us
            event = {"name": phase, "ph": "B", "ts": ts, "pid": self._rank, "tid": self._tid(tensor_name)}
            if args:
                event["args"] = args
            self._emit(event)

    def end(self, tensor_name: str, phase: str, ts_us: float | None = None) -> None:
        """Close the phase most recently opened on a tensor's row, now or at ``ts_us``."""
        with self._lock:
            ts = self.now_us() if ts_us is None else ts_us
            self._emit({"name": phase, "ph": "E", "ts": ts, "pid": self._rank, "tid": self._tid(tensor_name)})

    def ready(self, tensor_name: str, ranks: list[int]) -> None:
        """Instant marks on a tensor's row: these ranks' requests for it were seen in this negotiation cycle."""
        with self._lock:
            ts, tid = self.now_us(), self._tid(tensor_name)
            for rank in ranks:
                self._emit(
                    {
                        "name": f"READY {rank}",
                        "cat": "ready",
                        "ph": "i",
                        "s": "t",
                        "ts": ts,
                        "pid": self._rank,
                        "tid": tid,
                        "args": {"rank": rank},
                    }
                )

    def compute(self, name: str, start_us: float, end_us: float) -> None:
        """A finished span on the compute row (FORWARD, BACKWARD, SYNCHRONIZE, UPDATE), times from ``now_us()``."""
        with self._lock:
            self._emit(
                {
                    "name": name,
                    "cat": "compute",
                    "ph": "X",
                    "ts": start_us,
                    "dur": max(0.0, end_us - start_us),
                    "pid": self._rank,
                    "tid": 0,
                }
            )

    def mark_cycle(self, cycle: int) -> None:
        """An instant event at the start of an engine cycle (only with cycle marking on)."""
        if self.mark_cycles:
            with self._lock:
                self._emit(
                    {
                        "name": "CYCLE_START",
                        "ph": "i",
                        "s": "p",
                        "ts": self.now_us(),
                        "pid": self._rank,
                        "args": {"cycle": cycle},
                    }
                )

    def flush(self) -> None:
        """Push buffered events to the file (called once per cycle)."""
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Finish the JSON array and close the file."""
        with self._lock:
            if self._file is not None:
                end = {"name": "timeline_end", "ph": "i", "s": "g", "ts": self.now_us(), "pid": self._rank}
                self._file.write(json.dumps(end, separators=(",", ":")) + "\n]\n")
                self._file.close()
                self._file = None


def open_timeline(path: str, rank: int, mark_cycles: bool) -> Timeline | None:
    """As in Horovod, rank 0 writes the timeline; a path containing ``{rank}`` gives every rank its own file."""
    if "{rank}" in path:
        return Timeline(path.replace("{rank}", str(rank)), rank, mark_cycles)
    return Timeline(path, rank, mark_cycles) if rank == 0 else None


def load_timeline(path: str) -> list[dict[str, Any]]:
    """Load a timeline file, complete or cut short by a killed job (an array without its closing bracket, its last
    line perhaps partial, as Chrome's and Perfetto's viewers accept); returns its events.

    Raises:
        ValueError: the file is not a trace: neither one event per line inside ``[`` nor one JSON array of events.
    """
    with open(path) as source:
        text = source.read()
    lines = [line.strip().rstrip(",") for line in text.splitlines()]
    lines = [line for line in lines if line not in ("", "]")]
    if not lines or lines[0] != "[":
        return _whole_array(path, text)
    events = []
    for number, line in enumerate(lines[1:], 2):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the partial last line of a killed writer
            raise ValueError(f"{path} is not a Shoal timeline: line {number} is not a JSON trace event") from None
        if not isinstance(event, dict):
            raise ValueError(f"{path} is not a Shoal timeline: line {number} is not a trace event object")
        events.append(event)
    return events


def _whole_array(path: str, text: str) -> list[dict[str, Any]]:
    """A trace written as one JSON array (another tool's export), else the error that the file is no trace."""
    try:
        events = json.loads(text)
    except json.JSONDecodeError:
        events = None
    if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
        raise ValueError(f"{path} is not a Shoal timeline: expected a JSON array of trace events")
    return events
