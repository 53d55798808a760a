"""Preemption notices: ``--preemption-signals`` and ``--preemption-grace-seconds`` as flags and settings (the end to
end behaviour, a worker leaving at a commit, is in tests/test_elastic.py)."""

from __future__ import annotations

import signal

import pytest

from shoal.config.worker import parse_signal_names
from shoal.runner.cli import parse_args

pytestmark = pytest.mark.check

ELASTIC = ["-np", "2", "--min-np", "1"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("SIGTERM", (signal.SIGTERM,)),
        ("term, usr1", (signal.SIGTERM, signal.SIGUSR1)),
        (f"{int(signal.SIGUSR2)},SIGUSR2", (signal.SIGUSR2,)),
        ("none", ()),
        ("", ()),
    ],
)
def test_signal_names_numbers_and_none(text: str, expected: tuple[int, ...]) -> None:
    assert parse_signal_names(text) == tuple(int(s) for s in expected)


@pytest.mark.parametrize(("text", "message"), [("KILL", "SIGKILL cannot be caught"), ("SIGFOO", "'SIGFOO' is not")])
def test_a_bad_signal_is_a_clear_error(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_args([*ELASTIC, "--preemption-signals", text, "python", "x.py"])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_the_flags_reach_the_workers_only_when_given() -> None:
    config = parse_args([*ELASTIC, "--preemption-signals", "TERM,USR1", "--preemption-grace-seconds", "5", "python", "x.py"])
    env = config.worker_env()
    assert env["SHOAL_PREEMPTION_SIGNALS"] == "TERM,USR1" and float(env["SHOAL_PREEMPTION_GRACE_SECONDS"]) == 5.0
    default = parse_args([*ELASTIC, "python", "x.py"]).worker_env()
    assert "SHOAL_PREEMPTION_SIGNALS" not in default and "SHOAL_PREEMPTION_GRACE_SECONDS" not in default


@pytest.mark.parametrize("grace", ["0", "-1", "4000"])
def test_a_bad_grace_period_is_a_clear_error(grace: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args([*ELASTIC, "--preemption-grace-seconds", grace, "python", "x.py"])
    assert "--preemption-grace-seconds must be > 0 and <= 3600" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--preemption-signals", "SIGTERM"], ["--preemption-grace-seconds", "10"]])
def test_the_flags_need_an_elastic_job(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["-np", "2", *flag, "python", "x.py"])
    assert f"{flag[0]} is for elastic jobs" in capsys.readouterr().err
