"""Emulate several hosts on one machine: one network namespace per host, joined by rate-limited links.

Run (as root): ``python -m shoal.bench.netns --hosts 2 --ranks-per-host 2 --rate 1gbit -- python -m
shoal.bench.allreduce``. Each emulated host is a network namespace with a veth link to a bridge in the root
namespace, shaped in both directions by ``tc tbf`` at ``--rate``. The command runs under shoalrun's job machinery
with ``--ranks-per-host`` ranks in each namespace, each host under its own host name, so Shoal sees
several hosts (separate shared-memory segments, inter-host traffic over the shaped links). Its output is
printed, prefixed as shoalrun does. The namespaces, links and bridge are always removed at the end.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from shoal.config import LaunchConfig
from shoal.runner.hosts import HostSlots, assign_slots
from shoal.runner.launcher import Job

_SUBNETS = range(77, 127)
"""The second octet of the 10.x.0.0/16 networks tried, first free first: runs at the same time each take their own."""
_LOCK = "/tmp/shoal-netns.lock"


def _used_second_octets() -> set[int]:
    """The x of every 10.x.y.z address the root namespace holds."""
    listing = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    return {int(word.split(".")[1]) for word in listing.split() if word.startswith("10.") and word.count(".") == 3}


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


@dataclass
class EmulatedHosts:
    """Namespaces ``h0..hN-1`` with addresses 10.x.0.1.., a bridge at 10.x.0.254, links shaped to ``rate``; x is the
    first of 77, 78, ... no address in the root namespace uses yet (so two runs at once never share a network)."""

    count: int
    rate: str
    tag: str = field(default_factory=lambda: f"sh{os.getpid() % 100000}")
    subnet: str = "10.77"
    created_namespaces: list[str] = field(default_factory=list)
    bridge_created: bool = False

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def namespace(self, index: int) -> str:
        return f"{self.tag}h{index}"

    def address(self, index: int) -> str:
        return f"{self.subnet}.0.{index + 1}"

    def gateway(self) -> str:
        return f"{self.subnet}.0.254"

    def _shape(self, prefix: list[str], device: str) -> None:
        _run(
            *prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"
        )

    def create(self) -> None:
        """Build the bridge, the namespaces and their shaped links."""
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self.bridge_created = True
        with open(_LOCK, "a") as lock:  # choosing a free network and taking it is one step for concurrent runs
            fcntl.flock(lock, fcntl.LOCK_EX)
            free = [x for x in _SUBNETS if x not in _used_second_octets()]
            if not free:
                raise RuntimeError(f"no free 10.x.0.0/16 network for emulated hosts among 10.{_SUBNETS[0]}-{_SUBNETS[-1]}")
            self.subnet = f"10.{free[0]}"
            _run("ip", "addr", "add", f"{self.gateway()}/16", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for index in range(self.count):
            namespace, outside, inside = self.namespace(index), f"{self.tag}v{index}", f"{self.tag}p{index}"
            _run("ip", "netns", "add", namespace)
            self.created_namespaces.append(namespace)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", namespace)
            _run("ip", "link", "set", outside, "master", self.bridge)
            _run("ip", "link", "set", outside, "up")
            within = ["ip", "netns", "exec", namespace]
            _run(*within, "ip", "link", "set", "lo", "up")
            _run(*within, "ip", "addr", "add", f"{self.address(index)}/16", "dev", inside)
            _run(*within, "ip", "link", "set", inside, "up")
            self._shape([], outside)  # traffic into the host
            self._shape(within, inside)  # traffic out of the host

    def device(self, index: int) -> str:
        """The namespace's network interface (what gloo must bind to)."""
        return f"{self.tag}p{index}"

    def destroy(self) -> None:
        """Remove everything created; deleting a namespace also deletes its veth pair."""
        for namespace in self.created_namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.created_namespaces.clear()
        if self.bridge_created:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self.bridge_created = False


def main(argv: list[str] | None = None) -> int:
    """Create the hosts, run the command across them, tear down; returns the command's exit code."""
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.netns", description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (network namespaces), default 2")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks in each namespace, default 1")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of every host's link, default 1gbit")
    parser.add_argument("--num-servers", type=int, default=0, help="dedicated parameter servers, spread over the hosts")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.hosts < 1 or args.ranks_per_host < 1:
        parser.error("--hosts and --ranks-per-host must be >= 1")
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("shoal.bench.netns: needs root and the ip and tc commands (Debian: iproute2)", file=sys.stderr)
        return 2
    hosts = EmulatedHosts(args.hosts, args.rate)
    try:
        hosts.create()
        names = [f"host{i}" for i in range(args.hosts)]
        slots = assign_slots([HostSlots(name, args.ranks_per_host) for name in names], args.hosts * args.ranks_per_host)
        config = LaunchConfig(num_proc=len(slots), num_servers=args.num_servers, command=command)
        config.check()
        # Each rank starts inside its host's namespace, with gloo bound to that namespace's shaped link.
        prefixes = {
            name: ["ip", "netns", "exec", hosts.namespace(i), "env", f"GLOO_SOCKET_IFNAME={hosts.device(i)}"]
            for i, name in enumerate(names)
        }
        return Job(config, slots, local_prefixes=prefixes, rendezvous_addr=hosts.gateway()).run()
    except RuntimeError as error:
        print(f"shoal.bench.netns: {error}", file=sys.stderr)
        return 1
    finally:
        hosts.destroy()


if __name__ == "__main__":
    sys.exit(main())
