"""The settings declarations: shoalrun's flags, the workers' environment, the config file and docs/knobs.md are all
made from the same ``knob`` fields, so one value travels the same way whichever door it comes in by."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from shoal.config import EngineConfig, LaunchConfig, WorkerSettings, from_env, knobs_table, settings
from shoal.config.worker import JobAddress, SlotInfo
from shoal.runner.cli import parse_args
from shoal.runtime.launch_env import detect_launch

pytestmark = pytest.mark.check  # the quick tier: make check

DOCS = Path(__file__).resolve().parents[1] / "docs" / "knobs.md"


def _sample(kind: type, default: Any) -> Any:
    """A valid value other than the default, for each kind of engine knob."""
    if kind is bool:
        return not default if default is not None else True
    if kind is int:
        return (default or 0) + 4096
    if kind is float:
        return (default or 0.0) + 90.0
    return "/tmp/shoal-knob-sample"


def test_docs_knobs_table_is_the_declarations() -> None:
    text = DOCS.read_text()
    start = text.index("<!-- knobs table: python -m shoal.config -->\n") + len("<!-- knobs table: python -m shoal.config -->\n")
    end = text.index("<!-- end of knobs table -->")
    assert text[start:end].rstrip("\n") == knobs_table(), "regenerate with: python -m shoal.config"


def test_every_engine_flag_reaches_the_workers_engine_config() -> None:
    flagged = [s for s in settings(EngineConfig) if s.knob.flags]
    assert len(flagged) >= 15
    for setting in flagged:
        value = _sample(setting.kind, setting.default)
        if setting.kind is bool:
            argv = list(setting.knob.flags if value else setting.knob.off_flags or setting.knob.hidden_flags)
        else:
            shown = value / setting.knob.flag_scale if setting.knob.flag_scale != 1 else value
            argv = [setting.knob.flags[0], str(shown)]
        env = parse_args([*argv, "-np", "1", "true"]).worker_env()
        assert getattr(from_env(EngineConfig, env), setting.name) == value, (setting.name, argv, env)


def test_an_engine_setting_not_given_stays_the_workers_own() -> None:
    # A switch turned off is not written either (as horovodrun): the workers' own environment decides.
    off = parse_args(["--no-autotune", "--stall-check", "--no-timeline-mark-cycles", "-np", "1", "true"]).worker_env()
    assert not {"SHOAL_AUTOTUNE", "SHOAL_STALL_CHECK_DISABLE", "SHOAL_TIMELINE_MARK_CYCLES"} & set(off)
    assert parse_args(["--no-hierarchical-allreduce", "-np", "1", "true"]).worker_env()["SHOAL_HIERARCHICAL_ALLREDUCE"] == "0"
    env = parse_args(["-np", "1", "true"]).worker_env()
    names = {s.knob.env for s in settings(EngineConfig)}
    assert not any(name.removeprefix("SHOAL_") in names for name in env)
    assert env["SHOAL_START_TIMEOUT"] == "30.0" and from_env(WorkerSettings, env).start_timeout == 30.0


def test_every_config_file_key_sets_what_its_flag_sets(tmp_path: Path) -> None:
    keyed = [(s, True) for s in settings(EngineConfig) if s.knob.config_key] + [
        (s, False) for s in settings(LaunchConfig) if s.knob.config_key
    ]
    assert len(keyed) >= 16
    for setting, engine in keyed:
        section, _, key = setting.knob.config_key.partition(".")  # type: ignore[union-attr]
        if setting.kind is bool:
            value: Any = not setting.knob.inverted  # asks for the field to be True
            expected: Any = True
        elif setting.kind is str and setting.knob.choices:
            value = expected = setting.knob.choices[1]
        else:
            expected = _sample(setting.kind, setting.default)
            value = expected / setting.knob.flag_scale if setting.kind is not str else expected
        path = tmp_path / f"{setting.name}.yaml"
        path.write_text(textwrap.dedent(f"{section}: {{{key}: {value}}}\n"))
        config = parse_args(["--config-file", str(path), "-np", "1", "true"])
        got = config.engine.get(setting.name) if engine else getattr(config, setting.name)
        assert got == expected, (setting.name, got, expected)


def test_launch_and_engine_settings_never_share_a_name() -> None:
    launch = {s.name for s in settings(LaunchConfig)}
    assert not launch & {s.name for s in settings(EngineConfig)}
    flags = [f for cls in (LaunchConfig, EngineConfig) for s in settings(cls) for f in (*s.knob.flags, *s.knob.off_flags)]
    assert len(flags) == len(set(flags))


def test_a_launch_config_built_in_python_is_checked_like_flags() -> None:
    with pytest.raises(ValueError, match="-np is required"):
        LaunchConfig(command=["true"]).check()
    with pytest.raises(ValueError, match="--max-np 1 is smaller"):
        LaunchConfig(num_proc=2, max_np=1, command=["true"]).check()
    with pytest.raises(ValueError, match="--cycle-time-ms must be >= 0"):
        LaunchConfig(num_proc=1, engine={"cycle_time_ms": -1.0}, command=["true"]).check()
    with pytest.raises(ValueError, match="stall check time"):
        LaunchConfig(num_proc=1, engine={"stall_check_time_s": 900.0}, command=["true"]).check()
    with pytest.raises(ValueError, match="unknown engine settings: cycle_time"):
        LaunchConfig(num_proc=1, engine={"cycle_time": 1.0}, command=["true"]).check()
    config = LaunchConfig(min_np=2, command=["true"])
    config.check()
    assert config.elastic and config.num_proc == 2 and config.max_np is not None


def test_a_bad_environment_value_names_its_variable() -> None:
    with pytest.raises(ValueError, match=r"SHOAL_CYCLE_TIME \(or HOROVOD_CYCLE_TIME\) must be a number, got 'fast'"):
        from_env(EngineConfig, {"SHOAL_CYCLE_TIME": "fast"})
    assert from_env(EngineConfig, {"HOROVOD_CACHE_CAPACITY": "7", "SHOAL_CACHE_CAPACITY": "9"}).cache_capacity == 9
    assert from_env(EngineConfig, {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}).hierarchical_allreduce is False
    assert from_env(EngineConfig, {}).hierarchical_allreduce is None


def test_a_workers_identity_round_trips_through_its_environment() -> None:
    slot = SlotInfo("node-b", 3, 4, 1, 2, 1, 2)
    env = slot.to_env()
    assert env["SHOAL_RANK"] == env["HOROVOD_RANK"] == "3" and env["HOROVOD_HOSTNAME"] == "node-b"
    assert SlotInfo.from_env(env) == slot and SlotInfo.from_env({}) is None
    address = JobAddress("10.0.0.1", 29500, "s3cret")
    assert JobAddress.from_env(address.to_env()) == address and JobAddress.from_env({}) is None
    launch = detect_launch({**env, **address.to_env()})
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank, launch.host_key) == ("shoalrun", 3, 4, 1, "node-b")
    assert (launch.store_addr, launch.store_port, launch.secret) == ("10.0.0.1", 29500, "s3cret")
    with pytest.raises(ValueError, match="SHOAL_SIZE"):
        SlotInfo.from_env({"SHOAL_RANK": "0"})
