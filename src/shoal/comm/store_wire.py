"""The rendezvous store's wire: the mutual challenge-response over the job secret, and the framed, MAC'd,
sequence-numbered messages after it (the protocol is in ``auth_store``'s docstring and docs/security.md)."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from shoal.config import env_name

MAGIC = b"SHOAL-STORE-1"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_FRAME_BYTES = 64 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
"""How long either side of a new connection may take over the handshake."""

(SET, GET, ADD, COMPARE_SET, CHECK, WAIT, DELETE, NUM_KEYS, APPEND) = range(1, 10)
"""A request's first byte: the operation."""
OK, TIMEOUT, MISSING, BAD = 0, 1, 2, 3
"""A reply's first byte: how it went."""


class StoreAuthError(RuntimeError):
    """The other side does not hold the job secret (or is not a Shoal store at all)."""


def sign(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``key``."""
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, count: int) -> bytes:
    """Exactly ``count`` bytes from ``sock``; a ConnectionError if it closes first."""
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def pack_fields(*fields: bytes) -> bytes:
    """Length-prefixed fields, one after another."""
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def unpack_fields(data: bytes) -> list[bytes]:
    """The fields ``pack_fields`` made; a ValueError if one is cut short."""
    fields, offset = [], 0
    while offset < len(data):
        if offset + 4 > len(data):
            raise ValueError("truncated field")
        (length,) = struct.unpack_from(">I", data, offset)
        offset += 4
        if offset + length > len(data):
            raise ValueError("truncated field")
        fields.append(data[offset : offset + length])
        offset += length
    return fields


def int_field(value: int) -> bytes:
    """An int64 as a field."""
    return struct.pack(">q", value)


def read_int(field: bytes) -> int:
    """The int64 of an ``int_field``; a ValueError if it is not one."""
    if len(field) != 8:
        raise ValueError("malformed integer field")
    return int(struct.unpack(">q", field)[0])


class Channel:
    """One authenticated connection: framed, MAC'd, sequence-numbered messages in both directions."""

    def __init__(self, sock: socket.socket, key: bytes, outgoing: bytes, incoming: bytes) -> None:
        self.sock = sock
        self._key = key
        self._out, self._in = outgoing, incoming
        self._sent = 0
        self._received = 0

    def send(self, payload: bytes) -> None:
        mac = sign(self._key, self._out, struct.pack(">Q", self._sent), payload)
        self._sent += 1
        self.sock.sendall(struct.pack(">I", len(payload)) + payload + mac)

    def receive(self) -> bytes:
        (length,) = struct.unpack(">I", recv_exact(self.sock, 4))
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {length} bytes is over the limit")
        payload = recv_exact(self.sock, length)
        mac = recv_exact(self.sock, MAC_BYTES)
        expected = sign(self._key, self._in, struct.pack(">Q", self._received), payload)
        if not hmac.compare_digest(mac, expected):
            raise StoreAuthError("a message failed authentication")
        self._received += 1
        return payload


def server_handshake(sock: socket.socket, secret: bytes) -> Channel:
    """The server's side of the handshake; a StoreAuthError if the client does not hold ``secret``."""
    challenge = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + challenge)
    nonce = recv_exact(sock, NONCE_BYTES)
    proof = recv_exact(sock, MAC_BYTES)
    if not hmac.compare_digest(proof, sign(secret, b"client", challenge, nonce)):
        raise StoreAuthError("the client does not hold the job secret")
    sock.sendall(sign(secret, b"server", challenge, nonce))
    return Channel(sock, sign(secret, b"session", challenge, nonce), b"S", b"C")


def client_handshake(sock: socket.socket, secret: bytes, where: str) -> Channel:
    """The client's side of the handshake with the store at ``where``; a StoreAuthError if either side lacks
    ``secret``."""
    try:
        magic = recv_exact(sock, len(MAGIC))
    except (ConnectionError, OSError) as error:
        raise StoreAuthError(f"the rendezvous store at {where} closed the connection: {error}") from error
    if magic != MAGIC:
        raise StoreAuthError(f"{where} is not a Shoal rendezvous store (another program holds the port?)")
    challenge = recv_exact(sock, NONCE_BYTES)
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(nonce + sign(secret, b"client", challenge, nonce))
    try:
        proof = recv_exact(sock, MAC_BYTES)
    except (ConnectionError, OSError) as error:
        raise StoreAuthError(
            f"rendezvous refused by {where}: this process's {env_name('SECRET')} does not match the job's secret"
        ) from error
    if not hmac.compare_digest(proof, sign(secret, b"server", challenge, nonce)):
        raise StoreAuthError(f"the store at {where} does not hold the job secret (another process holds the port?)")
    return Channel(sock, sign(secret, b"session", challenge, nonce), b"C", b"S")
