"""The parts of ``horovod.common.util`` that training scripts call."""

from __future__ import annotations


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: str) -> None:
    """Horovod checks that a compiled extension exists; Shoal has none to check."""


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework sees a GPU."""
    import torch

    return bool(torch.cuda.is_available())
