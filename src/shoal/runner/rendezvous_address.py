"""The address remote workers use to reach shoalrun's rendezvous store."""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_address(interface: str) -> str:
    """IPv4 address of a network interface such as ``eth0``.

    Raises:
        ValueError: when the interface does not exist or has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            raise ValueError(f"network interface {interface!r} does not exist or has no IPv4 address") from None
    return socket.inet_ntoa(packed[20:24])


def route_source_address(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return str(probe.getsockname()[0])


def pick_rendezvous_address(remote_hosts: list[str], network_interface: str | None) -> str:
    """Loopback for an all-local job; otherwise the named interface's address, or the route toward the hosts."""
    if network_interface:
        first = network_interface.split(",")[0].strip()
        return interface_address(first)
    if not remote_hosts:
        return "127.0.0.1"
    try:
        return route_source_address(remote_hosts[0])
    except OSError as error:
        raise ValueError(f"cannot find a local address that reaches host {remote_hosts[0]!r}: {error}") from None
