"""Emulate several hosts on one machine: one network namespace per host, joined by rate-limited links.

Run (as root): ``python -m shoal.bench.netns --hosts 2 --ranks-per-host 2 --rate 1gbit -- python -m
shoal.bench.allreduce``. With ``--min-np`` the job is elastic (shoalrun's elastic driver over the emulated hosts),
and ``--fault`` injects network faults at set times after the start:

- ``cut:HOST:AT:SECONDS``: host HOST's link (``host1``, or its index) goes down AT seconds after the job starts, for
  SECONDS seconds (``forever``: it never comes back), as a pulled cable: packets are dropped, connections stay open;
- ``store:AT:SECONDS``: every emulated host loses its route to the job's store (shoalrun's, on the bridge) for
  SECONDS seconds; the hosts still reach one another;
- ``rate:AT:RATE``: every host's link is shaped to RATE from AT seconds on (a link that slows down or speeds up).

With ``--faults-on-sigusr1`` the times count from when this process gets SIGUSR1 (a test sends it once training
runs). Each fault's start and end are printed with the wall-clock time.
 Each emulated host is a network namespace with a veth link to a bridge in the root
namespace, shaped in both directions by ``tc tbf`` at ``--rate``. The command runs under shoalrun's job machinery
with ``--ranks-per-host`` ranks in each namespace, each host under its own host name, so Shoal sees
several hosts (separate shared-memory segments, inter-host traffic over the shaped links). Its output is
printed, prefixed as shoalrun does. The namespaces, links and bridge are always removed at the end.

The emulated hosts share this machine's cores: unless ``OMP_NUM_THREADS`` is set, shoalrun's job gives every rank
the cores divided by all the ranks on them, not by the ranks of its own host.
"""

from __future__ import annotations

import argparse
import fcntl
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from shoal.config import LaunchConfig
from shoal.runner.forkserver import Namespace
from shoal.runner.hosts import HostSlots, assign_slots
from shoal.runner.launcher import Job
from shoal.runner.spawners import ProcessSpawner

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

    def _shape(self, prefix: list[str], device: str, verb: str = "add", rate: str | None = None) -> None:
        tbf = ["tbf", "rate", rate or self.rate, "burst", "256kb", "latency", "100ms"]
        _run(*prefix, "tc", "qdisc", verb, "dev", device, "root", *tbf)

    def reshape(self, index: int, rate: str) -> None:
        """Shape host ``index``'s link, both ways, to ``rate`` from now on."""
        self._shape([], f"{self.tag}v{index}", "change", rate)
        self._shape(["ip", "netns", "exec", self.namespace(index)], self.device(index), "change", rate)

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


@dataclass(frozen=True)
class Fault:
    """A network fault at ``at_s`` seconds after the start, lasting ``for_s`` (inf: for good)."""

    kind: str
    """``cut`` (one host's link), ``store`` (every host's route to the store) or ``rate`` (every link's rate)."""
    host: int | None
    at_s: float
    for_s: float
    rate: str | None = None
    """``rate``: the links' new rate (tc's form, ``100mbit``)."""

    def describe(self, names: list[str]) -> str:
        if self.kind == "rate":
            return f"every link's rate: {self.rate}"
        what = f"{names[self.host]}'s link" if self.kind == "cut" and self.host is not None else "the route to the store"
        return f"{what} down for {'good' if math.isinf(self.for_s) else f'{self.for_s:g} s'}"


def parse_fault(text: str, hosts: int) -> Fault:
    """``cut:HOST:AT:SECONDS`` or ``store:AT:SECONDS`` (SECONDS may be ``forever``); argparse errors when malformed."""
    parts = text.split(":")
    try:
        if parts[0] == "cut" and len(parts) == 4:
            name = parts[1].removeprefix("host")
            host = int(name)
            if not 0 <= host < hosts:
                raise argparse.ArgumentTypeError(f"--fault {text}: no host {parts[1]} among {hosts}")
            return Fault("cut", host, float(parts[2]), math.inf if parts[3] == "forever" else float(parts[3]))
        if parts[0] == "store" and len(parts) == 3:
            return Fault("store", None, float(parts[1]), math.inf if parts[2] == "forever" else float(parts[2]))
        if parts[0] == "rate" and len(parts) == 3 and parts[2]:
            return Fault("rate", None, float(parts[1]), math.inf, parts[2])
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--fault {text}: expected cut:HOST:AT:SECONDS, store:AT:SECONDS or rate:AT:RATE")


def _inject(hosts: EmulatedHosts, faults: list[Fault], names: list[str], stop: threading.Event, go: threading.Event) -> None:
    """Once ``go`` is set, apply each fault at its time and undo it after its duration; prints what it does."""
    while not go.wait(0.1):
        if stop.is_set():
            return
    start = time.monotonic()
    events: list[tuple[float, bool, Fault]] = []
    for fault in faults:
        events.append((fault.at_s, True, fault))
        if not math.isinf(fault.for_s):
            events.append((fault.at_s + fault.for_s, False, fault))
    for when, down, fault in sorted(events, key=lambda e: e[0]):
        if stop.wait(max(0.0, start + when - time.monotonic())):
            return
        targets = [fault.host] if fault.host is not None else list(range(hosts.count))
        for index in targets:
            if fault.kind == "rate":
                assert fault.rate is not None
                hosts.reshape(index, fault.rate)
            elif fault.kind == "cut":
                _run("ip", "link", "set", f"{hosts.tag}v{index}", "down" if down else "up")
            else:
                verb = "add" if down else "del"
                _run("ip", "netns", "exec", hosts.namespace(index), "ip", "route", verb, "blackhole", f"{hosts.gateway()}/32")
        state = "begins" if down else "ends"
        print(
            f"shoal.bench.netns: at {time.monotonic() - start:.1f} s: {fault.describe(names)} {state} ({time.time():.3f})",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    """Create the hosts, run the command across them, tear down; returns the command's exit code."""
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.netns", description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (network namespaces), default 2")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks in each namespace, default 1")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of every host's link, default 1gbit")
    parser.add_argument("--num-servers", type=int, default=0, help="dedicated parameter servers, spread over the hosts")
    parser.add_argument("--min-np", type=int, help="make the job elastic with this --min-np (shoalrun's meaning)")
    parser.add_argument("--elastic-timeout", type=float, default=600.0, help="elastic: shoalrun's --elastic-timeout")
    parser.add_argument(
        "--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"), help="elastic: shoalrun's flag"
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="cut:HOST:AT:SECONDS or store:AT:SECONDS (SECONDS may be 'forever'), or rate:AT:RATE; repeatable",
    )
    parser.add_argument(
        "--faults-on-sigusr1",
        action="store_true",
        help="count the faults' times from when this process gets SIGUSR1 (say, once training runs), not from the start",
    )
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
    try:
        faults = [parse_fault(text, args.hosts) for text in args.fault]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    hosts = EmulatedHosts(args.hosts, args.rate)
    stop = threading.Event()
    injector: threading.Thread | None = None
    try:
        hosts.create()
        names = [f"host{i}" for i in range(args.hosts)]
        host_slots = [HostSlots(name, args.ranks_per_host) for name in names]
        slots = assign_slots(host_slots, args.hosts * args.ranks_per_host)
        config = LaunchConfig(
            num_proc=len(slots),
            num_servers=args.num_servers,
            command=command,
            min_np=args.min_np,
            elastic_timeout=args.elastic_timeout,
            blacklist_cooldown_range=tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None,
            hosts=",".join(f"{name}:{args.ranks_per_host}" for name in names) if args.min_np else None,
        )
        try:
            config.check()
        except ValueError as error:
            parser.error(str(error))
        # Each rank starts inside its host's namespace, with gloo bound to that namespace's shaped link.
        # (A preload server, where one is named, forks each host's fork server into its namespace instead.)
        spaces = {name: Namespace(hosts.namespace(i), {"GLOO_SOCKET_IFNAME": hosts.device(i)}) for i, name in enumerate(names)}
        job: Job
        if config.elastic:
            from shoal.runner.elastic_driver import ElasticSupervisor

            supervisor = ElasticSupervisor(config, host_slots)
            job = supervisor.job_of(spawner=ProcessSpawner(namespaces=spaces), rendezvous_addr=hosts.gateway())
        else:
            job = Job(config, slots, spawner=ProcessSpawner(namespaces=spaces), rendezvous_addr=hosts.gateway())
        if faults:
            go = threading.Event()
            if args.faults_on_sigusr1:
                signal.signal(signal.SIGUSR1, lambda *_: go.set())
            else:
                go.set()
            injector = threading.Thread(target=_inject, args=(hosts, faults, names, stop, go), daemon=True)
            injector.start()
        return job.run()
    except RuntimeError as error:
        print(f"shoal.bench.netns: {error}", file=sys.stderr)
        return 1
    finally:
        stop.set()
        if injector is not None:
            injector.join(timeout=5)
        hosts.destroy()


if __name__ == "__main__":
    sys.exit(main())
