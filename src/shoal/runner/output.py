"""Copy each worker's output to shoalrun's as it comes, prefixed ``[rank]<stdout>:`` as horovodrun does.

A line ends at ``\\n``, and also at ``\\r``: progress bars (tqdm) redraw themselves with ``\\r``, and each redraw is
forwarded at once, prefixed like a line, so a bar moves under shoalrun instead of appearing when the worker exits.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import IO, BinaryIO

_READ_BYTES = 65536


_LINE_END = re.compile(rb"\r\n|\r|\n")


def split_segments(pending: bytes) -> tuple[list[bytes], bytes]:
    """Complete segments (each ending with ``\\n``, ``\\r`` or ``\\r\\n``) and the incomplete rest."""
    segments: list[bytes] = []
    start = 0
    for match in _LINE_END.finditer(pending):
        if match.group() == b"\r" and match.end() == len(pending):
            break  # a \r at the very end may be half of \r\n: wait for the next read
        segments.append(pending[start : match.end()])
        start = match.end()
    return segments, pending[start:]


class OutputPump:
    """A thread that copies one worker stream to a shared sink, prefixing every line and every ``\\r`` update.

    Segments from different ranks never interleave mid-segment: each is written under one lock.
    """

    def __init__(
        self,
        source: IO[bytes],
        sink: BinaryIO,
        sink_lock: threading.Lock,
        rank: int | str,
        stream_name: str,
        log_path: Path | None,
        timestamp: bool = False,
        shown: bool = True,
    ) -> None:
        self._source = source
        self._sink = sink
        self._sink_lock = sink_lock
        self._prefix = f"[{rank}]<{stream_name}>:".encode()
        self._log_path = log_path
        self._timestamp = timestamp
        """Put the arrival time before the prefix, as horovodrun --prefix-output-with-timestamp does."""
        self._shown = shown
        """False for ranks left out by --ranks-filter: their output still goes to the log file."""
        self._thread = threading.Thread(target=self._run, name=f"shoalrun-{stream_name}-{rank}", daemon=True)

    def start(self) -> None:
        """Start copying."""
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait for the stream to reach its end (the worker closed it), at most ``timeout_s``."""
        self._thread.join(timeout_s)

    def _emit(self, segment: bytes, log: BinaryIO | None) -> None:
        if self._shown:
            prefix = self._prefix
            if self._timestamp:
                prefix = time.strftime("%a %b %d %H:%M:%S %Y").encode() + prefix
            with self._sink_lock:
                self._sink.write(prefix + segment)
                self._sink.flush()
        if log is not None:
            log.write(segment)
            log.flush()

    def _run(self) -> None:
        log = self._log_path.open("wb") if self._log_path is not None else None
        pending = b""
        try:
            fd = self._source.fileno()
            while chunk := os.read(fd, _READ_BYTES):
                segments, pending = split_segments(pending + chunk)
                for segment in segments:
                    self._emit(segment, log)
            if pending:
                self._emit(pending if pending.endswith((b"\n", b"\r")) else pending + b"\n", log)
        except (OSError, ValueError):  # the pipe was closed under us during shutdown
            pass
        finally:
            if log is not None:
                log.close()
