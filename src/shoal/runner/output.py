"""Copy each worker's output to shoalrun's, one line at a time, prefixed ``[rank]<stdout>:`` as horovodrun does."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import IO, BinaryIO


class OutputPump:
    """A thread that copies one worker stream to a shared sink, prefixing every line.

    Lines from different ranks never interleave mid-line: each whole line is written under one lock.
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
    ) -> None:
        self._source = source
        self._sink = sink
        self._sink_lock = sink_lock
        self._prefix = f"[{rank}]<{stream_name}>:".encode()
        self._log_path = log_path
        self._timestamp = timestamp
        """Put the arrival time before the prefix, as horovodrun --prefix-output-with-timestamp does."""
        self._thread = threading.Thread(target=self._run, name=f"shoalrun-{stream_name}-{rank}", daemon=True)

    def start(self) -> None:
        """Start copying."""
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait for the stream to reach its end (the worker closed it), at most ``timeout_s``."""
        self._thread.join(timeout_s)

    def _run(self) -> None:
        log = self._log_path.open("wb") if self._log_path is not None else None
        try:
            for line in iter(self._source.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                prefix = self._prefix
                if self._timestamp:
                    prefix = time.strftime("%a %b %d %H:%M:%S %Y").encode() + b"[" + prefix[1:]
                with self._sink_lock:
                    self._sink.write(prefix + line)
                    self._sink.flush()
                if log is not None:
                    log.write(line)
                    log.flush()
        except (OSError, ValueError):  # the pipe was closed under us during shutdown
            pass
        finally:
            if log is not None:
                log.close()
