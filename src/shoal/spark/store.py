"""Where ``shoal.spark.TorchEstimator`` keeps a run's files: Horovod's ``horovod.spark.common.store``.

A store is a directory every executor and the driver can read and write: a local path in local mode (and
``local-cluster``), or a shared mount (NFS, ``/dbfs/...`` on Databricks) on a cluster. The training data goes
there as Parquet, and each run keeps its checkpoint under ``runs/<run_id>``.
"""

from __future__ import annotations

import os
import shutil

__all__ = ["LocalStore", "Store"]


class Store:
    """A run's storage; ``Store.create(path)`` picks the kind for ``path`` (only local and shared paths so far)."""

    def __init__(self, prefix_path: str) -> None:
        self.prefix_path = prefix_path

    @staticmethod
    def create(prefix_path: str) -> Store:
        """The store for ``prefix_path``: a directory path, or a ``file://`` URI."""
        return LocalStore(prefix_path)

    def get_train_data_path(self, idx: str | int | None = None) -> str:
        """The training data's Parquet directory (one per fit, named by ``idx``)."""
        return self._data_path("train", idx)

    def get_val_data_path(self, idx: str | int | None = None) -> str:
        """The validation data's Parquet directory."""
        return self._data_path("val", idx)

    def get_runs_path(self) -> str:
        return os.path.join(self.prefix_path, "runs")

    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self.get_runs_path(), run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "checkpoint")

    def get_checkpoint_filename(self) -> str:
        return "checkpoint.pt"

    def get_logs_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "logs")

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    def remove(self, path: str) -> None:
        """Delete ``path`` (a file or directory) if it is there."""
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)

    def _data_path(self, kind: str, idx: str | int | None) -> str:
        suffix = "" if idx is None else f".{idx}"
        return os.path.join(self.prefix_path, f"intermediate_{kind}_data{suffix}")


class LocalStore(Store):
    """A directory on a filesystem every executor mounts at the same path (Horovod's ``LocalStore``)."""

    def __init__(self, prefix_path: str) -> None:
        path = prefix_path[len("file://") :] if prefix_path.startswith("file://") else prefix_path
        if "://" in path or path.startswith("dbfs:"):
            raise ValueError(
                f"shoal.spark.Store: {prefix_path!r} is not a local or shared path; Shoal's store reads and writes "
                "through the filesystem, so give a path every executor mounts (a local path in local mode, NFS, or "
                "/dbfs/... on Databricks)"
            )
        super().__init__(os.path.abspath(path))
        os.makedirs(self.prefix_path, exist_ok=True)
