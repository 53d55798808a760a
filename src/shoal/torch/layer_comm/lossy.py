"""The compressed schemes: PowerSGD (low rank) and top-k sparsification, both with error feedback.

Each compresses a gradient in the optimizer's gradient hook, the moment it is final; the payloads (PowerSGD's P,
top-k's entries) wait until ``GROUP_BYTES`` of them are ready and leave as one fused collective, the rest together at
``synchronize`` (``LossyState.queue``/``finish``). An ``nn.Linear`` with a trainable bias is compressed from its
factors instead (``FactoredLowRank``), without forming its gradient.

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

Gradients a scheme would not shrink ``min_rate`` times (biases, small matrices) join the plain buckets, as in torch.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import ReduceOp
from shoal.plan.costs import matrix_view, powersgd_rank_fits, topk_count, topk_fits
from shoal.plan.schemes import DEFAULT_RANK, Compressed, Scheme
from shoal.torch import functions
from shoal.torch.compression import Compressor
from shoal.torch.layer_comm.layers import spares_local_gradient
from shoal.torch.layer_comm.schemes import LayerComm, Wiring
from shoal.torch.optimizer_class import computed_too_often

GROUP_BYTES = 1 << 20
"""The compressed payloads (PowerSGD's P, top-k's entries) wait until this many bytes are ready, then leave as one
fused collective; the rest leave together at ``synchronize``. They are small: sent one by one, each would pay a
collective's latency, which on a slow link is most of its cost."""


@dataclass
class Item:
    """One gradient compressed this step: where it is, and its scheme's work so far."""

    layer: _Compressing
    param: torch.Tensor
    name: str
    value: torch.Tensor
    """Gradient plus residual, float32, one vector (the gradient itself where ``in_place``)."""
    in_place: bool
    work: tuple[Any, ...]
    """PowerSGD: (matrix view, P); top-k: (k, payload)."""

    @property
    def payload(self) -> torch.Tensor:
        payload: torch.Tensor = self.work[-1]
        return payload


class LossyState:
    """Per optimizer: the error-feedback residuals and warm-start bases by parameter name, and the step count; and
    this step's compressed payloads, waiting or in flight."""

    __slots__ = ("bases", "flights", "outbox", "residuals", "steps")

    def __init__(self) -> None:
        self.steps = 0
        """Synchronized steps so far (the same on every rank): compression starts once the warm-up is over."""
        self.residuals: dict[str, torch.Tensor] = {}
        self.bases: dict[str, torch.Tensor] = {}
        """PowerSGD's Q per gradient, the same on every rank."""
        self.outbox: dict[type[_Compressing], list[Item]] = {}
        self.flights: list[tuple[type[_Compressing], int, list[Item]]] = []

    def queue(self, item: Item, process_set: ProcessSet) -> None:
        """A compressed gradient is ready: send its scheme's waiting payloads once they reach ``GROUP_BYTES``."""
        kind = type(item.layer)
        waiting = self.outbox.setdefault(kind, [])
        waiting.append(item)
        if sum(i.payload.numel() * i.payload.element_size() for i in waiting) >= GROUP_BYTES:
            self._send(kind, process_set, driven=False)

    def _send(self, kind: type[_Compressing], process_set: ProcessSet, driven: bool) -> None:
        items = self.outbox.pop(kind, [])
        if items:
            self.flights.append((kind, kind.send(items, process_set, driven), items))

    def finish(self, average: bool, process_set: ProcessSet) -> None:
        """At ``synchronize``: send what waits, complete every exchange, leave the averaged results in the gradients."""
        for kind in list(self.outbox):
            self._send(kind, process_set, driven=True)
        flights, self.flights = self.flights, []
        scale = 1.0 / process_set.size() if average else 1.0
        for kind in dict.fromkeys(kind for kind, _, _ in flights):
            kind.complete([(handle, items) for k, handle, items in flights if k is kind], scale, process_set)
        for _, _, items in flights:
            for item in items:
                if not item.in_place:  # the float32 copy holds the result
                    assert item.param.grad is not None
                    item.param.grad.copy_(item.value.view_as(item.param.grad))

    def discard(self) -> None:
        """Forget this step's exchanges (elastic recovery)."""
        for _, handle, _ in self.flights:
            handles.discard(handle)
        self.flights, self.outbox = [], {}

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
    return basis, transposed_times(matrix, basis)


def transposed_times(matrix: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``matrixᵀ·basis``, contiguous, computed as ``(basisᵀ·matrix)ᵀ``: reading the row-major matrix along its rows
    took a third of the time (1.1 against 3.3 ms for 2048×3072 at rank 4 on one core)."""
    return (basis.T @ matrix).T.contiguous()


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


def factored_probe(rows: int, columns: int, count: int = 32, rank: int = 4) -> Callable[[], None]:
    """PowerSGD's local work from a linear layer's factors (``Factors``: ``count`` rows of inputs and output
    gradients) for an n×m weight at ``rank``, without collectives, on buffers made once (what calibration times)."""
    grads, inputs = torch.randn(count, rows), torch.randn(count, columns)
    residual, out, base = torch.zeros(rows, columns), torch.empty(rows, columns), torch.randn(columns, rank)

    def run() -> None:
        factors = Factors(grads, inputs, residual)
        basis = torch.linalg.qr(factors.times(base)).Q
        local = factors.transposed_times(basis)
        factors.update_residual(basis, local, residual)
        torch.mm(basis, local.T, out=out)

    return run


def top_k_split(value: torch.Tensor, count: int, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k's compression of ``value``: the indices and values of its ``count`` largest magnitudes; what is not sent
    goes into ``residual`` (a buffer of ``value``'s size, scratch for the magnitudes until then)."""
    torch.abs(value, out=residual)
    indices = residual.topk(count, sorted=False).indices
    values = value[indices]
    residual.copy_(value)
    residual[indices] = 0.0
    return indices, values


def top_k_probe(elements: int, ratio: float = 0.01) -> Callable[[], None]:
    """Top-k's local work for one gradient of ``elements`` entries, without collectives, on buffers made once (what
    calibration times)."""
    value, residual = torch.randn(elements), torch.zeros(elements)
    count = topk_count(elements, ratio)

    def run() -> None:
        add_residual(value, residual)
        indices, values = top_k_split(value, count, residual)
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
        self._compressible = {id(p) for p in params if self.fits(p)}
        self._warmup_cast = wiring.warmup_cast

    @classmethod
    def build(
        cls, scheme: Scheme, name: str, module: nn.Module | None, params: list[torch.Tensor], wiring: Wiring
    ) -> LayerComm:
        return cls(name, params, cls.setting_of(scheme, wiring), wiring)

    @staticmethod
    def setting_of(scheme: Scheme, wiring: Wiring) -> Compressed:
        """The layer's settings: the router's (an override's, or the optimizer's), else the scheme's defaults."""
        return wiring.setting if wiring.setting is not None else Compressed(scheme)

    def fits(self, param: torch.Tensor) -> bool:
        """Whether this scheme shrinks ``param``'s gradient enough to compress it."""
        raise NotImplementedError

    @property
    def active(self) -> bool:
        """Past the warm-up (the same answer on every rank: the step count is)."""
        return self.state.steps >= self.setting.warmup

    def bucket_compressor(self) -> type[Compressor] | None:
        # Before the warm-up ends the gradients go through the buckets (``Wiring.warmup_cast``); after it, only
        # those this scheme does not shrink, as they are.
        return None if self.active else self._warmup_cast

    def offer(self, param: torch.Tensor) -> bool:
        grad = param.grad
        if not self.active or id(param) not in self._compressible or grad is None or grad.is_sparse:
            return False
        name = self.names[id(param)]
        value, in_place = working_copy(param)
        add_residual(value, self.state.residuals.get(name))
        self.state.queue(Item(self, param, name, value, in_place, self._compress(name, value)), self.process_set)
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
                if self.offer(param):
                    claimed.append(param)
        return claimed

    def reset(self) -> None:
        self.state.discard()

    def exchange_names(self, names: dict[int, str]) -> list[str]:
        return []  # fused collectives of their own; the drift monitor does not follow them

    def _compress(self, name: str, value: torch.Tensor) -> tuple[Any, ...]:
        """This rank's compression of ``value`` (gradient plus residual, float32, one vector); the last item is the
        payload to send."""
        raise NotImplementedError

    @classmethod
    def send(cls, items: list[Item], process_set: ProcessSet, driven: bool) -> int:
        """Start the first collective of these items, fused; returns its handle."""
        raise NotImplementedError

    @classmethod
    def complete(cls, flights: list[tuple[int, list[Item]]], scale: float, process_set: ProcessSet) -> None:
        """Complete the exchanges; leave each averaged (``scale``) result in its item's value vector."""
        raise NotImplementedError


class LowRank(_Compressing):
    """PowerSGD for one layer's gradients with a matrix view (the others go to the buckets)."""

    scheme = Scheme.POWERSGD

    @classmethod
    def build(
        cls, scheme: Scheme, name: str, module: nn.Module | None, params: list[torch.Tensor], wiring: Wiring
    ) -> LayerComm:
        if wiring.factored and isinstance(module, nn.Linear) and spares_local_gradient(module):
            return FactoredLowRank(name, module, params, cls.setting_of(scheme, wiring), wiring)
        return super().build(scheme, name, module, params, wiring)

    def __init__(self, name: str, params: list[torch.Tensor], setting: Compressed, wiring: Wiring) -> None:
        self.rank = setting.options.rank or wiring.rank or DEFAULT_RANK
        self._views = {id(p): matrix_view(tuple(p.shape)) for p in params}
        self.wire_dtype = torch.bfloat16 if setting.options.factors == "bfloat16" else torch.float32
        super().__init__(name, params, setting, wiring)

    def on_wire(self, factor: torch.Tensor) -> torch.Tensor:
        """A factor this rank keeps, as it is sent: a copy (the allreduce sums in place), in the layer's wire dtype."""
        return factor.to(self.wire_dtype, copy=True)

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

    def _compress(self, name: str, value: torch.Tensor) -> tuple[Any, ...]:
        view = next(v for key, v in self._views.items() if self.names[key] == name)
        assert view is not None
        matrix = value.view(view)
        return matrix, low_rank_project(matrix, self._base(name, view)).to(self.wire_dtype)  # a new tensor: summed in place

    @classmethod
    def send(cls, items: list[Item], process_set: ProcessSet, driven: bool) -> int:
        names = [f"DistributedOptimizer.powersgd.P.{item.name}" for item in items]
        return functions.allreduce_named_async_(
            [item.payload for item in items], names, ReduceOp.Sum, 1.0, 1.0, process_set, driven
        )

    @classmethod
    def complete(cls, flights: list[tuple[int, list[Item]]], scale: float, process_set: ProcessSet) -> None:
        done = []
        for handle, items in flights:
            handles.synchronize(handle)
            for item in items:
                source, projected = item.work
                if isinstance(source, Factors):
                    basis = torch.linalg.qr(projected.float()).Q
                    local = source.transposed_times(basis)
                else:
                    basis, local = low_rank_basis(source, projected.float())
                assert isinstance(item.layer, LowRank)
                sent = item.layer.on_wire(local)
                # The residual keeps what this rank's share lost, its rounding on the wire included.
                done.append((item, source, basis, local if sent.dtype == local.dtype else sent.float(), sent))
        # Every gradient's Q together, while this rank works out its residuals.
        names = [f"DistributedOptimizer.powersgd.Q.{item.name}" for item, *_ in done]
        handle = functions.allreduce_named_async_([q for *_, q in done], names, ReduceOp.Sum, 1.0, 1.0, process_set, True)
        for item, source, basis, local, _ in done:
            residual = item.layer._residual(item.name, item.value)
            if isinstance(source, Factors):
                source.update_residual(basis, local, residual.view(source.shape))
            else:
                low_rank_residual(source, basis, local, residual.view(source.shape))
        handles.synchronize(handle)
        for item, source, basis, _, summed in done:
            summed = summed.float()
            item.layer.state.bases[item.name] = summed
            # The averaged approximation, into the gradient.
            torch.mm(basis, (summed * scale).T, out=item.value.view(source.shape))


class Factors:
    """A fully-connected layer's gradient plus residual kept as factors, ``M = Gᵀ·X + E`` (G: the K output gradients'
    rows, X: the K input rows, E: the residual or None), so that PowerSGD's products touch the n·m entries only where
    the residual is: P = Gᵀ·(X·Q) + E·Q, Mᵀ·P = Xᵀ·(G·P) + Eᵀ·P, and the new residual is one rank-(K+r) update of E."""

    def __init__(self, grads: torch.Tensor, inputs: torch.Tensor, residual: torch.Tensor | None) -> None:
        self.grads = grads
        self.inputs = inputs
        self.residual = residual
        self.shape = (grads.shape[1], inputs.shape[1])

    def times(self, base: torch.Tensor) -> torch.Tensor:
        """M·Q."""
        product = self.grads.T @ (self.inputs @ base)
        return product if self.residual is None else product.addmm_(self.residual, base)

    def transposed_times(self, basis: torch.Tensor) -> torch.Tensor:
        """Mᵀ·P."""
        product = self.inputs.T @ (self.grads @ basis)
        return product if self.residual is None else product.add_(transposed_times(self.residual, basis))

    def update_residual(self, basis: torch.Tensor, local: torch.Tensor, out: torch.Tensor) -> None:
        """``M − P·(Mᵀ·P)ᵀ`` into ``out`` (which may hold E itself): one matrix product of rank K + r."""
        left = torch.cat([self.grads.T, -basis], dim=1)
        right = torch.cat([self.inputs, local.T], dim=0)
        if self.residual is None:
            torch.mm(left, right, out=out)
        elif self.residual.data_ptr() == out.data_ptr():
            out.addmm_(left, right)
        else:
            torch.addmm(self.residual, left, right, out=out)


class FactoredLowRank(LowRank):
    """PowerSGD for an ``nn.Linear`` with a trainable bias, from its factors (``Factors``): as SFB does, the weight is
    left out of autograd's graph while the layer runs forward, so backward never computes its local gradient, and
    the layer's inputs and output gradients are kept instead. Every call of the step counts (the rows of all its calls
    are stacked). The collectives are PowerSGD's own, so a rank may compress one layer from factors and another rank
    the same layer from a dense gradient. Used only with one backward pass per step."""

    def __init__(self, name: str, module: nn.Linear, params: list[torch.Tensor], setting: Compressed, wiring: Wiring) -> None:
        super().__init__(name, params, setting, wiring)
        self.module = module
        self._inputs: list[torch.Tensor] = []
        self._grads: dict[int, torch.Tensor] = {}
        self._skipping = False
        self._taken = False
        self._result: torch.Tensor | None = None
        self._hooks = [
            module.register_forward_pre_hook(self._before_forward),
            module.register_forward_hook(self._on_forward, always_call=True),
        ]

    def _factored(self) -> bool:
        weight = self.module.weight
        return (
            self.active and id(weight) in self._compressible and self.module.bias is not None and self.module.bias.requires_grad
        )

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        weight = self.module.weight
        if torch.is_grad_enabled() and module.training and weight.requires_grad and self._factored():
            weight.requires_grad_(False)
            self._skipping = True

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        skipped, self._skipping = self._skipping, False
        if not skipped:
            return
        self.module.weight.requires_grad_(True)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            self._inputs.append(args[0].detach().reshape(-1, self.module.in_features))
            output.register_hook(functools.partial(self._on_output_grad, len(self._inputs) - 1))

    def _on_output_grad(self, call: int, grad: torch.Tensor) -> None:
        if self._taken:  # a second backward pass before step(), as a dense gradient's hook would refuse it
            name = self.names[id(self.module.weight)]
            raise computed_too_often(name, 1, "call optimizer.step() (or synchronize()) between backward passes")
        self._grads[call] = grad.detach().reshape(-1, self.module.out_features)
        if len(self._grads) == len(self._inputs):
            self._take_factors()

    def _take_factors(self) -> None:
        """Every call's output gradient is in: project and queue P (as ``offer`` does for a dense gradient)."""
        weight = self.module.weight
        name = self.names[id(weight)]
        calls = sorted(self._grads)
        grads = torch.cat([self._grads[c] for c in calls]).to(torch.float32)
        inputs = torch.cat([self._inputs[c] for c in calls]).to(torch.float32)
        residual = self.state.residuals.get(name)
        view = (self.module.out_features, self.module.in_features)
        factors = Factors(grads, inputs, residual.view(view) if residual is not None else None)
        if weight.grad is None or weight.grad.dtype != torch.float32 or not weight.grad.is_contiguous():
            # The result's buffer, kept from step to step (zero_grad(set_to_none=True) drops .grad each step, and a
            # new buffer would cost its page faults again when the result is written).
            if self._result is None or self._result.shape != weight.shape:
                self._result = torch.empty_like(weight, dtype=torch.float32)
            weight.grad = self._result
        projected = factors.times(self._base(name, view)).to(self.wire_dtype)  # a new tensor: summed in place
        self.state.queue(Item(self, weight, name, weight.grad.view(-1), True, (factors, projected)), self.process_set)
        self._taken = True

    def claim_missing(self, missing: list[torch.Tensor]) -> list[torch.Tensor]:
        weight = self.module.weight
        if any(p is weight for p in missing) and not self._taken and self._grads:
            self._take_factors()  # some call's output took no part in the loss: the calls that did count
        claimed = [weight] if self._taken and any(p is weight for p in missing) else []
        rest = [p for p in missing if p is not weight or not self._taken]
        return claimed + super().claim_missing(rest)

    def finish(self, average: bool) -> None:
        self._inputs, self._grads, self._taken = [], {}, False

    def reset(self) -> None:
        self.finish(True)
        super().reset()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class TopK(_Compressing):
    """Top-k of each of one layer's gradients that it shrinks enough (the others go to the buckets)."""

    scheme = Scheme.TOPK

    def fits(self, param: torch.Tensor) -> bool:
        options = self.setting.options
        return topk_fits(param.numel(), options.ratio, options.min_rate)

    def _compress(self, name: str, value: torch.Tensor) -> tuple[Any, ...]:
        count = topk_count(value.numel(), self.setting.options.ratio)
        indices, values = top_k_split(value, count, self._residual(name, value))
        # Values and their indices in one payload: the int32 indices travel as float32 bit patterns (copied, never
        # computed on), which assumes fewer than 2³¹ entries per gradient.
        return count, torch.cat([values, indices.to(torch.int32).view(torch.float32)])

    @classmethod
    def send(cls, items: list[Item], process_set: ProcessSet, driven: bool) -> int:
        name = f"DistributedOptimizer.topk.{items[0].name}.{len(items)}"
        return functions.grouped_allgather_async([item.payload for item in items], name=name, process_set=process_set)

    @classmethod
    def complete(cls, flights: list[tuple[int, list[Item]]], scale: float, process_set: ProcessSet) -> None:
        for handle, items in flights:
            for item, gathered in zip(items, handles.synchronize(handle), strict=True):
                count = item.work[0]
                rows = gathered.view(-1, 2 * count)
                values = rows[:, :count].reshape(-1).mul_(scale)
                indices = rows[:, count:].contiguous().view(torch.int32).reshape(-1).long()
                item.value.zero_().index_add_(0, indices, values)
