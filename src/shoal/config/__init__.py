"""Every setting Shoal reads, declared once: the engine's (``EngineConfig``), a worker's (``WorkerSettings``) and a
job's (``LaunchConfig``), with the helpers that read them from the environment. ``python -m shoal.config`` prints
the knobs table of docs/knobs.md, which a test keeps equal to these declarations."""

from __future__ import annotations

from shoal.config.engine import EngineConfig, engine_setting
from shoal.config.env import (
    PREFIX,
    Knob,
    Setting,
    env_bool,
    env_float,
    env_int,
    env_name,
    env_str,
    from_env,
    knob,
    markdown_rows,
    read_setting,
    settings,
)
from shoal.config.launch import LaunchConfig
from shoal.config.worker import (
    ELASTIC_ID_ENV,
    LAUNCHER_PID_ENV,
    JobAddress,
    ServerIdentity,
    SlotInfo,
    WorkerSettings,
    job_secret,
    worker_setting,
)

KNOB_CLASSES = (EngineConfig, WorkerSettings, LaunchConfig)
"""The classes whose knobs make docs/knobs.md, in the table's order."""

#: The knob names (without prefix) that Shoal reads; both prefixes are accepted.
KNOB_NAMES = tuple(dict.fromkeys(s.knob.env for cls in KNOB_CLASSES for s in settings(cls) if s.knob.env is not None))

#: The per-worker names that shoalrun sets, each under both prefixes.
WORKER_ENV_NAMES = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")

#: What shoalrun sets for a dedicated parameter-server process, on top of the rendezvous names and NUM_SERVERS.
PS_SERVER_ENV_NAMES = tuple(env_name(n) for n in ("PS_ROLE", "PS_SERVER_INDEX", "PS_NUM_WORKERS"))

#: Rendezvous names that shoalrun sets (SHOAL_ prefix only).
RENDEZVOUS_ENV_NAMES = tuple(env_name(n) for n in ("RENDEZVOUS_ADDR", "RENDEZVOUS_PORT", "SECRET"))


def knobs_table() -> str:
    """docs/knobs.md's table, made from the declarations."""
    return "\n".join(markdown_rows(*KNOB_CLASSES))


__all__ = [
    "ELASTIC_ID_ENV",
    "KNOB_CLASSES",
    "KNOB_NAMES",
    "LAUNCHER_PID_ENV",
    "PREFIX",
    "PS_SERVER_ENV_NAMES",
    "RENDEZVOUS_ENV_NAMES",
    "WORKER_ENV_NAMES",
    "EngineConfig",
    "JobAddress",
    "Knob",
    "LaunchConfig",
    "ServerIdentity",
    "Setting",
    "SlotInfo",
    "WorkerSettings",
    "engine_setting",
    "env_bool",
    "env_float",
    "env_int",
    "env_name",
    "env_str",
    "from_env",
    "job_secret",
    "knob",
    "knobs_table",
    "read_setting",
    "settings",
    "worker_setting",
]
