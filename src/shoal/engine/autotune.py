"""Autotune (horovodrun --autotune): tune the engine's knobs while training, by Bayesian optimisation.

Tuned: the fusion threshold, the cycle time, the optimizer's gradient bucket, the response cache (on/off) and,
where shared memory is set up, hierarchical allreduce (on/off). A sample is ``steps_per_sample`` engine cycles that
executed data collectives; cycles are counted alike on every rank (responses are agreed), so every rank reaches a
sample's end in the same cycle. There rank 0 scores the sample (bytes reduced per second, as Horovod does), asks the
optimiser for the next setting, and broadcasts it; every rank applies it from the next cycle. The first
``warmup_samples`` samples (default settings) are not scored. After ``max_samples`` scored samples the best setting
is frozen. Rank 0 logs every sample to ``log_file`` (CSV). The optimiser is optuna's Gaussian-process sampler
(``pip install 'shoal[autotune]'``); only rank 0 runs it.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.log import get_logger

_MIB = 1024 * 1024
_FUSION_MIB = [0, 1, 2, 4, 8, 16, 32, 64]
_BUCKET_MIB = [0, 1, 2, 4, 8, 16]
_VECTOR = ("fusion_threshold_bytes", "cycle_time_ms", "bucket_bytes", "cache_enabled", "hierarchical")
SETTINGS_WIRE_LENGTH = len(_VECTOR) + 1
"""The broadcast: the settings, then 1.0 when they are the frozen best."""


@dataclass
class TunedSettings:
    """The knobs autotune moves; the engine and the optimizer read them."""

    fusion_threshold_bytes: int
    cycle_time_ms: float
    bucket_bytes: int | None
    """None: the optimizer keeps its own (the ``BUCKET_BYTES`` knob or its argument)."""
    cache_enabled: bool = True
    hierarchical: bool = True

    def to_tensor(self) -> torch.Tensor:
        bucket = -1.0 if self.bucket_bytes is None else float(self.bucket_bytes)
        values = [
            float(self.fusion_threshold_bytes),
            self.cycle_time_ms,
            bucket,
            float(self.cache_enabled),
            float(self.hierarchical),
        ]
        return torch.tensor(values, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> TunedSettings:
        threshold, cycle, bucket, cache, hierarchical = values.tolist()
        return cls(int(threshold), float(cycle), None if bucket < 0 else int(bucket), cache > 0.5, hierarchical > 0.5)


@dataclass
class AutotuneConfig:
    """horovodrun's autotune options (the ``AUTOTUNE_*`` knobs, docs/knobs.md)."""

    log_file: str | None = None
    warmup_samples: int = 3
    steps_per_sample: int = 10
    max_samples: int = 20
    gaussian_process_noise: float = 0.8
    """Horovod's GP noise in [0, 1]; here 0 tells the sampler the score is deterministic, anything else noisy."""

    def __post_init__(self) -> None:
        if self.warmup_samples < 0 or self.steps_per_sample < 1 or self.max_samples < 1:
            raise ValueError("autotune needs warmup_samples >= 0, steps_per_sample >= 1 and max_samples >= 1")
        if not 0.0 <= self.gaussian_process_noise <= 1.0:
            raise ValueError(f"autotune gaussian_process_noise must be in [0, 1], got {self.gaussian_process_noise}")


@dataclass
class Autotuner:
    """Counts samples on every rank; on rank 0, scores them and chooses the next setting."""

    config: AutotuneConfig
    rank: int
    tune_hierarchical: bool
    settings: TunedSettings
    frozen: bool = False
    samples: int = 0
    _cycles: int = 0
    _bytes: int = 0
    _started: float = field(default_factory=time.perf_counter)
    _study: Any = None
    _trial: Any = None
    _best: tuple[float, TunedSettings] | None = None
    _log: Any = None

    def __post_init__(self) -> None:
        if self.rank != 0:
            return
        optuna = import_optuna()
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # else: "greenlet missing" each time
        sampler = optuna.samplers.GPSampler(
            seed=0,
            n_startup_trials=min(5, self.config.max_samples),
            deterministic_objective=self.config.gaussian_process_noise == 0.0,
        )
        self._study = optuna.create_study(direction="maximize", sampler=sampler)
        if self.config.log_file:
            self._log = open(self.config.log_file, "w", newline="")
            csv.writer(self._log).writerow(["sample", "phase", *_VECTOR, "bytes_per_second"])

    def record(self, nbytes: int) -> bool:
        """Count one cycle that moved ``nbytes`` of data; True when a sample just ended (the same cycle everywhere)."""
        if self.frozen or nbytes == 0:
            return False
        self._cycles += 1
        self._bytes += nbytes
        return self._cycles >= self.config.steps_per_sample

    def next_settings(self) -> torch.Tensor:
        """Rank 0: score the sample that ended, choose the next settings; returns them for the broadcast."""
        score = self._bytes / max(time.perf_counter() - self._started, 1e-9)
        self.samples += 1
        warming = self.samples <= self.config.warmup_samples
        self._write("warmup" if warming else "sample", self.settings, score)
        if not warming:
            if self._trial is not None:
                self._study.tell(self._trial, score)
            if self._best is None or score > self._best[0]:
                self._best = (score, self.settings)
        scored = max(0, self.samples - self.config.warmup_samples)
        if scored >= self.config.max_samples and self._best is not None:
            best = self._best[1]
            self._write("best", best, self._best[0])
            get_logger().info("autotune: froze %s after %d samples", best, scored)
            return torch.cat([best.to_tensor(), torch.tensor([1.0], dtype=torch.float64)])
        if warming and self.samples < self.config.warmup_samples:
            return torch.cat([self.settings.to_tensor(), torch.tensor([0.0], dtype=torch.float64)])
        self._trial = self._study.ask()
        trial = self._trial
        proposal = TunedSettings(
            fusion_threshold_bytes=int(trial.suggest_categorical("fusion_threshold_mb", _FUSION_MIB)) * _MIB,
            cycle_time_ms=trial.suggest_float("cycle_time_ms", 0.5, 10.0, log=True),
            bucket_bytes=int(trial.suggest_categorical("bucket_mb", _BUCKET_MIB)) * _MIB,
            cache_enabled=trial.suggest_categorical("cache", [True, False]),
            hierarchical=trial.suggest_categorical("hierarchical", [True, False]) if self.tune_hierarchical else True,
        )
        return torch.cat([proposal.to_tensor(), torch.tensor([0.0], dtype=torch.float64)])

    def apply(self, decided: torch.Tensor) -> TunedSettings:
        """Every rank: take the broadcast settings and start the next sample."""
        self.settings = TunedSettings.from_tensor(decided[:-1])
        self.frozen = bool(decided[-1].item() > 0.5)
        self._cycles, self._bytes, self._started = 0, 0, time.perf_counter()
        if self.frozen and self._log is not None:
            self._log.close()
            self._log = None
        return self.settings

    def _write(self, phase: str, settings: TunedSettings, score: float) -> None:
        if self._log is not None:
            values = [
                settings.fusion_threshold_bytes,
                round(settings.cycle_time_ms, 3),
                settings.bucket_bytes,
                settings.cache_enabled,
                settings.hierarchical,
            ]
            csv.writer(self._log).writerow([self.samples, phase, *values, round(score, 1)])
            self._log.flush()


def import_optuna() -> Any:
    """optuna, or a clear error naming the extra to install."""
    try:
        import optuna
    except ImportError as error:
        raise ValueError("autotune needs optuna: pip install 'shoal[autotune]' (or optuna)") from error
    return optuna
