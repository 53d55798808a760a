"""Host discovery for elastic jobs: a source of the hosts available right now, polled.

``HostDiscovery`` keeps the host list; its source is a callable: a user's script (``script_source``), Ray's nodes
(``shoal.ray``), Spark's slots (``shoal.spark``). The script's contract is horovodrun's: print one ``host:slots``
line per available host (a bare ``host`` means one slot) and exit 0. A script that fails, hangs or prints garbage
does not end the job: the last good answer stands, and the problem is reported once per distinct message.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from shoal.runner.hosts import HostSlots, HostSpecError, parse_host_entry

SCRIPT_TIMEOUT_S = 10.0


def run_discovery_script(script: str, timeout_s: float = SCRIPT_TIMEOUT_S, default_slots: int = 1) -> list[HostSlots]:
    """Run the discovery script once and parse its output.

    Raises:
        HostSpecError: the script failed, timed out, or printed a line that is not ``host[:slots]``.
    """
    try:
        result = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise HostSpecError(f"host discovery script {script!r} did not finish within {timeout_s:.0f} s") from None
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise HostSpecError(f"host discovery script {script!r} exited with code {result.returncode}: {detail[0]}")
    hosts: dict[str, HostSlots] = {}
    for line in result.stdout.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            entry = parse_host_entry(line, f"the output of {script!r}", default_slots)
            hosts[entry.hostname] = entry  # a host printed twice: the last line wins
    return list(hosts.values())


def progress_period(timeout_s: float) -> float:
    """How often a waiting elastic driver says what it waits for: every 10 s, or three times within a short timeout."""
    return max(1.0, min(10.0, timeout_s / 3))


HostSource = Callable[[], list[HostSlots]]
"""The hosts available now; a ``HostSpecError`` keeps the previous answer (reported once per distinct message)."""


def script_source(script: str, default_slots: int = 1) -> HostSource:
    """A user's discovery script as a source (``run_discovery_script``)."""
    return functools.partial(run_discovery_script, script, default_slots=default_slots)


class HostDiscovery:
    """Keeps the current host list: static (``-H``/``--hostfile``/``-np``), or polled in a thread from ``source`` (a
    script, or a cluster manager: Ray's nodes, Spark's tasks), which makes it ``dynamic``. ``live``: where the source
    knows losses sooner than its next poll (Spark's slots), the hosts read from it at every ``hosts()``."""

    def __init__(
        self,
        static_hosts: list[HostSlots],
        source: HostSource | None = None,
        interval_s: float = 1.0,
        live: HostSource | None = None,
    ) -> None:
        self._hosts = list(static_hosts)
        self._source = source
        self._live = live
        self.dynamic = source is not None
        """Whether hosts come and go (polled): an elastic job then follows them, and listens on every interface."""
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_error = ""
        self._thread: threading.Thread | None = None

    @classmethod
    def of_script(cls, static_hosts: list[HostSlots], script: str | None, default_slots: int = 1) -> HostDiscovery:
        """shoalrun's discovery: the static hosts, or those ``script`` prints (polled) where one is given."""
        return cls(static_hosts, script_source(script, default_slots) if script else None)

    def start(self) -> None:
        """Run the script once now (so the first answer is known), then keep polling in the background."""
        if not self.dynamic:
            return
        self._poll_once()
        self._thread = threading.Thread(target=self._poll_forever, name="shoalrun-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()

    def hosts(self) -> list[HostSlots]:
        """The latest known hosts."""
        if self._live is not None:
            return self._live()
        with self._lock:
            return list(self._hosts)

    def _poll_forever(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._poll_once()

    def _poll_once(self) -> None:
        assert self._source is not None
        try:
            hosts = self._source()
        except HostSpecError as error:
            if str(error) != self._last_error:
                print(f"shoalrun: warning: {error}; keeping the previous host list", file=sys.stderr, flush=True)
                self._last_error = str(error)
            return
        self._last_error = ""
        with self._lock:
            self._hosts = hosts

    def wait_for_slots(self, needed: int, timeout_s: float, excluded: set[str]) -> bool:
        """Wait until the hosts (minus ``excluded``) offer ``needed`` slots; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        said = time.monotonic()
        while True:
            offered = sum(h.slots for h in self.hosts() if h.hostname not in excluded)
            if offered >= needed:
                return True
            now = time.monotonic()
            if now >= deadline or not self.dynamic:
                return False
            if now - said >= progress_period(timeout_s):
                said = now
                print(
                    f"shoalrun: host discovery offers {offered} of the {needed} slots needed; waiting "
                    f"{deadline - now:.0f} s more",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.1)
