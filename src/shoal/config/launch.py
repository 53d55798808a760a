"""``LaunchConfig``: one typed description of a job, as shoalrun's flags, ``shoal.run`` and the Ray and elastic
drivers give it. Every field is a ``knob``: its flags, environment name, config-file key, type, default and help are
declared here once; shoalrun's parser is made from these fields, and ``worker_env`` from their environment names.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shoal.config.engine import EngineConfig
from shoal.config.env import env_name, from_env, knob, knob_from, settings, to_env
from shoal.config.worker import WorkerSettings, parse_signal_names

_HOSTS = "hosts"
_ELASTIC = "elastic training (any of these flags makes the job elastic: it survives workers that die or join)"
_SERVERS = "parameter server (for DistributedOptimizer(..., comm='ps'))"
_OUTPUT = "output"
_TUNING = "engine tuning (passed to the workers as environment variables)"
UNBOUNDED_NP = 1 << 30
"""``max_np`` when not given: bounded by the slots the hosts offer."""
_NON_NEGATIVE = ("fusion_threshold_bytes", "cycle_time_ms", "cache_capacity")
"""Engine settings whose flag refuses a negative value with the flag's own name (the rest: EngineConfig's checks)."""
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def environment_item(item: str) -> str:
    """``-x NAME`` or ``-x NAME=VALUE``, with NAME a valid environment variable name."""
    name = item.partition("=")[0]
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{name!r} is not an environment variable name")
    return item


def parse_rank_filter(text: str) -> set[int]:
    """``--ranks-filter 0,2-3`` as a set of ranks; a bad value is a one-line argparse error."""
    ranks: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            ranks.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read {part!r}; expected ranks like 0,2-3") from None
    return ranks


@dataclass
class LaunchConfig:
    """What a job is: its command, hosts, elastic bounds, output and the engine settings its workers get.

    ``engine`` holds the ``EngineConfig`` fields given explicitly (by flag, config file or caller); the workers read
    them from their environment, over their own environment layer. ``check()`` validates and fills in the elastic
    defaults; shoalrun turns its ``ValueError`` into a one-line usage error.
    """

    num_proc: int | None = knob(
        None,
        "number of worker processes; without it, the slots of -H or --hostfile, or the tasks of the Slurm allocation "
        "shoalrun runs in (salloc, sbatch)",
        flags=("-np", "--num-proc"),
    )
    check_build: bool = knob(
        False, "show which frameworks and backends are available, then exit", flags=("-cb", "--check-build")
    )
    hosts: str | None = knob(
        None, "comma-separated host:slots list; default localhost:NP", flags=("-H", "--hosts"), group=_HOSTS
    )
    hostfile: str | None = knob(
        None, "file with one 'host slots=N' (or host:N) per line", flags=("-hostfile", "--hostfile"), group=_HOSTS
    )
    ssh_port: int | None = knob(None, "ssh port on the remote hosts", flags=("-p", "--ssh-port"), group=_HOSTS)
    ssh_identity_file: str | None = knob(
        None, "ssh identity (private key) file", flags=("-i", "--ssh-identity-file"), group=_HOSTS
    )
    ssh_strict_host_key_checking: str = knob(
        "accept-new",
        "ssh's StrictHostKeyChecking for remote hosts (accept-new: a new host's key is recorded, a changed key is refused)",
        flags=("--ssh-strict-host-key-checking",),
        choices=("yes", "accept-new", "no"),
        group=_HOSTS,
    )
    forward_env: list[str] = knob(
        [],
        "set this variable for remote workers, with its value here or the one given (repeatable, as mpirun -x); "
        "remote workers get the rest of shoalrun's environment anyway, as with horovodrun",
        flags=("-x", "--env"),
        flag_type=environment_item,
        metavar="NAME[=VALUE]",
        group=_HOSTS,
    )
    preload: str = knob(
        "auto",
        "what one fork server per host imports once for the host's Python workers, each then forked from it instead "
        "of importing it anew: auto (torch or TensorFlow, as the script imports them), module names (comma-separated), "
        "or none (every worker a new interpreter)",
        flags=("--preload",),
        metavar="MODULES",
        group=_HOSTS,
    )
    preload_server: str | None = knob(
        None,
        "the Unix socket of a preload server on this host (python -m shoal.runner.preload_server PATH) that has "
        "imported the workers' framework already: each local host's fork server is forked from it instead of "
        "importing the framework again (a job it cannot serve starts its own)",
        env="PRELOAD_SERVER",
        flags=("--preload-server",),
        metavar="PATH",
        group=_HOSTS,
    )
    start_timeout: float = knob_from(WorkerSettings, "start_timeout", flags=("--start-timeout",), group=_HOSTS)
    network_interface: str | None = knob(
        None,
        "network interface(s), comma-separated, whose address remote workers use to reach the rendezvous",
        flags=("--network-interface", "--network-interfaces"),
        group=_HOSTS,
    )
    slots_per_host: int | None = knob(
        None,
        "slots of every host listed without ':N' in -H, a hostfile or discovery output",
        flags=("--slots-per-host",),
        group=_HOSTS,
        shown_default="1",
    )
    gloo: bool = knob(
        False,
        "accepted for horovodrun compatibility; Shoal always uses gloo (and NCCL for CUDA tensors)",
        flags=("--gloo",),
        group=_HOSTS,
    )
    horovod_compat: bool = knob(
        False,
        "run unmodified Horovod scripts: `import horovod.torch as hvd` (and every horovod.* module) resolves to Shoal "
        "in the workers; nothing is installed, and a real Horovod on the path is refused",
        flags=("--horovod-compat",),
        group=_HOSTS,
    )
    min_np: int | None = knob(
        None, "fewest workers the job may run with", flags=("--min-np", "--min-num-proc"), group=_ELASTIC, shown_default="-np"
    )
    max_np: int | None = knob(
        None,
        "most workers the job may grow to",
        flags=("--max-np", "--max-num-proc"),
        group=_ELASTIC,
        shown_default="every slot offered",
    )
    host_discovery_script: str | None = knob(
        None,
        "executable polled every second; prints the available hosts, one 'host:slots' per line",
        flags=("--host-discovery-script",),
        group=_ELASTIC,
    )
    elastic_timeout: float = knob_from(WorkerSettings, "elastic_timeout", flags=("--elastic-timeout",), group=_ELASTIC)
    reset_limit: int | None = knob(
        None,
        "fail the job once it would re-form more than this many times",
        flags=("--reset-limit",),
        group=_ELASTIC,
        shown_default="no limit",
    )
    blacklist_cooldown_range: tuple[float, float] | None = knob(
        None,
        "seconds MIN MAX: a host whose worker failed gets new workers again after a cooldown that doubles with each "
        "of its failures (MIN * 2**failures plus up to MIN at random, kept within MIN..MAX; MIN >= 1, MAX <= 3600); "
        "unset, a failed host gets none for the rest of the job",
        flags=("--blacklist-cooldown-range",),
        flag_type=float,
        nargs=2,
        metavar="MIN MAX",
        group=_ELASTIC,
        shown_default="never",
    )
    preemption_signals: str | None = knob_from(
        WorkerSettings,
        "preemption_signals",
        None,
        flags=("--preemption-signals",),
        metavar="SIGNALS",
        group=_ELASTIC,
        shown_default="SIGTERM",
    )
    preemption_grace_seconds: float | None = knob_from(
        WorkerSettings,
        "preemption_grace_seconds",
        None,
        flags=("--preemption-grace-seconds",),
        group=_ELASTIC,
        shown_default="25",
    )
    num_servers: int = knob_from(WorkerSettings, "num_servers", flags=("--num-servers",), group=_SERVERS)
    config_file: str | None = knob(
        None,
        "horovodrun's YAML config file (params, timeline, stall_check, library_options, logging); flags on the command "
        "line win over it (needs PyYAML)",
        flags=("--config-file",),
    )
    output_filename: str | None = knob(
        None,
        "directory; each rank's stdout and stderr also go to DIR/rank.N/{stdout,stderr}",
        flags=("--output-filename",),
        group=_OUTPUT,
    )
    verbose: bool = knob(False, "print what shoalrun does (hosts, rendezvous, commands)", flags=("--verbose",), group=_OUTPUT)
    ranks_filter: set[int] | None = knob(
        None,
        "show only these ranks' output, e.g. 0 or 0,2-3 (as torchrun's --local-ranks-filter); every rank's output "
        "still goes to --output-filename",
        flags=("--ranks-filter",),
        flag_type=parse_rank_filter,
        metavar="RANKS",
        group=_OUTPUT,
        shown_default="all",
    )
    prefix_timestamp: bool = knob(
        False,
        "prefix every output line with the time it arrived, as horovodrun does",
        flags=("-prefix-timestamp", "--prefix-output-with-timestamp"),
        group=_OUTPUT,
    )
    log_level: str | None = knob_from(
        WorkerSettings,
        "log_level",
        flags=("--log-level",),
        choices=LOG_LEVELS,
        flag_type=str.upper,
        group=_OUTPUT,
        config_key="logging.level",
        env_lower=True,
    )
    log_timestamp: bool = knob(
        False,
        "horovodrun's; Shoal's log lines carry no time, so these change nothing",
        hidden_flags=("--log-with-timestamp", "--log-without-timestamp", "--log-hide-timestamp", "--no-log-hide-timestamp"),
        group=_OUTPUT,
    )
    disable_cache: bool = knob(
        False,
        "horovodrun's: skip its cached host and NIC checks; Shoal keeps no such cache, so this changes nothing (the "
        "response cache is --cache-capacity 0)",
        flags=("--disable-cache",),
        group=_TUNING,
    )
    command: list[str] = dataclasses.field(default_factory=list)
    """What each worker runs."""
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``EngineConfig`` fields given explicitly, by name; the rest stay the workers' environment or defaults."""
    elastic: bool = False
    """Set by ``check()``: an elastic flag was given, so the job survives workers that die or join."""

    def check(self) -> None:
        """Validate, and fill in the elastic defaults (-np, --min-np and --max-np from one another).

        Raises:
            ValueError: what is wrong, naming the flag.
        """
        if self.hosts and self.hostfile:
            raise ValueError("use either -H/--hosts or --hostfile, not both")
        if self.slots_per_host is not None and self.slots_per_host < 1:
            raise ValueError(f"--slots-per-host must be >= 1, got {self.slots_per_host}")
        if self.num_servers < 0:
            raise ValueError(f"--num-servers must be >= 0, got {self.num_servers}")
        if self.start_timeout <= 0:
            raise ValueError(f"--start-timeout must be > 0, got {self.start_timeout}")
        _check_engine(self)
        self.elastic = any(v is not None for v in (self.min_np, self.max_np, self.host_discovery_script, self.reset_limit))
        if self.elastic:
            if self.num_servers:
                raise ValueError("--num-servers cannot be combined with elastic flags (a server's shard cannot move yet)")
            _check_elastic(self)
            return
        for flag, value in (
            ("--blacklist-cooldown-range", self.blacklist_cooldown_range),
            ("--preemption-signals", self.preemption_signals),
            ("--preemption-grace-seconds", self.preemption_grace_seconds),
        ):
            if value is not None:
                raise ValueError(f"{flag} is for elastic jobs (--min-np, --max-np or --host-discovery-script)")
        if self.num_proc is None and not _hosts_known(self):
            raise ValueError("-np is required when no hosts are given")
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"-np must be >= 1, got {self.num_proc}")

    def worker_env(self) -> dict[str, str]:
        """The settings every process of the job gets as SHOAL_ variables: the launcher's own (start timeout, log
        level, ...) and each engine setting given explicitly. A switch is written only when on (as horovodrun
        does): ``--no-autotune`` or ``stall_check: {enabled: true}`` leave the workers' own environment alone."""
        env: dict[str, str] = {}
        given = [(s, getattr(self, s.name)) for s in settings(LaunchConfig)]
        given += [(s, self.engine.get(s.name)) for s in settings(EngineConfig)]
        for setting, value in given:
            switched_off = value is False and not setting.optional
            if setting.knob.env is not None and value is not None and not switched_off:
                env[env_name(setting.knob.env)] = to_env(setting, value)
        return env


def _hosts_known(config: LaunchConfig) -> bool:
    """Whether the hosts and their slots are known without -np: -H, --hostfile, or a Slurm allocation (salloc,
    sbatch), whose tasks are the slots."""
    slurm_job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    slurm_nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    return bool(config.hosts or config.hostfile or (slurm_job and slurm_nodes))


def _check_engine(config: LaunchConfig) -> None:
    """The engine settings as the workers will see them (over this process's environment) must be valid."""
    unknown = set(config.engine) - {s.name for s in settings(EngineConfig)}
    if unknown:
        raise ValueError(f"unknown engine settings: {', '.join(sorted(unknown))}")
    for setting in settings(EngineConfig):  # the flags horovodrun checks itself, named as it names them
        value = config.engine.get(setting.name)
        if setting.name in _NON_NEGATIVE and value is not None and value < 0:
            raise ValueError(f"{setting.knob.flags[0]} must be >= 0, got {value / setting.knob.flag_scale:g}")
    try:
        from_env(EngineConfig, **config.engine)
    except ValueError as error:
        raise ValueError(f"engine settings: {error}") from None


def _check_elastic(config: LaunchConfig) -> None:
    """The elastic flags must agree; -np, --min-np and --max-np are filled in from one another."""
    if config.host_discovery_script and (config.hosts or config.hostfile):
        raise ValueError("use either --host-discovery-script or -H/--hostfile, not both")
    for flag, value in (("-np", config.num_proc), ("--min-np", config.min_np), ("--max-np", config.max_np)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if config.num_proc is None:
        config.num_proc = config.min_np
    if config.num_proc is None and not _hosts_known(config):
        raise ValueError("an elastic job needs -np or --min-np")
    if config.min_np is None and config.num_proc is not None:
        config.min_np = config.num_proc  # else from the hosts' slots, once they are known (shoal.runner.main)
    if config.num_proc is not None and config.min_np is not None and config.num_proc < config.min_np:
        raise ValueError(f"-np {config.num_proc} is smaller than --min-np {config.min_np}")
    if config.max_np is not None and config.max_np < max(config.min_np or 0, config.num_proc or 0):
        raise ValueError(f"--max-np {config.max_np} is smaller than -np/--min-np")
    if config.max_np is None:
        config.max_np = UNBOUNDED_NP
    if config.elastic_timeout <= 0:
        raise ValueError(f"--elastic-timeout must be > 0, got {config.elastic_timeout}")
    if config.reset_limit is not None and config.reset_limit < 0:
        raise ValueError(f"--reset-limit must be >= 0, got {config.reset_limit}")
    if config.blacklist_cooldown_range is not None:
        config.blacklist_cooldown_range = check_cooldown_range(config.blacklist_cooldown_range)
    if config.preemption_signals is not None:
        parse_signal_names(config.preemption_signals)
    if config.preemption_grace_seconds is not None and not 0 < config.preemption_grace_seconds <= 3600:
        raise ValueError(f"--preemption-grace-seconds must be > 0 and <= 3600, got {config.preemption_grace_seconds:g}")


COOLDOWN_LIMITS_S = (1.0, 3600.0)
"""The range a cooldown range must lie in (Horovod's limits)."""


def check_cooldown_range(value: Sequence[float]) -> tuple[float, float]:
    """``--blacklist-cooldown-range MIN MAX`` as a pair, or a ValueError that says what is wrong."""
    if len(value) != 2:
        raise ValueError(f"--blacklist-cooldown-range takes MIN MAX, got {list(value)}")
    low, high = float(value[0]), float(value[1])
    if low < COOLDOWN_LIMITS_S[0]:
        raise ValueError(f"--blacklist-cooldown-range: MIN must be >= {COOLDOWN_LIMITS_S[0]:.0f} s, got {low:g}")
    if high > COOLDOWN_LIMITS_S[1]:
        raise ValueError(f"--blacklist-cooldown-range: MAX must be <= {COOLDOWN_LIMITS_S[1]:.0f} s, got {high:g}")
    if high < low:
        raise ValueError(f"--blacklist-cooldown-range: MAX ({high:g}) is smaller than MIN ({low:g})")
    return low, high
