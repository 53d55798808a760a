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

import socket
import struct
import threading

from shoal.comm import store_wire as wire
from shoal.comm.store_client import KeyValueView, View
from shoal.comm.store_wire import StoreAuthError
from shoal.log import get_logger

_MAX_CONNECTIONS = 4096


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
    if op == wire.SET and len(fields) == 2:
        values.set(fields[0], fields[1])
        return bytes([wire.OK])
    if op == wire.GET and len(fields) == 2:
        if not values.wait_for([fields[0]], wire.read_int(fields[1]) / 1000):
            return bytes([wire.TIMEOUT])
        with values.cond:
            value = values.data.get(fields[0])
        return bytes([wire.OK]) + wire.pack_fields(value) if value is not None else bytes([wire.MISSING])
    if op == wire.ADD and len(fields) == 2:
        return bytes([wire.OK]) + wire.pack_fields(wire.int_field(values.add(fields[0], wire.read_int(fields[1]))))
    if op == wire.COMPARE_SET and len(fields) == 3:
        return bytes([wire.OK]) + wire.pack_fields(values.compare_set(*fields))
    if op == wire.CHECK and fields:
        with values.cond:
            present = all(k in values.data for k in fields)
        return bytes([wire.OK if present else wire.MISSING])
    if op == wire.WAIT and fields:
        return bytes([wire.OK if values.wait_for(fields[:-1], wire.read_int(fields[-1]) / 1000) else wire.TIMEOUT])
    if op == wire.DELETE and len(fields) == 1:
        return bytes([wire.OK if values.delete(fields[0]) else wire.MISSING])
    if op == wire.NUM_KEYS and not fields:
        with values.cond:
            return bytes([wire.OK]) + wire.pack_fields(wire.int_field(len(values.data)))
    if op == wire.APPEND and len(fields) == 2:
        values.append(fields[0], fields[1])
        return bytes([wire.OK])
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
            sock.settimeout(wire.HANDSHAKE_TIMEOUT_S)
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


class _LocalBackend:
    """Requests answered in this process, straight from an ``AuthStoreServer``'s data."""

    def __init__(self, values: _KeyValues) -> None:
        self.values = values

    def request(self, op: int, fields: list[bytes], timeout_s: float | None = None) -> tuple[int, list[bytes]]:
        reply = _apply(self.values, bytes([op]) + wire.pack_fields(*fields))
        return reply[0], wire.unpack_fields(reply[1:])
