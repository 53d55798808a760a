"""Adasum (adaptive summation; Maleki et al., 2021, as in Horovod): combine gradients so that parallel directions
are averaged and orthogonal ones added.

Two vectors combine as ``a' = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``; ranks combine along a binary tree:
adjacent pairs first (0 with 1, 2 with 3, ...), then adjacent pairs of those results, and so on. For a power-of-two
world this is Horovod's recursive-halving order; any other size works too (an odd group out moves up a level
unchanged). Each tensor of a fused batch is combined on its own (its own dot products), as Horovod does. Dot
products and norms are taken in float64.
"""

from __future__ import annotations

import torch


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two vectors of the same shape."""
    wide_a, wide_b = a.double(), b.double()
    dot = torch.dot(wide_a.reshape(-1), wide_b.reshape(-1))
    norm_a = torch.dot(wide_a.reshape(-1), wide_a.reshape(-1))
    norm_b = torch.dot(wide_b.reshape(-1), wide_b.reshape(-1))
    scale_a = 1.0 - dot / (2 * norm_a) if norm_a > 0 else torch.tensor(1.0, dtype=torch.float64)
    scale_b = 1.0 - dot / (2 * norm_b) if norm_b > 0 else torch.tensor(1.0, dtype=torch.float64)
    return (scale_a * wide_a + scale_b * wide_b).to(a.dtype)


def reduce_tree(parts: list[torch.Tensor]) -> torch.Tensor:
    """Adasum of every rank's tensor, in rank order, along the binary tree described above."""
    level = list(parts)
    while len(level) > 1:
        paired = [combine(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]
