"""Compatibility layers: ``horovod_shim`` lets unmodified Horovod scripts import Shoal (shoalrun --horovod-compat)."""

import os

HOROVOD_SHIM_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_shim")
"""The directory that ``shoalrun --horovod-compat`` puts first on the workers' PYTHONPATH."""
