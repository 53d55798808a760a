"""What ``DistributedOptimizer(shard=...)`` spreads across the ranks."""

from __future__ import annotations

import enum


class Shard(str, enum.Enum):
    """What ``DistributedOptimizer(shard=...)`` spreads across the ranks (a ``str`` too)."""

    NONE = "none"
    """Every rank holds the whole optimizer state (data parallel)."""
    OPTIMIZER = "optimizer"
    """ZeRO stage 1: each rank holds and steps 1/N of the optimizer state; gradients are allreduced whole (every
    ``comm`` scheme and compression still applies), and the updated values are allgathered."""
    GRADIENTS = "gradients"
    """ZeRO stage 2: stage 1, with the gradients reduce-scattered bucket by bucket as backward produces them, so each
    rank keeps only its 1/N of the reduced gradient."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object) -> Shard:
        """``shard=``: None, a name, or the ZeRO stage number (0, 1, 2).

        Raises:
            ValueError: anything else, listing the choices.
        """
        if value is None:
            return cls.NONE
        by_stage = {0: cls.NONE, 1: cls.OPTIMIZER, 2: cls.GRADIENTS}
        if isinstance(value, int) and not isinstance(value, bool) and value in by_stage:
            return by_stage[value]
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(s.value) for s in cls)
            raise ValueError(f"shard must be None, {choices}, or the ZeRO stage 0, 1 or 2; got {value!r}") from None
