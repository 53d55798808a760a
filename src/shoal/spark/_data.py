"""The estimator's data: a DataFrame written to the store as Parquet on the driver, read back by rank on the workers.

The rows' order is the files' order (Spark's ``part-NNNNN`` names, sorted) and each file's own. Rank ``r`` of ``n``
keeps rows ``r, r + n, r + 2n, ...``, so with shuffling off, step ``i`` of ``n`` ranks at batch ``B`` sees exactly the
rows of step ``i`` of one process at batch ``n * B``. Every rank reads every file (one file at a time, keeping its
rows), so reading costs grow with the rank count while memory holds only a rank's share.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_INTEGER_KINDS = "iub"


def parquet_files(path: str) -> list[str]:
    """The data files of a Parquet directory Spark wrote, in row order."""
    names = sorted(name for name in os.listdir(path) if name.endswith(".parquet") and not name.startswith(("_", ".")))
    return [os.path.join(path, name) for name in names]


def row_count(path: str) -> int:
    """Rows in a Parquet directory, from the files' footers (nothing else is read)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(file).metadata.num_rows for file in parquet_files(path))


def _column_array(column: Any, name: str) -> np.ndarray[Any, Any]:
    """A pyarrow column as a numpy array: scalars as (rows,), fixed-length lists as (rows, length)."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if column.null_count:
        raise ValueError(f"shoal.spark: column {name!r} has {column.null_count} null value(s); drop or fill them first")
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        lengths = np.asarray(column.value_lengths())
        if len(lengths) and (lengths != lengths[0]).any():
            raise ValueError(
                f"shoal.spark: column {name!r} holds arrays of different lengths ({lengths.min()} to {lengths.max()}); "
                "every row must have the same shape"
            )
        flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False))
        return flat.reshape(len(column), -1) if len(column) else flat.reshape(0, 0)
    return np.asarray(column.to_numpy(zero_copy_only=False))


def load_shard(path: str, columns: list[str], rank: int, size: int) -> dict[str, np.ndarray[Any, Any]]:
    """Rank ``rank`` of ``size``'s rows of ``columns`` (every ``size``-th row from the ``rank``-th, in row order)."""
    import pyarrow.parquet as pq

    parts: dict[str, list[np.ndarray[Any, Any]]] = {name: [] for name in columns}
    offset = 0
    for file in parquet_files(path):
        table = pq.read_table(file, columns=columns)
        rows = np.arange((rank - offset) % size, table.num_rows, size)
        for name in columns:
            parts[name].append(_column_array(table.column(name), name)[rows])
        offset += table.num_rows
    return {name: np.concatenate(arrays) if arrays else np.empty(0) for name, arrays in parts.items()}


def as_tensor(values: np.ndarray[Any, Any], shape: list[int] | None = None) -> Any:
    """A batch as a tensor: integer and boolean values as int64, the rest as float32; reshaped when asked."""
    import torch

    dtype = torch.int64 if values.dtype.kind in _INTEGER_KINDS else torch.float32
    tensor = torch.as_tensor(np.array(values, order="C"), dtype=dtype)  # a copy: Arrow's buffers are read-only
    return tensor.reshape(shape) if shape is not None else tensor
