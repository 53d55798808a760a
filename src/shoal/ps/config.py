"""The parameter server's settings: consistency model, staleness bound and server count, with the env layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from shoal.config import WorkerSettings, env_name, worker_setting

PSMode = Literal["bsp", "ssp", "async"]
"""The parameter server's consistency models."""
MODES: tuple[PSMode, ...] = get_args(PSMode)
DEFAULT_STALENESS = WorkerSettings.ps_staleness


@dataclass(frozen=True)
class PSConfig:
    """How workers and servers keep parameters consistent, and where the servers run."""

    mode: PSMode = "bsp"
    """``bsp``: one averaged update per step, exactly synchronous SGD; ``ssp``: each gradient is applied on arrival
    and a worker may run at most ``staleness`` steps ahead of the slowest; ``async``: no bound at all."""
    staleness: int = DEFAULT_STALENESS
    """The SSP bound s (ignored by the other modes)."""
    num_servers: int = 0
    """Dedicated server processes (the ``NUM_SERVERS`` knob, docs/knobs.md, set by ``shoalrun --num-servers``); 0 runs
    one server shard as a thread inside every worker (co-located, S = P)."""

    def __post_init__(self) -> None:
        parse_mode(self.mode)
        if self.staleness < 0:
            raise ValueError(f"ps_staleness must be >= 0, got {self.staleness}")
        if self.num_servers < 0:
            raise ValueError(f"{env_name('NUM_SERVERS')} must be >= 0, got {self.num_servers}")

    @property
    def dedicated(self) -> bool:
        """True when servers are separate processes."""
        return self.num_servers > 0


def parse_mode(value: str) -> PSMode:
    """``value`` as a consistency model; a ValueError lists the choices."""
    if value not in MODES:
        raise ValueError(f"ps_mode must be one of {MODES}, got {value!r}")
    return value


def resolve_config(mode: str | None = None, staleness: int | None = None) -> PSConfig:
    """Defaults < environment (the ``PS_MODE``, ``PS_STALENESS`` and ``NUM_SERVERS`` knobs, docs/knobs.md) < arguments."""
    chosen_mode = mode if mode is not None else str(worker_setting("ps_mode")).lower()
    chosen_staleness = staleness if staleness is not None else int(worker_setting("ps_staleness"))
    return PSConfig(parse_mode(chosen_mode), chosen_staleness, configured_servers())


def configured_servers() -> int:
    """Dedicated servers in this job (the ``NUM_SERVERS`` knob), 0 when none."""
    return worker_setting("num_servers")
