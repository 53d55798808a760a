"""One place that reads Shoal's environment variables.

Every knob is read through one accessor here. Each accepts the ``SHOAL_`` name and, for scripts written for
horovodrun, the matching ``HOROVOD_`` name; the ``SHOAL_`` name wins when both are set. Precedence for every
component is: dataclass defaults < environment < explicit arguments or flags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: The knob names (without prefix) that Shoal reads. Frozen by a test; both prefixes are accepted.
KNOB_NAMES = (
    "FUSION_THRESHOLD",
    "FUSION_SOLO_BYTES",
    "BUCKET_BYTES",
    "HIERARCHICAL_ALLREDUCE",
    "SHM_SLOT_BYTES",
    "CYCLE_TIME",
    "CACHE_CAPACITY",
    "TIMELINE",
    "TIMELINE_MARK_CYCLES",
    "STALL_CHECK_DISABLE",
    "STALL_CHECK_TIME_SECONDS",
    "STALL_SHUTDOWN_TIME_SECONDS",
    "COLLECTIVE_TIMEOUT_SECONDS",
    "AUTOTUNE",
    "AUTOTUNE_LOG",
    "AUTOTUNE_WARMUP_SAMPLES",
    "AUTOTUNE_STEPS_PER_SAMPLE",
    "AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "LOG_LEVEL",
    "START_TIMEOUT",
    "ELASTIC_TIMEOUT",
    "CALIBRATION_FILE",
    "PS_MODE",
    "PS_STALENESS",
    "NUM_SERVERS",
)

#: The per-worker names that shoalrun sets, each under both prefixes.
WORKER_ENV_NAMES = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")

#: What shoalrun sets for a dedicated parameter-server process, on top of the rendezvous names and NUM_SERVERS.
PS_SERVER_ENV_NAMES = ("SHOAL_PS_ROLE", "SHOAL_PS_SERVER_INDEX", "SHOAL_PS_NUM_WORKERS")

#: Rendezvous names that shoalrun sets (SHOAL_ prefix only).
RENDEZVOUS_ENV_NAMES = ("SHOAL_RENDEZVOUS_ADDR", "SHOAL_RENDEZVOUS_PORT", "SHOAL_SECRET")


def env_str(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """Return ``SHOAL_<name>`` or else ``HOROVOD_<name>``, or None when neither is set or both are empty."""
    source = os.environ if env is None else env
    for prefix in ("SHOAL_", "HOROVOD_"):
        value = source.get(prefix + name)
        if value is not None and value.strip() != "":
            return value.strip()
    return None


def env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """Read an integer knob, with a clear error that names the variable when it does not parse."""
    raw = env_str(name, env)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"SHOAL_{name} (or HOROVOD_{name}) must be an integer, got {raw!r}") from None


def env_float(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """Read a float knob, with a clear error that names the variable when it does not parse."""
    raw = env_str(name, env)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"SHOAL_{name} (or HOROVOD_{name}) must be a number, got {raw!r}") from None


def env_bool(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """Read a boolean knob: 1/true/yes/on and 0/false/no/off, case-insensitive."""
    raw = env_str(name, env)
    if raw is None:
        return default
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"SHOAL_{name} (or HOROVOD_{name}) must be a boolean (1/0, true/false), got {raw!r}")
