"""The engine's knobs, as one typed config. Precedence: defaults < SHOAL_/HOROVOD_ env < explicit arguments.

Each field with an environment name is a ``knob``: its flag, config-file key and help are declared here once, and
shoalrun's tuning flags, the workers' environment and docs/knobs.md are made from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.config.env import from_env, knob, read_setting

MIB = 1024 * 1024
_TUNING = "engine tuning (passed to the workers as environment variables)"


@dataclass
class EngineConfig:
    """Engine settings; ``from_env()`` applies the environment layer."""

    fusion_threshold_bytes: int = knob(
        64 * MIB,
        "largest fused allreduce buffer in bytes, 0 disables fusion; the flag takes MiB",
        env="FUSION_THRESHOLD",
        flags=("--fusion-threshold-mb",),
        group=_TUNING,
        config_key="params.fusion_threshold_mb",
        flag_scale=MIB,
        flag_type=float,
        shown_default="64 MiB",
    )
    fusion_solo_bytes: int = knob(
        1 * MIB,
        "tensors this large are reduced alone, in place, not copied into a fusion buffer: fusion saves per-collective "
        "latency, which matters only for small tensors",
        env="FUSION_SOLO_BYTES",
        shown_default="1 MiB",
    )
    hierarchical_allreduce: bool | None = knob(
        None,
        "allreduce through shared memory within each host, torch.distributed between hosts; unset, it is on whenever "
        "a host runs several ranks and /dev/shm works (measured faster at every size here)",
        env="HIERARCHICAL_ALLREDUCE",
        flags=("--hierarchical-allreduce",),
        off_flags=("--no-hierarchical-allreduce",),
        off_help="never use shared memory within hosts; every allreduce goes over torch.distributed",
        group=_TUNING,
        config_key="params.hierarchical_allreduce",
        shown_default="automatic",
    )
    shared_gradients: bool = knob(
        True,
        "DistributedOptimizer keeps CPU gradients in shared memory when the host's ranks reduce through it and the "
        "user zeroes gradients in place (zero_grad(set_to_none=False)), so they are reduced where they lie, without "
        "copies (from the third step on; see docs/architecture.md)",
        env="SHARED_GRADIENTS",
    )
    overlap_backward: bool | None = knob(
        None,
        "DistributedOptimizer starts each bucket's allreduce as soon as its gradients are final, overlapping the rest "
        "of backprop (Horovod's and Poseidon's way); off, it starts them all when backward is over. Unset, it is off "
        "only where overlap cannot pay: CPU gradients reduced through shared memory on one host whose cores the ranks' "
        "compute threads already fill (measured: docs/benchmarks.md)",
        env="OVERLAP_BACKWARD",
        shown_default="automatic",
    )
    one_round_cycles: bool = knob(
        True,
        "when the same small cached allreduces repeat, send their readiness with their data: one round trip per "
        "call instead of two (see docs/architecture.md)",
        env="ONE_ROUND_CYCLES",
    )
    shm_slot_bytes: int = knob(
        4 * MIB,
        "shared-memory staging per local rank; larger tensors go through in chunks (4 MiB measured best here: a "
        "chunk's working set then stays in cache)",
        env="SHM_SLOT_BYTES",
        shown_default="4 MiB",
    )
    cycle_time_ms: float = knob(
        1.0,
        "pause between busy engine cycles, ms (idle engines sleep until work arrives)",
        env="CYCLE_TIME",
        flags=("--cycle-time-ms",),
        group=_TUNING,
        config_key="params.cycle_time_ms",
    )
    idle_cycle_time_ms: float = knob(
        20.0,
        "how often an idle engine still joins a cycle, ms: a rank with new work waits at most this long for idle peers",
        env="IDLE_CYCLE_TIME",
        flags=("--idle-cycle-time-ms",),
        group=_TUNING,
    )
    quiet_cycle_time_ms: float = knob(
        200.0,
        "the longest pause of an engine in a quiet job: after 10 idle cycles in which nothing completed anywhere and "
        "nothing waited here, the idle pause doubles each cycle up to this, and any completed collective brings it back "
        "(each cycle crosses every host's link; the idle time bounds the wait for idle peers); equal to the idle cycle "
        "time: no back-off",
        env="QUIET_CYCLE_TIME",
        flags=("--quiet-cycle-time-ms",),
        group=_TUNING,
    )
    cache_capacity: int = knob(
        1024,
        "response cache entries; 0 disables the cache",
        env="CACHE_CAPACITY",
        flags=("--cache-capacity",),
        group=_TUNING,
        config_key="params.cache_capacity",
    )
    timeline_path: str | None = knob(
        None,
        "write a Chrome-trace timeline of the engine to this file (rank 0)",
        env="TIMELINE",
        flags=("--timeline-filename",),
        group=_TUNING,
        config_key="timeline.filename",
        path=True,
    )
    timeline_mark_cycles: bool = knob(
        False,
        "mark every engine cycle in the timeline",
        env="TIMELINE_MARK_CYCLES",
        flags=("--timeline-mark-cycles",),
        hidden_flags=("--no-timeline-mark-cycles",),
        group=_TUNING,
        config_key="timeline.mark_cycles",
    )
    stall_check_disabled: bool = knob(
        False,
        "turn the stall inspector off",
        env="STALL_CHECK_DISABLE",
        flags=("--no-stall-check",),
        hidden_flags=("--stall-check",),
        group=_TUNING,
        config_key="stall_check.enabled",
        inverted=True,
    )
    stall_check_time_s: float = knob(
        60.0,
        "warn about a tensor that has waited this long for other ranks, seconds",
        env="STALL_CHECK_TIME_SECONDS",
        flags=("--stall-check-warning-time-seconds",),
        group=_TUNING,
        config_key="stall_check.warning_time_seconds",
    )
    stall_shutdown_time_s: float = knob(
        0.0,
        "fail every pending request when a tensor stalls this long, seconds; 0 never",
        env="STALL_SHUTDOWN_TIME_SECONDS",
        flags=("--stall-check-shutdown-time-seconds",),
        group=_TUNING,
        config_key="stall_check.shutdown_time_seconds",
    )
    collective_timeout_s: float = knob(
        600.0,
        "how long one engine collective may block before the transport gives up and the engine stops, seconds "
        "(see docs/reliability.md): it only matters when a peer's engine stops while its process lives on, and it "
        "is never shorter than the stall shutdown time",
        env="COLLECTIVE_TIMEOUT_SECONDS",
        flags=("--gloo-timeout-seconds",),
        group=_TUNING,
        config_key="library_options.gloo_timeout_seconds",
    )

    autotune: bool = knob(
        False,
        "tune fusion threshold, cycle time, gradient bucket, response cache and hierarchical allreduce while training, "
        "by Bayesian optimisation (needs optuna: pip install 'shoal[autotune]'; see docs/autotune.md)",
        env="AUTOTUNE",
        flags=("--autotune",),
        hidden_flags=("--no-autotune",),
        group=_TUNING,
        config_key="autotune.enabled",
    )
    autotune_log_file: str | None = knob(
        None,
        "CSV of every autotune sample, written by rank 0",
        env="AUTOTUNE_LOG",
        flags=("--autotune-log-file",),
        group=_TUNING,
        config_key="autotune.log_file",
        path=True,
    )
    autotune_warmup_samples: int = knob(
        3,
        "autotune samples at the defaults that are not scored",
        env="AUTOTUNE_WARMUP_SAMPLES",
        flags=("--autotune-warmup-samples",),
        group=_TUNING,
        config_key="autotune.warmup_samples",
    )
    autotune_steps_per_sample: int = knob(
        10,
        "engine cycles that moved data per autotune sample",
        env="AUTOTUNE_STEPS_PER_SAMPLE",
        flags=("--autotune-steps-per-sample",),
        group=_TUNING,
        config_key="autotune.steps_per_sample",
    )
    autotune_max_samples: int = knob(
        20,
        "scored autotune samples before the best setting is frozen",
        env="AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        flags=("--autotune-bayes-opt-max-samples",),
        group=_TUNING,
        config_key="autotune.bayes_opt_max_samples",
    )
    autotune_gaussian_process_noise: float = knob(
        0.8,
        "0 treats the autotune score as deterministic, anything up to 1 as noisy",
        env="AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
        flags=("--autotune-gaussian-process-noise",),
        group=_TUNING,
        config_key="autotune.gaussian_process_noise",
    )

    @property
    def transport_timeout_s(self) -> float:
        """The timeout the engine gives its groups: the collective timeout, and with a stall shutdown set, at least
        that shutdown + 30 s (so the stall ends the requests first, with its clear error). Without one (0) there is
        no floor: a collective timeout set short for fast failure is taken as it is."""
        if self.stall_shutdown_time_s > 0:
            return max(self.collective_timeout_s, self.stall_shutdown_time_s + 30.0)
        return self.collective_timeout_s

    def __post_init__(self) -> None:
        if self.fusion_threshold_bytes < 0:
            raise ValueError(f"fusion threshold must be >= 0 bytes, got {self.fusion_threshold_bytes}")
        if self.fusion_solo_bytes < 1:
            raise ValueError(f"fusion solo size must be >= 1 byte, got {self.fusion_solo_bytes}")
        if self.shm_slot_bytes < 4096 or self.shm_slot_bytes % 64:
            raise ValueError(f"shared-memory slots must be a multiple of 64 bytes, >= 4096; got {self.shm_slot_bytes}")
        if self.cycle_time_ms < 0 or self.idle_cycle_time_ms <= 0:
            raise ValueError("cycle times must be positive")
        if self.quiet_cycle_time_ms < self.idle_cycle_time_ms:
            raise ValueError(
                f"the quiet cycle time ({self.quiet_cycle_time_ms} ms) must be at least the idle cycle time "
                f"({self.idle_cycle_time_ms} ms)"
            )
        if self.cache_capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {self.cache_capacity}")
        if self.stall_check_time_s <= 0:
            raise ValueError(f"stall check time must be > 0 s, got {self.stall_check_time_s}")
        if self.stall_shutdown_time_s < 0:
            raise ValueError(f"stall shutdown time must be >= 0 s, got {self.stall_shutdown_time_s}")
        if self.collective_timeout_s <= self.stall_check_time_s and not self.stall_check_disabled:
            raise ValueError(
                f"the collective timeout ({self.collective_timeout_s} s) must exceed the stall check time "
                f"({self.stall_check_time_s} s), so that a stall is reported before the transport gives up"
            )

    @classmethod
    def from_env(cls) -> EngineConfig:
        """Defaults overridden by the SHOAL_ (or HOROVOD_) environment variables."""
        return from_env(cls)


def engine_setting(name: str) -> Any:
    """One of this process's ``EngineConfig`` settings, read alone (a malformed other setting does not stop it):
    for parts outside the engine that follow its knobs (the parameter server's waits)."""
    return read_setting(EngineConfig, name)
