"""Shoal's logger: one ``logging`` logger named ``shoal``, its level set by the ``LOG_LEVEL`` knob (docs/knobs.md)."""

from __future__ import annotations

import logging

from shoal.config import env_name, worker_setting

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS.update({"error": logging.ERROR, "fatal": logging.CRITICAL, "critical": logging.CRITICAL})


def get_logger() -> logging.Logger:
    """Return the ``shoal`` logger, configured once from the ``LOG_LEVEL`` knob (default ``warning``)."""
    logger = logging.getLogger("shoal")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[shoal %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        level_name = (worker_setting("log_level") or "warning").lower()
        if level_name not in _LEVELS:
            raise ValueError(f"{env_name('LOG_LEVEL')} must be one of {sorted(_LEVELS)}, got {level_name!r}")
        logger.setLevel(_LEVELS[level_name])
    return logger
