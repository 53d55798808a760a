"""The engine's knobs: ``EngineConfig`` is declared in the config package, beside every other setting."""

from __future__ import annotations

from shoal.config.engine import EngineConfig

__all__ = ["EngineConfig"]
