"""The environment report: what a Shoal job will find on this machine (``shoalrun --check-build``,
``python -m shoal.env``).

Shoal and torch versions, the backends torch was built with (gloo, NCCL, MPI), CUDA and GPUs, room in /dev/shm for
the shared-memory path, network interfaces, the launcher this process was started by, and the optional extras.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import sys

import torch

import shoal
from shoal.comm import process_group, shm
from shoal.runner.rendezvous_address import interface_address
from shoal.runtime.launch_env import detect_launch

_EXTRAS = (
    ("optuna", "autotune (shoalrun --autotune)"),
    ("yaml", "horovodrun config files (--config-file)"),
    ("cloudpickle", "lambdas and closures in shoal.run"),
    ("tqdm", "progress bars in the examples"),
    ("sklearn", "the digits examples' data"),
    ("matplotlib", "plots"),
    ("ray", "shoal.ray: RayExecutor and the Ray Train backend"),
    ("lightning", "shoal.lightning: ShoalStrategy for PyTorch Lightning"),
    ("tensorflow", "shoal.tensorflow: Horovod's TensorFlow 2 API"),
    ("pyspark", "shoal.spark: horovod.spark's run on Spark executors"),
    ("pyarrow", "shoal.spark's Parquet data"),
    ("mpi4py", "rendezvous under mpirun across hosts without MASTER_ADDR"),
)


def _yes(flag: object, detail: str = "") -> str:
    return ("yes" + (f" ({detail})" if detail else "")) if flag else "no"


def _interfaces() -> list[str]:
    found = []
    for _, name in socket.if_nameindex():
        try:
            found.append(f"{name} {interface_address(name)}")
        except ValueError:
            found.append(f"{name} (no IPv4 address)")
    return found


def _launcher() -> str:
    try:
        launch = detect_launch(os.environ)
    except ValueError as error:
        return f"inconsistent launcher environment: {error}"
    if launch.size == 1 and launch.launcher in ("single", "none"):
        return "none (a single process)"
    return f"{launch.launcher}, rank {launch.rank} of {launch.size}"


def report() -> str:
    """The report, one fact per line."""
    nccl = process_group.nccl_version_code()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shm_line = "not available (shared-memory collectives off; gloo is used)"
    if shm.supported():
        free = shutil.disk_usage("/dev/shm").free
        shm_line = f"{free / 2**30:.1f} GiB free in /dev/shm (shared-memory collectives on)"
    lines = [
        f"Shoal {shoal.__version__} (Python {platform.python_version()}, {sys.executable})",
        f"torch {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})",
        f"gloo: {_yes(process_group.gloo_available())}",
        f"NCCL: {_yes(nccl, f'{nccl // 10000}.{nccl // 100 % 100}.{nccl % 100}')}",
        f"MPI backend in torch: {_yes(process_group.mpi_available())}",
        f"CUDA available: {_yes(torch.cuda.is_available())}; GPUs: {gpus}",
        f"shared memory: {shm_line}",
        f"CPU cores: {os.cpu_count()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}",
        f"network interfaces: {', '.join(_interfaces()) or '(none found)'}",
        f"launcher: {_launcher()}",
    ]
    for module, purpose in _EXTRAS:
        lines.append(f"optional {module}: {_yes(importlib.util.find_spec(module) is not None)} — {purpose}")
    lines.append(f"Java (for Spark): {_java()}")
    return "\n".join(lines)


def _java() -> str:
    """The ``java -version`` line of the Java that Spark would start (``JAVA_HOME`` first), or why there is none."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.path.exists(java):
        return "not found (Spark needs Java 17 or later: JAVA_HOME or java on PATH)"
    try:
        result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{java} does not run: {error}"
    first = (result.stderr or result.stdout).strip().splitlines()[:1]
    return f"{first[0] if first else 'unknown version'} ({java})"
