"""``--blacklist-cooldown-range``: the cooldown arithmetic (Horovod's), the flag, and its checks."""

from __future__ import annotations

import math

import pytest

from shoal.runner.cli import parse_args
from shoal.runner.cooldown import HostCooldown

pytestmark = pytest.mark.check


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_cooldown_doubles_with_each_failure_within_the_range() -> None:
    clock = Clock()
    cooldown = HostCooldown((2.0, 30.0), clock=clock, uniform=lambda: 0.5)
    delays = []
    for _ in range(5):
        delays.append(cooldown.fail("a"))
        assert cooldown.excluded() == {"a"}
        clock.now += delays[-1] + 0.01
        assert cooldown.excluded() == set()
    # 2 * 2**n + 0.5 * 2, capped at 30
    assert delays == [5.0, 9.0, 17.0, 30.0, 30.0]


def test_the_lower_limit_holds_and_a_failure_while_cooling_down_changes_nothing() -> None:
    clock = Clock()
    cooldown = HostCooldown((3.0, 4.0), clock=clock, uniform=lambda: 0.0)
    assert cooldown.fail("a") == 4.0  # 3 * 2 = 6, kept within 4
    clock.now += 1.0
    assert cooldown.fail("a") == 3.0  # still cooling: the same end, not a new count
    assert cooldown.failures == {"a": 1}
    assert cooldown.describe() == "a (3 s left)"
    assert cooldown.excluded() == {"a"} and cooldown.fail("b") == 4.0 and cooldown.excluded() == {"a", "b"}


def test_without_a_range_a_failed_host_never_returns() -> None:
    clock = Clock()
    cooldown = HostCooldown(None, clock=clock)
    assert cooldown.fail("a") == math.inf
    clock.now += 1e9
    assert cooldown.excluded() == {"a"} and cooldown.describe() == "a (for the rest of the job)"


def test_the_flag_takes_min_and_max() -> None:
    config = parse_args(["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "1", "60", "python", "x.py"])
    assert config.blacklist_cooldown_range == (1.0, 60.0)
    assert parse_args(["-np", "2", "--min-np", "1", "python", "x.py"]).blacklist_cooldown_range is None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["0.5", "10"], "MIN must be >= 1"),
        (["1", "7200"], "MAX must be <= 3600"),
        (["20", "10"], "MAX (10) is smaller than MIN (20)"),
    ],
)
def test_a_bad_range_is_a_clear_error(values: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_args(["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", *values, "python", "x.py"])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_the_range_needs_an_elastic_job(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["-np", "2", "--blacklist-cooldown-range", "1", "10", "python", "x.py"])
    assert "for elastic jobs" in capsys.readouterr().err
