"""scikit-learn's digits (1,797 real 8x8 images) for the examples and benchmarks, read without importing scikit-learn.

Importing ``sklearn.datasets`` costs about 1.4 s of CPU in each process (it imports SciPy), and a job of N workers
pays it N times: more than the whole training of a digits example. The data ship with scikit-learn as
``sklearn/datasets/data/digits.csv.gz``, so ``load_digits`` reads that file with NumPy, and ``train_test_split``
draws the same split as scikit-learn's ``train_test_split(..., test_size=0.2, random_state=0)``: the same samples
in the same order (tests/test_examples.py compares both with scikit-learn's own). Where the file is not found (a
scikit-learn that moved it), ``load_digits`` falls back to scikit-learn's loader. ``load_digits_tensors`` gives
the training and test sets every digits example and benchmark trains on.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from torch.utils.data import TensorDataset


class _Indexable(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: Any, /) -> Any: ...


ArrayT = TypeVar("ArrayT", bound=_Indexable)


def _bundled_file() -> Path | None:
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the digits need scikit-learn installed: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images, target)`` as scikit-learn's ``load_digits()`` gives them: images of shape (1797, 8, 8), float64
    pixel values 0-16, and int64 labels 0-9."""
    path = _bundled_file()
    if path is None:
        from sklearn.datasets import load_digits as sklearn_load_digits  # type: ignore[import-untyped]

        digits = sklearn_load_digits()
        return digits.images, digits.target
    rows = np.loadtxt(path, delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


def train_test_split(*arrays: ArrayT, test_size: float = 0.2, seed: int = 0) -> list[ArrayT]:
    """``[a_train, a_test, b_train, b_test, ...]``: scikit-learn's ``train_test_split(*arrays, test_size=test_size,
    random_state=seed)`` for an integer seed (one permutation from ``RandomState(seed)``; the first ``ceil(n *
    test_size)`` samples are the test set, the rest the training set, both in permutation order). Torch tensors
    work as well as arrays."""
    n = len(arrays[0])
    if any(len(array) != n for array in arrays):
        raise ValueError(f"train_test_split: the arrays differ in length: {[len(array) for array in arrays]}")
    if not 0 < test_size < 1:
        raise ValueError(f"train_test_split: test_size must lie between 0 and 1, not {test_size}")
    n_test = math.ceil(n * test_size)
    order = np.random.RandomState(seed).permutation(n)
    test, train = order[:n_test], order[n_test:]
    return [part for array in arrays for part in (array[train], array[test])]


def load_digits_tensors() -> tuple[TensorDataset, TensorDataset]:
    """The digits as (N, 1, 8, 8) float32 tensors in [0, 1] with their labels, split 80/20 with seed 0: the training
    set and the test set of the digits examples and benchmarks."""
    import torch
    from torch.utils.data import TensorDataset

    pixels, target = load_digits()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(images, torch.tensor(target), test_size=0.2, seed=0)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
