"""Shoal's logger: one ``logging`` logger named ``shoal``, its level set by the ``LOG_LEVEL`` knob (docs/knobs.md)."""

from __future__ import annotations

import logging
import os
import sys
import warnings

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


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointed at the first frame outside Shoal: the user's call, however deep in Shoal the rule
    sits. Python's default filters show a ``DeprecationWarning`` only when it points at ``__main__``, so a fixed
    ``stacklevel`` that lands on a Shoal frame hides it from the very users it is for."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2 is the frame of the function that called this one
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    warnings.warn(message, category, stacklevel=level)
