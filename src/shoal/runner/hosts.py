"""Host lists (``-H a:4,b:4`` or a hostfile) and the assignment of ranks to slots."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from shoal.config.worker import SlotInfo


class HostSpecError(ValueError):
    """A host list or hostfile that cannot be parsed, or that cannot hold the requested processes."""


@dataclass(frozen=True)
class HostSlots:
    """One host and how many processes it may run."""

    hostname: str
    slots: int


_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]{0,31}$")


def check_hostname(host: str, origin: str) -> str:
    """Return ``host`` when it is a safe ssh destination, else raise HostSpecError naming ``origin``.

    Accepted: an RFC 1123 host name, an IPv4 address or an IPv6 address, optionally after ``user@``. Anything
    else (a leading ``-`` that ssh would read as an option such as ``-oProxyCommand=...``, spaces, shell or path
    characters) is refused before any process starts.
    """
    user, at, name = host.rpartition("@")
    if at and not _USER.match(user):
        raise HostSpecError(f"invalid user name {user!r} in host {host!r} ({origin})")
    try:
        ipaddress.ip_address(name)
        return host
    except ValueError:
        pass
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise HostSpecError(
            f"invalid host name {host!r} in {origin}: expected an RFC 1123 host name or an IP address, optionally as user@host"
        )
    return host


def parse_host_entry(entry: str, origin: str, default_slots: int = 1) -> HostSlots:
    """Parse one ``host``, ``host:slots``, ``[ipv6]`` or ``[ipv6]:slots`` entry; ``origin`` names its source.

    A host without ``:slots`` gets ``default_slots`` (shoalrun's ``--slots-per-host``, as horovodrun's).
    """
    entry = entry.strip()
    if not entry:
        raise HostSpecError(f"empty host entry in {origin}")
    if "[" in entry:  # an IPv6 literal: [addr] or [addr]:slots, possibly after user@
        match = re.fullmatch(r"((?:[^@\[\]]+@)?)\[([0-9A-Fa-f:.]+)\](?::(.*))?", entry)
        if match is None:
            raise HostSpecError(f"cannot parse host entry {entry!r} in {origin}; expected [ipv6] or [ipv6]:slots")
        host, slots_text = match.group(1) + match.group(2), match.group(3) or ""
    else:
        if entry.count(":") > 1:
            raise HostSpecError(f"cannot parse host entry {entry!r} in {origin}; expected host or host:slots")
        host, _, slots_text = entry.partition(":")
    if not host or any(ch.isspace() for ch in host):
        raise HostSpecError(f"cannot parse host entry {entry!r} in {origin}; expected host or host:slots")
    check_hostname(host, origin)
    if not slots_text:
        return HostSlots(host, default_slots)
    try:
        slots = int(slots_text)
    except ValueError:
        raise HostSpecError(f"slots for host {host!r} in {origin} must be an integer, got {slots_text!r}") from None
    if slots < 1:
        raise HostSpecError(f"slots for host {host!r} in {origin} must be >= 1, got {slots}")
    return HostSlots(host, slots)


def _check_unique(hosts: list[HostSlots], origin: str) -> list[HostSlots]:
    seen: set[str] = set()
    for host in hosts:
        if host.hostname in seen:
            raise HostSpecError(f"host {host.hostname!r} is listed twice in {origin}")
        seen.add(host.hostname)
    return hosts


def parse_hosts(spec: str, default_slots: int = 1) -> list[HostSlots]:
    """Parse ``-H host1:slots,host2:slots`` (a host without ``:slots`` has ``default_slots``)."""
    if not spec.strip():
        raise HostSpecError("the host list (-H) is empty")
    return _check_unique([parse_host_entry(part, "-H", default_slots) for part in spec.split(",")], "-H")


def parse_hostfile(path: str, default_slots: int = 1) -> list[HostSlots]:
    """Parse a hostfile: one ``host slots=N`` or ``host:N`` per line; ``#`` starts a comment."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise HostSpecError(f"cannot read hostfile {path!r}: {error.strerror}") from None
    hosts = []
    for number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        origin = f"hostfile {path} line {number}"
        words = line.split()
        if len(words) == 2 and words[1].startswith("slots="):
            hosts.append(parse_host_entry(f"{words[0]}:{words[1][len('slots=') :]}", origin))
        elif len(words) == 1:
            hosts.append(parse_host_entry(words[0], origin, default_slots))
        else:
            raise HostSpecError(f"cannot parse {origin}: {raw_line!r}; expected 'host slots=N' or 'host:N'")
    if not hosts:
        raise HostSpecError(f"hostfile {path!r} lists no hosts")
    return _check_unique(hosts, f"hostfile {path}")


def assign_slots(hosts: list[HostSlots], num_proc: int) -> list[SlotInfo]:
    """Fill hosts in order, as horovodrun does, and compute each rank's local and cross ranks.

    Raises:
        HostSpecError: when ``num_proc`` exceeds the slots available.
    """
    total = sum(h.slots for h in hosts)
    if num_proc < 1:
        raise HostSpecError(f"-np must be >= 1, got {num_proc}")
    if num_proc > total:
        raise HostSpecError(f"-np {num_proc} is larger than the {total} slots available on the hosts given")
    hostnames: list[str] = []
    remaining = num_proc
    for host in hosts:
        used = min(host.slots, remaining)
        hostnames += [host.hostname] * used
        remaining -= used
    return place_ranks(hostnames)


def place_ranks(hostnames: list[str]) -> list[SlotInfo]:
    """Each rank's place when rank r runs on ``hostnames[r]``: local ranks count up per host in rank order; the
    cross rank of local rank L indexes the hosts (in order of first appearance) that have a local rank L."""
    counts: dict[str, int] = {}
    for hostname in hostnames:
        counts[hostname] = counts.get(hostname, 0) + 1
    hosts_in_order = list(counts)
    next_local: dict[str, int] = {}
    slots = []
    for rank, hostname in enumerate(hostnames):
        local_rank = next_local.get(hostname, 0)
        next_local[hostname] = local_rank + 1
        cross_hosts = [h for h in hosts_in_order if counts[h] > local_rank]
        slots.append(
            SlotInfo(
                hostname=hostname,
                rank=rank,
                size=len(hostnames),
                local_rank=local_rank,
                local_size=counts[hostname],
                cross_rank=cross_hosts.index(hostname),
                cross_size=len(cross_hosts),
            )
        )
    return slots


def is_local_host(hostname: str) -> bool:
    """True when ``hostname`` names this machine (so its workers are spawned directly, not over ssh)."""
    if hostname in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        return False
    if address == "127.0.0.1":
        return True
    try:
        own = set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        own = set()
    return address in own
