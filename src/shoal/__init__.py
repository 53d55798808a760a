"""Shoal: data-parallel training for PyTorch, with a Horovod-compatible API.

Import the user API as ``import shoal.torch as hvd``; ``shoal.run(fn, np=...)`` launches ``fn`` on every rank and
returns the results, as ``horovod.run`` does.
"""

__version__ = "0.1.0"

from collections.abc import Callable
from typing import Any


def run(func: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """``horovod.run``: run ``func`` on every rank of a new job and return the results in rank order.

    See ``shoal.runner.api.run`` for the arguments. Imported on first use, so that ``import shoal`` (and the
    ``shoalrun`` command) stay free of torch's start-up time.
    """
    from shoal.runner.api import run as run_job

    return run_job(func, *args, **kwargs)


__all__ = ["__version__", "run"]
