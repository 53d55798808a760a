"""The client side of the job's authenticated store (``shoal.comm.auth_store`` serves it): ``connect`` opens
authenticated connections to it, and ``KeyValueView`` gives torch's ``Store`` interface over them (or over the
hosting process's own data), every key under a prefix."""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, TypeVar

from shoal.comm import store_wire as wire
from shoal.config import env_name

if TYPE_CHECKING:
    from typing_extensions import Self

    from shoal.comm.auth_store import AuthStoreServer

ABORT_POLL_S = 1.0
"""How often a view with an ``abort`` check asks it while waiting for keys."""


class Backend(Protocol):
    """Where a view's requests are answered: over authenticated connections, or in the hosting process."""

    def request(self, op: int, fields: list[bytes], timeout_s: float | None = None) -> tuple[int, list[bytes]]: ...


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _store_error(message: str, network: bool = False) -> RuntimeError:
    """torch's error class, as torch's own stores raise: imported only on these paths, so that a process that
    starts no collective (shoalrun) never imports torch."""
    import torch.distributed as dist

    return dist.DistNetworkError(message) if network else dist.DistStoreError(message)


def _timeout_error(keys: list[bytes], timeout_s: float) -> RuntimeError:
    names = ", ".join(k.decode(errors="replace") for k in keys)
    return _store_error(f"wait timeout after {timeout_s * 1000:.0f}ms, keys: {names}")


class _RemoteBackend:
    """Requests sent to an ``AuthStoreServer`` over authenticated connections, from a small pool.

    Each request takes an idle connection (opening and authenticating a new one when none is idle), so a blocking
    ``get`` on one thread never holds up another thread's requests.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float) -> None:
        self.host, self.port, self._secret = host, port, secret
        self._timeout_s = timeout_s
        self._idle: queue.SimpleQueue[wire.Channel] = queue.SimpleQueue()
        self._idle.put(self._connect(timeout_s))

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self, timeout_s: float) -> wire.Channel:
        """Connect and authenticate, retrying refused connections until ``timeout_s`` (the server may be starting)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as error:
                if time.monotonic() >= deadline:
                    message = f"cannot reach the rendezvous store at {self.where}: {error}"
                    raise _store_error(message, network=True) from error
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.settimeout(wire.HANDSHAKE_TIMEOUT_S)
            channel = wire.client_handshake(sock, self._secret, self.where)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return channel

    def request(self, op: int, fields: list[bytes], timeout_s: float | None = None) -> tuple[int, list[bytes]]:
        try:
            channel = self._idle.get_nowait()
        except queue.Empty:
            channel = self._connect(self._timeout_s)
        try:
            channel.sock.settimeout(None if timeout_s is None else timeout_s + 30.0)
            channel.send(bytes([op]) + wire.pack_fields(*fields))
            reply = channel.receive()
        except BaseException:
            channel.sock.close()
            raise
        self._idle.put(channel)
        if not reply:
            raise _store_error(f"empty reply from the rendezvous store at {self.where}")
        return reply[0], wire.unpack_fields(reply[1:])

    def __del__(self) -> None:
        while True:
            try:
                self._idle.get_nowait().sock.close()
            except (queue.Empty, AttributeError):
                return
            except OSError:
                continue


class KeyValueView:
    """torch's ``Store`` interface over a backend (local or remote), every key under ``prefix``, in plain Python;
    ``shoal.comm.torch_store.StoreView`` is the same class as a torch ``Store`` (which gloo takes)."""

    def __init__(
        self,
        backend: Backend,
        timeout_s: float,
        prefix: bytes = b"",
        server: AuthStoreServer | None = None,
        abort: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__()
        self._backend = backend
        self._timeout_s = timeout_s
        self._prefix = prefix
        self._views: list[KeyValueView] = []
        self.server = server
        """For the hosting process's view: the server it belongs to (``close()`` stops it)."""
        self._abort = abort
        """Asked every ``ABORT_POLL_S`` while a ``get`` or ``wait`` waits for keys: a reason stops the wait."""

    def with_prefix(self, prefix: str, abort: Callable[[], str | None] | None = None) -> Self:
        """A view of this store whose keys all live under ``prefix`` (sharing its connections), of the same class.

        ``abort``: while one of its ``get`` or ``wait`` calls waits for keys that are missing, the view asks
        ``abort()`` about once a second; a reason it returns ends the wait with ``DistStoreError`` (an elastic round
        that lost a member while forming: its peers' keys will never come). Views made from it inherit it.
        """
        view = type(self)(self._backend, self._timeout_s, self._prefix + prefix.encode(), self.server, abort or self._abort)
        self._views.append(view)
        return view

    def clone(self) -> Self:
        """Another view of the same store (torch clones a store for each thread that uses it)."""
        return self.with_prefix("")

    def close(self) -> None:
        """Stop the server, when this is the hosting process's view."""
        if self.server is not None:
            self.server.close()

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _as_bytes(key)

    def _request(self, op: int, fields: list[bytes], timeout_s: float | None = None) -> tuple[int, list[bytes]]:
        return self._backend.request(op, fields, timeout_s)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout_s)

    def set(self, key: str, value: str | bytes) -> None:
        self._request(wire.SET, [self._key(key), _as_bytes(value)])

    def _waiting(self, op: int, fields: list[bytes], timeout_s: float) -> tuple[int, list[bytes]]:
        """A request that waits for ``fields``' keys up to ``timeout_s``, asking ``abort`` between slices."""
        if self._abort is None:
            return self._request(op, [*fields, wire.int_field(int(timeout_s * 1000))], timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            slice_s = max(0.0, min(ABORT_POLL_S, deadline - time.monotonic()))
            status, answer = self._request(op, [*fields, wire.int_field(int(slice_s * 1000))], slice_s)
            if status != wire.TIMEOUT or time.monotonic() >= deadline:
                return status, answer
            reason = self._abort()
            if reason:
                names = ", ".join(k.decode(errors="replace") for k in fields)
                raise _store_error(f"stopped waiting for keys {names}: {reason}")

    def get(self, key: str) -> bytes:
        wanted = self._key(key)
        status, fields = self._waiting(wire.GET, [wanted], self._timeout_s)
        if status == wire.TIMEOUT:
            raise _timeout_error([wanted], self._timeout_s)
        if status != wire.OK:
            raise _store_error(f"key {key!r} vanished while being read")
        return fields[0]

    def add(self, key: str, amount: int) -> int:
        return wire.read_int(self._request(wire.ADD, [self._key(key), wire.int_field(int(amount))])[1][0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._request(wire.COMPARE_SET, [self._key(key), _as_bytes(expected), _as_bytes(desired)])[1][0]

    def append(self, key: str, value: str | bytes) -> None:
        self._request(wire.APPEND, [self._key(key), _as_bytes(value)])

    def check(self, keys: list[str]) -> bool:
        return self._request(wire.CHECK, [self._key(k) for k in keys])[0] == wire.OK

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = self._timeout_s if timeout is None else timeout.total_seconds()
        wanted = [self._key(k) for k in keys]
        if self._waiting(wire.WAIT, wanted, timeout_s)[0] != wire.OK:
            raise _timeout_error(wanted, timeout_s)

    def delete_key(self, key: str) -> bool:
        return self._request(wire.DELETE, [self._key(key)])[0] == wire.OK

    def num_keys(self) -> int:
        return wire.read_int(self._request(wire.NUM_KEYS, [])[1][0])


View = TypeVar("View", bound=KeyValueView)


def connect(
    host: str, port: int, secret: str, timeout_s: float = 300.0, prefix: str = "", view: type[View] | None = None
) -> View:
    """A client of the ``AuthStoreServer`` at ``host:port``, authenticated with ``secret``.

    Raises:
        StoreAuthError: the server refused this process's secret, or did not prove it holds the job secret.
        torch.distributed.DistNetworkError: nothing answered within ``timeout_s``.
    """
    if not secret:
        raise ValueError(f"an authenticated store needs the job secret ({env_name('SECRET')})")
    backend = _RemoteBackend(host, port, secret.encode(), timeout_s)
    return (view or KeyValueView)(backend, timeout_s, prefix.encode())  # type: ignore[return-value]
