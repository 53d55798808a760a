"""The communication schemes a layer's gradient can travel by, named once for the planner, drift and optimizer."""

from __future__ import annotations

import enum


class Scheme(str, enum.Enum):
    """A per-layer communication method. A ``str`` too, so ``"sfb"`` and ``Scheme.SFB`` compare equal."""

    ALLREDUCE = "allreduce"
    """Plain allreduce of the gradient (fused with others in the optimizer's buckets)."""
    FP16 = "fp16"
    """Cast to float16, allreduce half the bytes, cast back."""
    BF16 = "bf16"
    """Cast to bfloat16, allreduce half the bytes, cast back."""
    SFB = "sfb"
    """Sufficient factor broadcasting (fully-connected layers): allgather K·(M+N) factors, rebuild the gradient."""
    PS = "ps"
    """The sharded parameter server: push the gradient, pull the updated values."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def exchange(self) -> str | None:
        """The calibrated line (``Calibration.lines`` key) its collective runs on; None for the parameter server."""
        return _EXCHANGE[self]

    @property
    def lossy(self) -> bool:
        """Whether it rounds the gradient (half precision on the wire)."""
        return self in (Scheme.FP16, Scheme.BF16)

    @classmethod
    def parse(cls, value: object, where: str) -> Scheme:
        """``value`` as a scheme; a ValueError names ``where`` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown scheme {value!r} in {where}; choose from {[s.value for s in cls]}") from None


_EXCHANGE = {Scheme.ALLREDUCE: "allreduce", Scheme.FP16: "fp16", Scheme.BF16: "bf16", Scheme.SFB: "allgather", Scheme.PS: None}

SCHEMES = tuple(Scheme)
"""Every scheme, in the planner's order of preference on a tie."""
