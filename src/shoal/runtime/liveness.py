"""Whether an elastic worker is still there, judged from its own heartbeat history (a phi accrual failure detector).

shoalrun's elastic driver reads every member's heartbeat counter (``shoal.runtime.heartbeat``) several times a
second. One fixed silence limit has to choose between noticing a stopped or cut-off worker late and taking a blip
for a death. Instead, each worker's detector keeps the intervals at which its counter was seen to move, and asks how
unlikely the silence so far is under them (Hayashibara et al., "The phi accrual failure detector", 2004; Akka and
Cassandra use it): phi = -log10 of the probability that the next beat comes this late or later, for a normal
distribution of the intervals with the history's mean and deviation. A worker is suspected once phi passes
``threshold``. Two settings bound it:
- ``pause_s``: a pause any worker may take without being suspected (a 2 s blip of the link, whose TCP retransmission
  then lands about 3 s into it; a short stop): it is added to the mean, as Akka's acceptable heartbeat pause.
- ``ceiling_s`` (the ``elastic_unreachable_seconds`` setting): a silence this long is a failure whatever the history.

With beats every 0.5 s and a steady history, a silent worker is suspected about ``pause_s`` + 1 s after its last beat;
a worker whose beats have come irregularly (a loaded machine) gets proportionally longer.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass

WINDOW = 200
"""Intervals kept per worker."""
MIN_STD_FRACTION = 0.2
"""The deviation is never taken below this share of the mean interval (a perfectly regular history would otherwise
suspect a beat that is a few milliseconds late)."""


@dataclass(frozen=True)
class Settings:
    """How a detector judges a silence."""

    period_s: float
    """The heartbeat's period: the expected interval before any is measured."""
    pause_s: float
    """A silence this much longer than the usual interval is still no sign of failure."""
    threshold: float
    """phi at which a worker is suspected: 8 means a silence that its history makes a one in 10^8 event."""
    ceiling_s: float
    """A silence this long is a failure, whatever the history."""

    def __post_init__(self) -> None:
        if self.period_s <= 0 or self.pause_s < 0 or self.threshold <= 0 or self.ceiling_s <= 0:
            raise ValueError(f"liveness settings must be positive: {self}")


class Detector:
    """One worker's heartbeat history, and how unlikely a silence is under it."""

    def __init__(self, settings: Settings, now: float) -> None:
        self.settings = settings
        self.last = now
        """When the counter was last seen to move."""
        self.intervals: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.excused = -math.inf
        """The last time the whole job was silent (the store's side at fault): a silence counts from then at most."""
        self._stats: tuple[float, float] | None = None
        """``mean_std()`` since the last beat (the driver asks several times a second)."""

    def silence(self, now: float) -> float:
        """Seconds since the last beat, or since the job's last outage where that is later."""
        return now - max(self.last, self.excused)

    def beat(self, now: float) -> None:
        """The worker's counter moved (seen at ``now``)."""
        self.intervals.append(now - self.last)
        self.last = now
        self._stats = None

    def mean_std(self) -> tuple[float, float]:
        """The intervals' mean and deviation (the period, and its floor share, before two are measured)."""
        if self._stats is None:
            if len(self.intervals) < 2:
                mean = self.settings.period_s
                self._stats = mean, MIN_STD_FRACTION * mean
            else:
                mean = sum(self.intervals) / len(self.intervals)
                variance = sum((x - mean) ** 2 for x in self.intervals) / (len(self.intervals) - 1)
                self._stats = mean, max(math.sqrt(variance), MIN_STD_FRACTION * mean)
        return self._stats

    def phi(self, now: float) -> float:
        """-log10 of the probability that a beat comes this late, under the history (with the allowed pause)."""
        mean, std = self.mean_std()
        z = (self.silence(now) - mean - self.settings.pause_s) / std
        tail = 0.5 * math.erfc(z / math.sqrt(2))  # P(interval > silence)
        return math.inf if tail <= 0 else -math.log10(tail)

    def suspected(self, now: float) -> bool:
        """phi has reached the threshold, or the silence the ceiling."""
        return self.silence(now) >= self.suspicion_after_s()

    def suspicion_after_s(self) -> float:
        """The silence at which this detector suspects the worker, under its history now."""
        mean, std = self.mean_std()
        # phi >= threshold  <=>  tail <= 10^-threshold  <=>  z >= the normal quantile of 1 - 10^-threshold
        z = _upper_quantile(10.0**-self.settings.threshold)
        return min(self.settings.ceiling_s, mean + self.settings.pause_s + z * std)

    def describe(self, now: float) -> str:
        mean, std = self.mean_std()
        return (
            f"silent for {self.silence(now):.1f} s where its heartbeats came every {mean:.2f} s (deviation {std:.2f} s, "
            f"{len(self.intervals)} seen; phi {min(self.phi(now), 99.0):.1f}, suspected from {self.suspicion_after_s():.1f} s)"
        )


@functools.cache
def _upper_quantile(tail: float) -> float:
    """z with P(Z > z) = ``tail`` for a standard normal Z (bisection on erfc: no SciPy)."""
    low, high = -10.0, 40.0
    for _ in range(200):
        middle = (low + high) / 2
        if 0.5 * math.erfc(middle / math.sqrt(2)) > tail:
            low = middle
        else:
            high = middle
    return high


def liveness_settings() -> Settings:
    """The detectors' settings from the worker settings (``elastic_suspect_*`` and ``elastic_unreachable_seconds``),
    for heartbeats every ``shoal.runtime.heartbeat.PERIOD_S``."""
    from shoal.config import worker_setting
    from shoal.runtime.heartbeat import PERIOD_S

    return Settings(
        PERIOD_S,
        float(worker_setting("elastic_suspect_pause_seconds")),
        float(worker_setting("elastic_suspect_phi")),
        float(worker_setting("elastic_unreachable_seconds")),
    )


class Liveness:
    """The detectors of a job's workers, fed with what shoalrun reads of their heartbeat counters."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._seen: dict[str, tuple[bytes, Detector]] = {}

    def observe(self, worker_id: str, value: bytes, now: float) -> None:
        """The worker's counter read ``value`` at ``now``: a beat where it moved (the first read starts its clock)."""
        known = self._seen.get(worker_id)
        if known is None:
            self._seen[worker_id] = (value, Detector(self.settings, now))
        elif known[0] != value:
            known[1].beat(now)
            self._seen[worker_id] = (value, known[1])

    def heard(self, worker_id: str) -> bool:
        return worker_id in self._seen

    def suspected(self, worker_ids: list[str], now: float) -> dict[str, str]:
        """Of ``worker_ids``, those heard from whose silence is now a failure, each with why. When every one of them
        is silent past its allowed pause, or suspected, the store's side is at fault (an outage, not a death):
        nobody is suspected, and each silence counts only from the last such check on (after an outage the workers'
        connections resume one by one, as their TCP retransmissions come)."""
        detectors = {w: self._seen[w][1] for w in worker_ids if w in self._seen}
        suspects = [w for w, d in detectors.items() if d.suspected(now)]
        paused = all(d.silence(now) > d.mean_std()[0] + self.settings.pause_s for d in detectors.values())
        if detectors and (paused or len(suspects) == len(detectors)):
            for detector in detectors.values():
                detector.excused = now
            return {}
        return {w: detectors[w].describe(now) for w in suspects}

    def silence(self, worker_id: str, now: float) -> float:
        """Seconds ``worker_id`` (heard from) has been silent (counted from the last outage's end at most)."""
        return self._seen[worker_id][1].silence(now)

    def forget(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)
