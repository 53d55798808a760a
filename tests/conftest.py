"""Shared test helpers: how to call shoalrun, and how to tell whether a process is still alive."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHOALRUN = [sys.executable, "-m", "shoal.runner"]


def process_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def clean_env() -> dict[str, str]:
    """This process's environment without any launcher variables, so a child sees no job."""
    prefixes = ("SHOAL_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def worker_env() -> dict[str, str]:
    """A clean environment for launching child jobs."""
    return clean_env()
