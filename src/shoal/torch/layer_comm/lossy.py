"""The compressed schemes: PowerSGD (low rank) and top-k sparsification, both with error feedback.

Each takes a gradient in the optimizer's gradient hook, the moment it is final, and starts its first collective
there, so the engine fuses it with whatever else is in flight (the buckets, other layers' factors).

- **PowerSGD** (Vogels et al., 2019; torch's ``powerSGD_hook`` is the reference for behaviour): a gradient's matrix
  view M (n×m: a linear weight, a convolution as out × in·kh·kw, an embedding) plus the residual left from earlier
  steps is projected on a rank-r basis: P = M·Q is allreduced, orthogonalised, then Q = Mᵀ·P is allreduced (every
  layer's Q together, at ``synchronize``), and the gradient becomes P·Qᵀ (averaged). Q is kept for the next step
  (warm start), which makes one power iteration per step enough.
- **Top-k**: the k largest entries (by magnitude) of gradient plus residual, values and indices, are allgathered;
  every rank adds them up into a dense gradient.

Error feedback: what a rank's compression dropped this step, ``M − P·Pᵀ·M`` (PowerSGD) or the entries not sent
(top-k), is added to its next gradient, so nothing is lost, only delayed. The residuals, the warm-start Q and the step
count (compression starts after a warm-up of uncompressed steps) live in one ``LossyState`` per optimizer, by
parameter name, which the elastic ``TorchState`` commits and restores.

Gradients a scheme would not shrink at least ``min_rate`` times (biases, small matrices) join the optimizer's plain
allreduce buckets instead, as torch's hook does with vectors.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet
from shoal.plan.schemes import Compressed, Scheme, matrix_view, powersgd_rank_fits, topk_count, topk_fits
from shoal.torch import functions
from shoal.torch.layer_comm.schemes import LayerComm, Wiring


class LossyState:
    """Per optimizer: the error-feedback residuals and warm-start bases by parameter name, and the step count."""

    __slots__ = ("bases", "residuals", "steps")

    def __init__(self) -> None:
        self.steps = 0
        """Synchronized steps so far (the same on every rank): compression starts once the warm-up is over."""
        self.residuals: dict[str, torch.Tensor] = {}
        self.bases: dict[str, torch.Tensor] = {}
        """PowerSGD's Q per gradient, the same on every rank."""

    def state_dict(self) -> dict[str, Any]:
        """A copy (tensors cloned)."""
        return {
            "steps": self.steps,
            "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
            "bases": {k: v.detach().clone() for k, v in self.bases.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a ``state_dict()`` (its tensors are copied)."""
        self.steps = int(state["steps"])
        self.residuals = {k: v.detach().clone() for k, v in state["residuals"].items()}
        self.bases = {k: v.detach().clone() for k, v in state["bases"].items()}

    def pool(self, workers_before: int, process_set: ProcessSet, root_rank: int = 0) -> None:
        """After the set of workers changed: share what the residuals held among the ranks now training.

        The gradient still owed to the model is the mean of the residuals over the ``workers_before`` ranks that
        made them. Every rank now takes the sum of the surviving ranks' residuals over ``workers_before``, so the
        mean over any new number of ranks owes exactly what the survivors owed (a rank killed without notice takes
        its own residual with it, as it takes its unsent gradient). Rank ``root_rank``'s step count and bases are
        everyone's. Collective: every rank calls it with the same names in the same order.
        """
        from shoal.core.objects import broadcast_object

        layout = broadcast_object(
            {
                "steps": self.steps,
                "workers": workers_before,
                "residuals": {k: tuple(v.shape) for k, v in self.residuals.items()},
                "bases": {k: tuple(v.shape) for k, v in self.bases.items()},
            },
            root_rank,
            name="lossy.pool.layout",
            process_set=process_set,
        )
        self.steps = int(layout["steps"])
        residuals = {}
        for name, shape in sorted(layout["residuals"].items()):
            mine = self.residuals.get(name)
            mine = mine if mine is not None and tuple(mine.shape) == shape else torch.zeros(shape)
            summed = functions.allreduce(mine, op=functions.Sum, name=f"lossy.pool.{name}", process_set=process_set)
            residuals[name] = summed / max(int(layout["workers"]), 1)
        self.residuals = residuals
        bases = {}
        for name, shape in sorted(layout["bases"].items()):
            base = self.bases.get(name)
            base = base if base is not None and tuple(base.shape) == shape else torch.zeros(shape)
            bases[name] = functions.broadcast(base, root_rank, name=f"lossy.pool.base.{name}", process_set=process_set)
        self.bases = bases


Taken = tuple[torch.Tensor, tuple[Any, ...]]
"""A parameter taken this step, and what its scheme's first collective left for ``finish``."""


def working_copy(param: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The gradient as one float32 vector to compress in place: the gradient itself where it is a contiguous float32
    tensor (True), else a float32 copy (False; the result is copied back)."""
    grad = param.grad
    assert grad is not None
    if grad.dtype == torch.float32 and grad.is_contiguous():
        return grad.detach().view(-1), True
    return grad.detach().to(torch.float32).reshape(-1), False


def add_residual(value: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Error feedback: what earlier steps did not send joins this step's gradient (in place)."""
    if residual is not None:
        value.add_(residual)


def low_rank_project(matrix: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """PowerSGD's first half on one rank: P = M·Q."""
    return matrix @ base


def low_rank_basis(matrix: torch.Tensor, projected_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PowerSGD's second half on one rank: orthonormal P from the summed projections (the same on every rank: the
    same summed input), and this rank's Q = Mᵀ·P. Returns (P, Q)."""
    basis = torch.linalg.qr(projected_sum).Q
    return basis, matrix.T @ basis


def low_rank_residual(matrix: torch.Tensor, basis: torch.Tensor, local: torch.Tensor, out: torch.Tensor) -> None:
    """What this rank's share dropped, ``M − P·Qᵀ``, into ``out``."""
    torch.addmm(matrix, basis, local.T, alpha=-1.0, out=out)


def low_rank_probe(rows: int, columns: int, rank: int = 1) -> Callable[[], None]:
    """PowerSGD's local work for one n×m gradient at ``rank``, without collectives, on buffers made once (what
    calibration times)."""
    matrix, residual, base = torch.randn(rows, columns), torch.zeros(rows, columns), torch.randn(columns, rank)

    def run() -> None:
        add_residual(matrix.view(-1), residual.view(-1))
        basis, local = low_rank_basis(matrix, low_rank_project(matrix, base))
        low_rank_residual(matrix, basis, local, residual)
        torch.mm(basis, local.T, out=matrix)

    return run


def top_entries(value: torch.Tensor, count: int, scratch: torch.Tensor) -> torch.Tensor:
    """The indices of ``value``'s ``count`` largest magnitudes (``scratch``: a buffer of its size for them)."""
    torch.abs(value, out=scratch)
    return scratch.topk(count, sorted=False).indices


def top_k_probe(elements: int, ratio: float = 0.01) -> Callable[[], None]:
    """Top-k's local work for one gradient of ``elements`` entries, without collectives, on buffers made once (what
    calibration times)."""
    value, residual = torch.randn(elements), torch.zeros(elements)
    count = topk_count(elements, ratio)

    def run() -> None:
        add_residual(value, residual)
        indices = top_entries(value, count, residual)
        values = value[indices]
        residual.copy_(value)
        residual[indices] = 0.0
        value.zero_().index_add_(0, indices, values)

    return run


class _Compressing(LayerComm):
    """What both compressed schemes share: which gradients they take, the warm-up, the residuals."""

    def __init__(self, name: str, params: list[torch.Tensor], setting: Compressed, wiring: Wiring) -> None:
        super().__init__(name, params)
        assert wiring.lossy is not None and wiring.names is not None, "the router wires the lossy state"
        self.setting = setting
        self.state = wiring.lossy
        self.process_set = wiring.process_set
        self.names = {id(p): wiring.names[id(p)] for p in params}
        self._taken: dict[int, Taken] = {}
        self._compressible = {id(p) for p in params if self.fits(p)}

    @classmethod
    def build(
        cls, scheme: Scheme, name: str, module: nn.Module | None, params: list[torch.Tensor], wiring: Wiring
    ) -> LayerComm:
        setting = wiring.setting if wiring.setting is not None else Compressed(scheme)
        return cls(name, params, setting, wiring)

    def fits(self, param: torch.Tensor) -> bool:
        """Whether this scheme shrinks ``param``'s gradient enough to compress it."""
        raise NotImplementedError

    @property
    def active(self) -> bool:
        """Past the warm-up (the same answer on every rank: the step count is)."""
        return self.state.steps >= self.setting.warmup

    def takes(self, param: torch.Tensor) -> bool:
        grad = param.grad
        if not self.active or id(param) not in self._compressible or grad is None or grad.is_sparse:
            return False
        name = self.names[id(param)]
        value, in_place = working_copy(param)
        add_residual(value, self.state.residuals.get(name))
        self._taken[id(param)] = (param, (name, value, in_place, *self._start(name, value)))
        return True

    def _residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The residual buffer of a gradient (reused step after step: a new one would cost page faults)."""
        residual = self.state.residuals.get(name)
        if residual is None or residual.shape != like.shape:
            residual = self.state.residuals[name] = torch.empty_like(like)
        return residual

    def claim_missing(self, missing: list[torch.Tensor]) -> list[torch.Tensor]:
        claimed = []
        for param in missing:  # no gradient here this step: a zero one stands in, so every rank sends the same
            if self.active and id(param) in self._compressible:
                if param.grad is None or param.grad.is_sparse:
                    param.grad = torch.zeros_like(param)
                if self.takes(param):
                    claimed.append(param)
        return claimed

    def finish(self, average: bool) -> None:
        taken, self._taken = self._taken, {}
        if not taken:
            return
        scale = 1.0 / self.process_set.size() if average else 1.0
        for param, (_, value, in_place, *_rest) in self._finish(list(taken.values()), scale):
            if not in_place:  # the float32 copy holds the result
                assert param.grad is not None
                param.grad.copy_(value.view_as(param.grad))

    def reset(self) -> None:
        for _, work in self._taken.values():
            handles.discard(work[-1])
        self._taken = {}

    def exchange_names(self, names: dict[int, str]) -> list[str]:
        return []  # collectives of their own per gradient; the drift monitor does not follow them

    def _start(self, name: str, value: torch.Tensor) -> tuple[Any, ...]:
        """Compress ``value`` (gradient plus residual, float32, one vector) and start the first collective; the last
        item returned is its handle."""
        raise NotImplementedError

    def _finish(self, taken: list[Taken], scale: float) -> list[Taken]:
        """Complete the exchanges, leave each averaged (``scale``) result in its value vector; returns ``taken``."""
        raise NotImplementedError


class LowRank(_Compressing):
    """PowerSGD for one layer's gradients with a matrix view (the others go to the buckets)."""

    scheme = Scheme.POWERSGD

    def __init__(self, name: str, params: list[torch.Tensor], setting: Compressed, wiring: Wiring) -> None:
        self.rank = setting.options.rank or wiring.rank or 4
        self._views = {id(p): matrix_view(tuple(p.shape)) for p in params}
        super().__init__(name, params, setting, wiring)

    def fits(self, param: torch.Tensor) -> bool:
        view = self._views[id(param)]
        return view is not None and powersgd_rank_fits(view, self.rank, self.setting.options.min_rate)

    def _base(self, name: str, view: tuple[int, int]) -> torch.Tensor:
        """Q for a gradient: last step's (warm start), else the same seeded random one on every rank. Its rank is
        the layer's, or the matrix's smaller side where that is smaller (full rank)."""
        shape = (view[1], min(self.rank, *view))
        base = self.state.bases.get(name)
        if base is None or tuple(base.shape) != shape:
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            base = torch.randn(*shape, generator=generator)
        return base

    def _start(self, name: str, value: torch.Tensor) -> tuple[Any, ...]:
        view = next(v for key, v in self._views.items() if self.names[key] == name)
        assert view is not None
        matrix = value.view(view)
        projected = low_rank_project(matrix, self._base(name, view))
        handle = functions.allreduce_async_(
            projected, name=f"DistributedOptimizer.powersgd.P.{name}", op=functions.Sum, process_set=self.process_set
        )
        return matrix, projected, handle

    def _finish(self, taken: list[Taken], scale: float) -> list[Taken]:
        pending = []
        for _, (name, value, _, matrix, projected, handle) in taken:
            handles.synchronize(handle)
            basis, local = low_rank_basis(matrix, projected)
            summed = local.clone()  # every layer's Q travels together
            handle = functions.allreduce_async_(
                summed, name=f"DistributedOptimizer.powersgd.Q.{name}", op=functions.Sum, process_set=self.process_set
            )
            low_rank_residual(matrix, basis, local, self._residual(name, value).view(matrix.shape))
            pending.append((name, matrix, basis, summed, handle))
        for name, matrix, basis, summed, handle in pending:
            handles.synchronize(handle)
            self.state.bases[name] = summed
            torch.mm(basis, (summed * scale).T, out=matrix)  # the averaged approximation, into the gradient
        return taken


class TopK(_Compressing):
    """Top-k of each of one layer's gradients that it shrinks enough (the others go to the buckets)."""

    scheme = Scheme.TOPK

    def fits(self, param: torch.Tensor) -> bool:
        options = self.setting.options
        return topk_fits(param.numel(), options.ratio, options.min_rate)

    def _start(self, name: str, value: torch.Tensor) -> tuple[Any, ...]:
        count = topk_count(value.numel(), self.setting.options.ratio)
        residual = self._residual(name, value)
        indices = top_entries(value, count, residual)  # the residual buffer is scratch until it is written below
        values = value[indices]
        residual.copy_(value)
        residual[indices] = 0.0  # what was not sent
        # Values and their indices in one allgather: the int32 indices travel as float32 bit patterns (copied, never
        # computed on), which assumes fewer than 2³¹ entries per gradient.
        payload = torch.cat([values, indices.to(torch.int32).view(torch.float32)])
        handle = functions.allgather_async(payload, name=f"DistributedOptimizer.topk.{name}", process_set=self.process_set)
        return count, handle

    def _finish(self, taken: list[Taken], scale: float) -> list[Taken]:
        for _, (_, value, _, count, handle) in taken:
            gathered = handles.synchronize(handle).view(-1, 2 * count)
            values = gathered[:, :count].reshape(-1).mul_(scale)
            indices = gathered[:, count:].contiguous().view(torch.int32).reshape(-1).long()
            value.zero_().index_add_(0, indices, values)
        return taken
