"""The engine's knobs, as one typed config. Precedence: defaults < SHOAL_/HOROVOD_ env < explicit arguments."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.config import env_bool, env_float, env_int, env_str


@dataclass
class EngineConfig:
    """Engine settings; ``from_env()`` applies the environment layer."""

    fusion_threshold_bytes: int = 64 * 1024 * 1024
    """Largest fused allreduce buffer (SHOAL_FUSION_THRESHOLD, bytes). 0 disables fusion."""
    fusion_solo_bytes: int = 1024 * 1024
    """Tensors this large are reduced alone and in place instead of copied into a fusion buffer
    (SHOAL_FUSION_SOLO_BYTES): fusion saves per-collective latency, which matters only for small tensors."""
    hierarchical_allreduce: bool | None = None
    """Allreduce through shared memory within a host (SHOAL_HIERARCHICAL_ALLREDUCE). None: on whenever a host runs
    more than one rank and /dev/shm works, which on the measured machines wins at every message size."""
    shm_slot_bytes: int = 4 * 1024 * 1024
    """Shared-memory staging per local rank (SHOAL_SHM_SLOT_BYTES); larger tensors go through in chunks. 4 MiB
    measured best here (64 MiB allreduce: 3.5 GB/s busbw against 2.5-2.7 with 16 MiB or 1 MiB slots): a chunk's
    working set then stays in cache."""
    cycle_time_ms: float = 1.0
    """Pause between busy engine cycles (SHOAL_CYCLE_TIME). Idle engines sleep until work arrives."""
    idle_cycle_time_ms: float = 20.0
    """How often an idle engine still joins a cycle, so that a rank with work never waits longer than this."""
    cache_capacity: int = 1024
    """Response cache entries (SHOAL_CACHE_CAPACITY); 0 disables the cache."""
    timeline_path: str | None = None
    """Chrome-trace timeline file (SHOAL_TIMELINE)."""
    timeline_mark_cycles: bool = False
    """Mark every engine cycle in the timeline (SHOAL_TIMELINE_MARK_CYCLES)."""
    stall_check_disabled: bool = False
    """Turn the stall inspector off (SHOAL_STALL_CHECK_DISABLE)."""
    stall_check_time_s: float = 60.0
    """Warn when a tensor has waited this long for other ranks (SHOAL_STALL_CHECK_TIME_SECONDS)."""
    stall_shutdown_time_s: float = 0.0
    """Fail every pending request when a tensor stalls this long; 0 never (SHOAL_STALL_SHUTDOWN_TIME_SECONDS)."""
    collective_timeout_s: float = 600.0
    """How long one of the engine's collectives may block before the transport gives up and the engine stops
    (SHOAL_COLLECTIVE_TIMEOUT_SECONDS). It only matters when a peer's engine stops taking part while its process
    lives on: a rank that is merely busy (evaluating, checkpointing) keeps its engine cycling, and waits of any
    length are normal. It is never shorter than the stall shutdown time, so the stall inspector speaks first."""

    autotune: bool = False
    """Tune fusion threshold, cycle time, bucket size, response cache and hierarchical allreduce while training
    (SHOAL_AUTOTUNE; see engine/autotune.py)."""
    autotune_log_file: str | None = None
    """CSV of every autotune sample, written by rank 0 (SHOAL_AUTOTUNE_LOG)."""
    autotune_warmup_samples: int = 3
    """Samples at the default settings that are not scored (SHOAL_AUTOTUNE_WARMUP_SAMPLES)."""
    autotune_steps_per_sample: int = 10
    """Engine cycles that moved data per sample (SHOAL_AUTOTUNE_STEPS_PER_SAMPLE)."""
    autotune_max_samples: int = 20
    """Scored samples before the best setting is frozen (SHOAL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES)."""
    autotune_gaussian_process_noise: float = 0.8
    """0: the score is deterministic; otherwise noisy (SHOAL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE)."""

    @property
    def transport_timeout_s(self) -> float:
        """The timeout the engine gives its groups: the collective timeout, at least the stall shutdown time."""
        return max(self.collective_timeout_s, self.stall_shutdown_time_s + 30.0)

    def __post_init__(self) -> None:
        if self.fusion_threshold_bytes < 0:
            raise ValueError(f"fusion threshold must be >= 0 bytes, got {self.fusion_threshold_bytes}")
        if self.fusion_solo_bytes < 1:
            raise ValueError(f"fusion solo size must be >= 1 byte, got {self.fusion_solo_bytes}")
        if self.shm_slot_bytes < 4096 or self.shm_slot_bytes % 64:
            raise ValueError(f"shared-memory slots must be a multiple of 64 bytes, >= 4096; got {self.shm_slot_bytes}")
        if self.cycle_time_ms < 0 or self.idle_cycle_time_ms <= 0:
            raise ValueError("cycle times must be positive")
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
        defaults = cls()
        return cls(
            fusion_threshold_bytes=env_int("FUSION_THRESHOLD", defaults.fusion_threshold_bytes),
            fusion_solo_bytes=env_int("FUSION_SOLO_BYTES", defaults.fusion_solo_bytes),
            hierarchical_allreduce=env_bool("HIERARCHICAL_ALLREDUCE", False)
            if env_str("HIERARCHICAL_ALLREDUCE") is not None
            else None,
            shm_slot_bytes=env_int("SHM_SLOT_BYTES", defaults.shm_slot_bytes),
            cycle_time_ms=env_float("CYCLE_TIME", defaults.cycle_time_ms),
            cache_capacity=env_int("CACHE_CAPACITY", defaults.cache_capacity),
            timeline_path=env_str("TIMELINE"),
            timeline_mark_cycles=env_bool("TIMELINE_MARK_CYCLES", False),
            stall_check_disabled=env_bool("STALL_CHECK_DISABLE", False),
            stall_check_time_s=env_float("STALL_CHECK_TIME_SECONDS", defaults.stall_check_time_s),
            stall_shutdown_time_s=env_float("STALL_SHUTDOWN_TIME_SECONDS", defaults.stall_shutdown_time_s),
            collective_timeout_s=env_float("COLLECTIVE_TIMEOUT_SECONDS", defaults.collective_timeout_s),
            autotune=env_bool("AUTOTUNE", False),
            autotune_log_file=env_str("AUTOTUNE_LOG"),
            autotune_warmup_samples=env_int("AUTOTUNE_WARMUP_SAMPLES", defaults.autotune_warmup_samples),
            autotune_steps_per_sample=env_int("AUTOTUNE_STEPS_PER_SAMPLE", defaults.autotune_steps_per_sample),
            autotune_max_samples=env_int("AUTOTUNE_BAYES_OPT_MAX_SAMPLES", defaults.autotune_max_samples),
            autotune_gaussian_process_noise=env_float(
                "AUTOTUNE_GAUSSIAN_PROCESS_NOISE", defaults.autotune_gaussian_process_noise
            ),
        )
