"""Shoal: data-parallel training for PyTorch, with a Horovod-compatible API.

Import the user API as ``import shoal.torch as hvd``.
"""

__version__ = "0.1.0"
