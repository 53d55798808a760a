"""``elastic.run``'s recovery loop alone, with the job faked: what it does when a collective fails, when a round
cannot be joined, and when membership changes."""

from __future__ import annotations

import pytest

from shoal.core import elastic
from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt


class _Recorder(elastic.State):
    """Records the calls ``run`` makes; ``restore`` needs a job, as ``ElasticSampler``'s does (it asks the size)."""

    def __init__(self, joined: list[bool]) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._joined = joined

    def save(self) -> None:
        self.calls.append("save")

    def restore(self) -> None:
        assert self._joined[0], "restore() without a job"
        self.calls.append("restore")

    def sync(self) -> None:
        self.calls.append("sync")

    def reset(self) -> None:
        self.calls.append("reset")


@pytest.mark.timeout(30)
def test_a_round_that_cannot_be_joined_is_retried_without_restoring_again(monkeypatch: pytest.MonkeyPatch) -> None:
    joined = [True]
    attempts: list[int] = []

    def fake_reset() -> None:  # the first round after the failure loses a member while forming
        attempts.append(1)
        joined[0] = False
        if len(attempts) == 1:
            raise HorovodInternalError("joining elastic round 2 failed: connection refused")
        joined[0] = True

    monkeypatch.setattr(elastic.elastic_rendezvous, "is_elastic_worker", lambda: True)
    monkeypatch.setattr(elastic, "_reset", fake_reset)
    state = _Recorder(joined)
    failures = [HorovodInternalError("peer died"), HostsUpdatedInterrupt(skip_sync=False)]

    @elastic.run
    def train(state: _Recorder) -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    assert train(state) == "done"
    # sync, the failure (restore), a failed join (nothing to restore into), a join, sync, the interrupt
    # (the commit stands), a join, sync, done.
    assert state.calls == ["sync", "restore", "reset", "sync", "reset", "sync"], state.calls
    assert len(attempts) == 3


@pytest.mark.timeout(30)
def test_outside_an_elastic_job_a_failed_collective_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic.elastic_rendezvous, "is_elastic_worker", lambda: False)

    @elastic.run
    def train(state: _Recorder) -> None:
        raise HorovodInternalError("peer died")

    with pytest.raises(HorovodInternalError):
        train(_Recorder([True]))
