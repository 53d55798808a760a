"""Shoal standing in for Horovod: ``import horovod.torch as hvd`` gives ``shoal.torch``.

Only on the path under ``shoalrun --horovod-compat`` (nothing named ``horovod`` is installed into site-packages).
Every ``horovod.X`` module resolves to ``shoal.X`` (the same module object, so state is never duplicated), with
the few renames below. A real Horovod importable too is refused: two frameworks in one job would not pair up.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

_SHIM_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RENAMED = {
    "horovod.common.exceptions": "shoal.exceptions",
    "horovod.common.util": "shoal.compat.horovod_util",
    "horovod.runner": "shoal.runner",
    "horovod.spark.common": "shoal.spark",
    "horovod.spark.common.store": "shoal.spark.store",
}


def _real_horovod() -> str | None:
    for entry in sys.path:
        directory = os.path.abspath(entry or os.getcwd())
        if directory == _SHIM_ROOT:
            continue
        candidate = os.path.join(directory, "horovod", "__init__.py")
        if os.path.isfile(candidate):
            return candidate
    return None


_found = _real_horovod()
if _found is not None:
    raise ImportError(
        f"shoalrun --horovod-compat: a real Horovod is importable too ({_found}); uninstall it or run without "
        "--horovod-compat (then `import shoal.torch as hvd`)"
    )


class _ShoalAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``horovod.X`` to the already-importable ``shoal.X`` module."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("horovod."):
            return None
        shoal_name = _RENAMED.get(fullname, "shoal." + fullname[len("horovod.") :])
        try:
            if importlib.util.find_spec(shoal_name) is None:
                return None
        except ModuleNotFoundError:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(_RENAMED.get(spec.name, "shoal." + spec.name[len("horovod.") :]))

    def exec_module(self, module: ModuleType) -> None:
        """Already executed as its ``shoal`` self."""


sys.meta_path.insert(0, _ShoalAlias())

from shoal import __version__, run  # noqa: E402  (after the finder, so that horovod.* submodules resolve)

__all__ = ["__version__", "run"]
