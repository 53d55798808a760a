"""Host discovery for elastic jobs: a user script, polled, that prints the hosts available right now.

The script's contract is horovodrun's: print one ``host:slots`` line per available host (a bare ``host`` means one
slot) and exit 0. A script that fails, hangs or prints garbage does not end the job: the last good answer stands,
and the problem is reported once per distinct message.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

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


class HostDiscovery:
    """Keeps the current host list: static (``-H``/``--hostfile``/``-np``), or polled in a thread from a script (or,
    in a subclass, from a cluster manager: Ray's nodes, Spark's tasks) when ``dynamic``."""

    def __init__(
        self,
        static_hosts: list[HostSlots],
        script: str | None,
        interval_s: float = 1.0,
        default_slots: int = 1,
        dynamic: bool | None = None,
    ) -> None:
        self._hosts = list(static_hosts)
        self._script = script
        self.dynamic = script is not None if dynamic is None else dynamic
        """Whether hosts come and go (polled): an elastic job then follows them, and listens on every interface."""
        self._interval_s = interval_s
        self._default_slots = default_slots
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_error = ""
        self._thread: threading.Thread | None = None

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
        with self._lock:
            return list(self._hosts)

    def _poll_forever(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._poll_once()

    def _fetch(self) -> list[HostSlots]:
        """The current hosts (here: the discovery script's answer; shoal.ray asks Ray instead)."""
        assert self._script is not None
        return run_discovery_script(self._script, default_slots=self._default_slots)

    def _poll_once(self) -> None:
        try:
            hosts = self._fetch()
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
