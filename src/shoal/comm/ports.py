"""A port to announce before the store that will listen on it exists (``MASTER_PORT``, mpirun's rendezvous)."""

from __future__ import annotations

import secrets
import socket

_LOWEST = 10000
"""The lowest port chosen (well above the system services)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now and outside the kernel's ephemeral range.

    A port the kernel handed out for ``bind(0)`` is handed out again to the next ``bind(0)`` or outgoing connection
    once released, so a store started moments later may find another process there (a parallel test run found
    another job's store on it). Ports outside the ephemeral range are only ever taken by an explicit choice.

    Raises:
        RuntimeError: no free port was found in 200 tries.
    """
    low, high = _ephemeral_range()
    start, stop = (_LOWEST, low) if low - _LOWEST >= 2000 else (high + 1, 65536)
    if stop - start < 2000:  # the ephemeral range covers nearly every port: any port, as bind(0) would
        start, stop = _LOWEST, 65536
    for _ in range(200):
        port = start + secrets.randbelow(stop - start)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found on {host!r} between {start} and {stop - 1}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            low, high = (int(part) for part in ranges.read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high
