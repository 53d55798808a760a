"""Settings a worker reads from its environment outside the engine: what shoalrun passes (start timeout, log level,
dedicated servers) and what the optimizer and planner take (gradient bucket, calibration file, PS consistency)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shoal.config.engine import MIB
from shoal.config.env import HOROVOD_PREFIX, env_int, env_name, env_str, knob, parse_value, read_setting


@dataclass(frozen=True)
class WorkerSettings:
    """Each read alone with ``worker_setting(name)``; shoalrun's flags for the same names reuse these fields."""

    start_timeout: float = knob(30.0, "seconds the workers may take to rendezvous", env="START_TIMEOUT")
    elastic_timeout: float = knob(
        600.0, "elastic jobs: seconds to wait for at least --min-np workers before failing the job", env="ELASTIC_TIMEOUT"
    )
    preemption_signals: str = knob(
        "SIGTERM,SIGUSR1",
        "elastic jobs: comma-separated signals taken as a preemption notice (a worker that gets one leaves at its next "
        "commit with nothing rolled back; shoalrun given one other than SIGINT, SIGTERM or SIGHUP ends the whole job "
        "that way); 'none' turns notices off, so these signals end a worker as before",
        env="PREEMPTION_SIGNALS",
    )
    preemption_grace_seconds: float = knob(
        25.0,
        "elastic workers: seconds a worker given notice may take to reach its next commit and leave; past them it "
        "exits as a failed worker",
        env="PREEMPTION_GRACE_SECONDS",
    )
    elastic_unreachable_seconds: float = knob(
        30.0,
        "elastic jobs: the longest a worker's heartbeat may stay silent, while others' reach shoalrun's store, before "
        "the worker is ended as failed and left out of the next round; it is ended sooner where its own heartbeat "
        "history makes the silence unlikely (SHOAL_ELASTIC_SUSPECT_PAUSE_SECONDS, SHOAL_ELASTIC_SUSPECT_PHI). Static "
        "shoalrun jobs: shoalrun names such a worker once suspected, and fails the job after this long",
        env="ELASTIC_UNREACHABLE_SECONDS",
    )
    elastic_suspect_pause_seconds: float = knob(
        3.0,
        "elastic jobs: a heartbeat pause this much longer than the worker's usual interval is never taken for a "
        "failure (a 2 s link blip, whose TCP retransmission lands about 3 s in; a short stop)",
        env="ELASTIC_SUSPECT_PAUSE_SECONDS",
    )
    elastic_suspect_phi: float = knob(
        8.0,
        "elastic jobs: a worker is ended once its heartbeat's silence, beyond the allowed pause, is a 1 in 10^phi "
        "event under its own history of intervals (a phi accrual failure detector)",
        env="ELASTIC_SUSPECT_PHI",
    )
    spark_start_timeout: float = knob(
        600.0, "shoal.spark.run: seconds for every rank's Spark task to start (its start_timeout)", env="SPARK_START_TIMEOUT"
    )
    log_level: str | None = knob(
        None, "Shoal's log level in the workers: debug, info, warning or error", env="LOG_LEVEL", shown_default="warning"
    )
    num_servers: int = knob(
        0,
        "dedicated parameter-server processes beside the workers (0: co-located server shards inside the workers)",
        env="NUM_SERVERS",
    )
    bucket_bytes: int = knob(
        2 * MIB,
        "DistributedOptimizer's gradient bucket; 0 sends each gradient alone",
        env="BUCKET_BYTES",
        shown_default="2 MiB",
    )
    calibration_file: str | None = knob(
        None,
        "comm='auto': keep the α–β calibration in this JSON file (read if present, else measured and written)",
        env="CALIBRATION_FILE",
    )
    ps_mode: str = knob("bsp", "parameter-server consistency: bsp, ssp or async", env="PS_MODE")
    ps_staleness: int = knob(1, "how many steps a worker may run ahead of the slowest under ssp", env="PS_STALENESS")


UNCATCHABLE_SIGNALS = frozenset({"SIGKILL", "SIGSTOP"})


def parse_signal_names(text: str) -> tuple[int, ...]:
    """``--preemption-signals`` as signal numbers: names with or without ``SIG`` (``SIGTERM``, ``usr1``) or numbers,
    comma-separated; ``none`` (or an empty text) is no signal.

    Raises:
        ValueError: a name that is no signal, or one that cannot be caught (SIGKILL, SIGSTOP).
    """
    import signal

    found: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part or part.lower() == "none":
            continue
        name = part.upper()
        name = name if name.isdigit() or name.startswith("SIG") else f"SIG{name}"
        try:
            number = signal.Signals(int(name)) if name.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise ValueError(f"--preemption-signals: {part!r} is not a signal name or number") from None
        if number.name in UNCATCHABLE_SIGNALS:
            raise ValueError(f"--preemption-signals: {number.name} cannot be caught, so it cannot be a notice")
        if number not in found:
            found.append(number)
    return tuple(int(n) for n in found)


def worker_setting(name: str) -> Any:
    """One of this process's ``WorkerSettings``, read alone (a malformed other setting does not stop it)."""
    return read_setting(WorkerSettings, name)


_IDENTITY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
"""A worker's place in the job, each written under both prefixes (horovodrun scripts read ``HOROVOD_RANK``)."""


@dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the topology: the one form of a worker's identity. The launcher, the
    test harness and Ray write it with ``to_env``, a worker reads it with ``from_env``, and an elastic round carries
    it through the store as JSON."""

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def to_env(self) -> dict[str, str]:
        """The worker's identity as environment variables, under the SHOAL_ and HOROVOD_ names."""
        values = (self.rank, self.size, self.local_rank, self.local_size, self.cross_rank, self.cross_size)
        env: dict[str, str] = {}
        for name, value in (*zip(_IDENTITY, map(str, values), strict=True), ("HOSTNAME", self.hostname)):
            env[env_name(name)] = env[HOROVOD_PREFIX + name] = value
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlotInfo | None:
        """What ``to_env`` wrote, or None when this process was not started with a Shoal identity. Only the rank and
        size are required; a missing local or cross value is -1 (derived from the ranks' hosts at ``init``)."""
        if env.get(env_name("RANK")) is None:
            return None
        values = [parse_value(name, env[env_name(name)], int) if env.get(env_name(name)) else -1 for name in _IDENTITY]
        if min(values[:2]) < 0:
            raise ValueError(f"{env_name('RANK')} and {env_name('SIZE')} must both be set, got {values[:2]}")
        return cls(env.get(env_name("HOSTNAME")) or "", *values)

    def to_json(self) -> str:
        """The form the elastic driver writes into the store."""
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SlotInfo:
        """Parse what the elastic driver wrote."""
        return cls(**json.loads(text))


@dataclass(frozen=True)
class JobAddress:
    """Where a job's rendezvous store is and the secret that opens it: the same for every process of the job."""

    addr: str
    port: int
    secret: str | None

    def to_env(self) -> dict[str, str]:
        """As the environment of a worker (or dedicated server) of the job."""
        env = {env_name("RENDEZVOUS_ADDR"): self.addr, env_name("RENDEZVOUS_PORT"): str(self.port)}
        if self.secret is not None:
            env[env_name("SECRET")] = self.secret
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobAddress | None:
        """What ``to_env`` wrote, or None when no rendezvous address is set."""
        addr, port = env.get(env_name("RENDEZVOUS_ADDR")), env.get(env_name("RENDEZVOUS_PORT"))
        if not addr or not port:
            return None
        return cls(addr, int(parse_value("RENDEZVOUS_PORT", port, int)), env.get(env_name("SECRET")))


def job_secret(env: Mapping[str, str]) -> str | None:
    """The job's rendezvous secret (``SHOAL_SECRET``) in ``env``, or None when it is not set."""
    return env.get(env_name("SECRET"))


LAUNCHER_PID_ENV = env_name("LAUNCHER_PID")
"""Set by shoalrun (and Ray's elastic driver) for the workers it starts: its own pid, so a worker can end itself
when its launcher is gone."""
ELASTIC_ID_ENV = env_name("ELASTIC_ID")
"""Set by the elastic driver: the worker's identity across rounds (its rank changes, this does not)."""


@dataclass(frozen=True)
class ServerIdentity:
    """A dedicated parameter-server process's place in the job: shoalrun writes it with ``to_env`` (beside the
    job's ``JobAddress``), ``python -m shoal.ps.server`` reads it with ``from_env``."""

    index: int
    num_servers: int
    num_workers: int

    def to_env(self) -> dict[str, str]:
        """As the server's environment: ``SHOAL_PS_ROLE=server`` and its index, the servers and the workers."""
        return {
            env_name("PS_ROLE"): "server",
            env_name("PS_SERVER_INDEX"): str(self.index),
            env_name("NUM_SERVERS"): str(self.num_servers),
            env_name("PS_NUM_WORKERS"): str(self.num_workers),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ServerIdentity | None:
        """What ``to_env`` wrote (each name read as a knob, ``SHOAL_`` or ``HOROVOD_``), or None when this process is
        not a dedicated server (``PS_ROLE`` is not ``server``). A missing index reads as -1 and a missing count as 0,
        for the caller to reject; a value that does not parse raises ``ValueError``."""
        if env_str("PS_ROLE", env) != "server":
            return None
        return cls(env_int("PS_SERVER_INDEX", -1, env), env_int("NUM_SERVERS", 0, env), env_int("PS_NUM_WORKERS", 0, env))
