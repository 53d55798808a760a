"""The job's rendezvous store, authenticated: nobody without the job secret can read, write or list a key.

torch's ``TCPStore`` answers anyone who connects. This store keeps torch's ``Store`` semantics (gloo's address
exchange, PrefixStore and the elastic driver use it unchanged), but every connection starts with a mutual
challenge-response over the job secret and every message after it carries an HMAC-SHA256 under a per-connection
session key with a per-direction sequence number:

1. server -> client: ``SHOAL-STORE-1`` and a random 32-byte challenge;
2. client -> server: a random 32-byte nonce and HMAC(secret, "client" | challenge | nonce);
3. server -> client: HMAC(secret, "server" | challenge | nonce) (so a process squatting on the port is refused too);
4. both sides derive the session key HMAC(secret, "session" | challenge | nonce); each frame is
   ``length | payload | HMAC(key, direction | sequence | payload)``.

The secret never crosses the wire, a frame cannot be replayed, reordered or forged, and a client that fails the
handshake learns nothing (not even whether a key exists). Garbage, oversized frames and slow handshakes close that
connection only; the server and the job go on. Messages are not encrypted: keys and values (addresses, ports,
elastic assignments) are visible on the wire to someone who can watch it, as the threat model in docs/security.md says.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from shoal.comm import store_wire as wire
from shoal.comm.store_wire import StoreAuthError
from shoal.config import env_name
from shoal.log import get_logger

if TYPE_CHECKING:
    from typing_extensions import Self

_HANDSHAKE_TIMEOUT_S = 10.0
ABORT_POLL_S = 1.0
"""How often a view with an ``abort`` check asks it while waiting for keys."""
_MAX_CONNECTIONS = 4096

(_SET, _GET, _ADD, _COMPARE_SET, _CHECK, _WAIT, _DELETE, _NUM_KEYS, _APPEND) = range(1, 10)
_OK, _TIMEOUT, _MISSING, _BAD = 0, 1, 2, 3


class _KeyValues:
    """The store's data, shared by the network server and the host's in-process view."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: bytes, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def wait_for(self, keys: list[bytes], timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: all(k in self.data for k in keys), timeout=timeout_s)

    def add(self, key: bytes, delta: int) -> int:
        with self.cond:
            value = int(self.data.get(key, b"0")) + delta
            self.data[key] = str(value).encode()
            self.cond.notify_all()
            return value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        with self.cond:
            current = self.data.get(key)
            if (current is None and expected == b"") or current == expected:
                self.data[key] = desired
                self.cond.notify_all()
                return desired
            return current if current is not None else expected

    def append(self, key: bytes, value: bytes) -> None:
        with self.cond:
            self.data[key] = self.data.get(key, b"") + value
            self.cond.notify_all()

    def delete(self, key: bytes) -> bool:
        with self.cond:
            return self.data.pop(key, None) is not None


def _apply(values: _KeyValues, request: bytes) -> bytes:
    """Run one decoded request against the data and encode the reply; ValueError for a malformed request."""
    if not request:
        raise ValueError("empty request")
    op, fields = request[0], wire.unpack_fields(request[1:])
    if op == _SET and len(fields) == 2:
        values.set(fields[0], fields[1])
        return bytes([_OK])
    if op == _GET and len(fields) == 2:
        if not values.wait_for([fields[0]], wire.read_int(fields[1]) / 1000):
            return bytes([_TIMEOUT])
        with values.cond:
            value = values.data.get(fields[0])
        return bytes([_OK]) + wire.pack_fields(value) if value is not None else bytes([_MISSING])
    if op == _ADD and len(fields) == 2:
        return bytes([_OK]) + wire.pack_fields(wire.int_field(values.add(fields[0], wire.read_int(fields[1]))))
    if op == _COMPARE_SET and len(fields) == 3:
        return bytes([_OK]) + wire.pack_fields(values.compare_set(*fields))
    if op == _CHECK and fields:
        with values.cond:
            present = all(k in values.data for k in fields)
        return bytes([_OK if present else _MISSING])
    if op == _WAIT and fields:
        return bytes([_OK if values.wait_for(fields[:-1], wire.read_int(fields[-1]) / 1000) else _TIMEOUT])
    if op == _DELETE and len(fields) == 1:
        return bytes([_OK if values.delete(fields[0]) else _MISSING])
    if op == _NUM_KEYS and not fields:
        with values.cond:
            return bytes([_OK]) + wire.pack_fields(wire.int_field(len(values.data)))
    if op == _APPEND and len(fields) == 2:
        values.append(fields[0], fields[1])
        return bytes([_OK])
    raise ValueError(f"unknown or malformed request (op {op})")


class AuthStoreServer:
    """Serves the job's keys to authenticated clients, one thread per connection, until ``close()``."""

    def __init__(self, secret: str, host: str = "127.0.0.1", port: int = 0, listen_fd: int | None = None) -> None:
        if not secret:
            raise ValueError("an authenticated store needs a non-empty job secret")
        self._secret = secret.encode()
        self.values = _KeyValues()
        if listen_fd is not None:
            self._listener = socket.socket(fileno=listen_fd)
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.socket(family, socket.SOCK_STREAM)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(256)
        self.port = int(self._listener.getsockname()[1])
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.refused = 0
        """Connections that failed the handshake or sent a malformed message (for tests and logs)."""
        self._thread = threading.Thread(target=self._accept, name="shoal-store", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if len(self._connections) >= _MAX_CONNECTIONS:
                    sock.close()
                    continue
                self._connections.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="shoal-store-conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            channel = wire.server_handshake(sock, self._secret)
            sock.settimeout(None)
            while True:
                channel.send(_apply(self.values, channel.receive()))
        except (ConnectionError, OSError):
            pass  # the client went away
        except (StoreAuthError, ValueError, struct.error) as error:
            self.refused += 1
            get_logger().debug("rendezvous store: closed a connection: %s", error)
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()

    def local_view(self, timeout_s: float = 300.0, view: type[View] | None = None) -> View:
        """A view of this server's data for the hosting process itself (no socket, no handshake): plain Python by
        default (what shoalrun, which imports no torch, reads and writes), or of class ``view`` (``torch_store``'s
        ``StoreView`` for a torch ``Store``)."""
        return (view or KeyValueView)(_LocalBackend(self.values), timeout_s, server=self)  # type: ignore[return-value]

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            connections = list(self._connections)
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


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


class _LocalBackend:
    """Requests answered in this process, straight from an ``AuthStoreServer``'s data."""

    def __init__(self, values: _KeyValues) -> None:
        self.values = values

    def request(self, op: int, fields: list[bytes], timeout_s: float | None = None) -> tuple[int, list[bytes]]:
        reply = _apply(self.values, bytes([op]) + wire.pack_fields(*fields))
        return reply[0], wire.unpack_fields(reply[1:])


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
            sock.settimeout(_HANDSHAKE_TIMEOUT_S)
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
        backend: _LocalBackend | _RemoteBackend,
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
        self._request(_SET, [self._key(key), _as_bytes(value)])

    def _waiting(self, op: int, fields: list[bytes], timeout_s: float) -> tuple[int, list[bytes]]:
        """A request that waits for ``fields``' keys up to ``timeout_s``, asking ``abort`` between slices."""
        if self._abort is None:
            return self._request(op, [*fields, wire.int_field(int(timeout_s * 1000))], timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            slice_s = max(0.0, min(ABORT_POLL_S, deadline - time.monotonic()))
            status, answer = self._request(op, [*fields, wire.int_field(int(slice_s * 1000))], slice_s)
            if status != _TIMEOUT or time.monotonic() >= deadline:
                return status, answer
            reason = self._abort()
            if reason:
                names = ", ".join(k.decode(errors="replace") for k in fields)
                raise _store_error(f"stopped waiting for keys {names}: {reason}")

    def get(self, key: str) -> bytes:
        wanted = self._key(key)
        status, fields = self._waiting(_GET, [wanted], self._timeout_s)
        if status == _TIMEOUT:
            raise _timeout_error([wanted], self._timeout_s)
        if status != _OK:
            raise _store_error(f"key {key!r} vanished while being read")
        return fields[0]

    def add(self, key: str, amount: int) -> int:
        return wire.read_int(self._request(_ADD, [self._key(key), wire.int_field(int(amount))])[1][0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._request(_COMPARE_SET, [self._key(key), _as_bytes(expected), _as_bytes(desired)])[1][0]

    def append(self, key: str, value: str | bytes) -> None:
        self._request(_APPEND, [self._key(key), _as_bytes(value)])

    def check(self, keys: list[str]) -> bool:
        return self._request(_CHECK, [self._key(k) for k in keys])[0] == _OK

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = self._timeout_s if timeout is None else timeout.total_seconds()
        wanted = [self._key(k) for k in keys]
        if self._waiting(_WAIT, wanted, timeout_s)[0] != _OK:
            raise _timeout_error(wanted, timeout_s)

    def delete_key(self, key: str) -> bool:
        return self._request(_DELETE, [self._key(key)])[0] == _OK

    def num_keys(self) -> int:
        return wire.read_int(self._request(_NUM_KEYS, [])[1][0])


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
