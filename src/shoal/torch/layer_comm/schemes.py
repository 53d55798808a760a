"""One class per communication scheme: how a layer's gradients are submitted, finished and named.

``DistributedOptimizer`` asks the ``LayerComm`` of each parameter at each point of a step (``LayerRouter`` keeps
the map): whether the scheme takes a final gradient itself instead of the optimizer's allreduce buckets, which
compressor the buckets use for it, what to do for parameters that got no gradient, how to finish at
``synchronize()``, and which engine requests carry it (for the drift monitor). ``carriers.LAYER_COMM`` registers
each class under its ``Scheme``, once (the compressed schemes' classes are in ``lossy.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.core.process_sets import ProcessSet
from shoal.plan.schemes import Compressed, Scheme
from shoal.ps.client import PSSession
from shoal.torch.compression import Compression, Compressor
from shoal.torch.layer_comm.sfb import SufficientFactorLayer


def gradient_request_name(param_name: str) -> str:
    """The engine request name of a parameter's gradient exchange (Horovod's ``DistributedOptimizer.<name>``)."""
    return f"DistributedOptimizer.{param_name}"


@dataclass
class Wiring:
    """What a scheme may need from its optimizer."""

    process_set: ProcessSet
    session: PSSession | None = None
    """The optimizer's parameter-server session (for ``Scheme.PS``)."""
    lr_of: Callable[[torch.Tensor], float] | None = None
    """A parameter's current learning rate (the servers apply the update)."""
    names: dict[int, str] | None = None
    """The optimizer's parameter names, by ``id`` (the compressed schemes key their state by them)."""
    lossy: Any = None
    """The optimizer's ``lossy.LossyState`` (for the compressed schemes)."""
    setting: Compressed | None = None
    """The compressed scheme's settings for this layer (None: the defaults)."""
    rank: int | None = None
    """PowerSGD's rank the plan chose for this layer."""
    factored: bool = False
    """One backward pass per step and no tied weight: PowerSGD may work from a linear layer's factors."""
    warmup_cast: type[Compressor] | None = None
    """How the buckets send a compressed scheme's gradients during its warm-up: under ``comm="auto-lossy"`` as
    bfloat16 (lossy schemes are allowed there, and a slow link is why its layers compress; bfloat16 keeps float32's
    range, so no early gradient overflows); None, for ``comm="powersgd"``/``"topk"`` or a ``compression=`` on another
    comm: as they are, exactly, as torch's hook warms up."""


class LayerComm:
    """The plain case: the optimizer's buckets allreduce the gradients with its own compression."""

    scheme: Scheme = Scheme.ALLREDUCE
    compressor: type[Compressor] | None = None
    """The buckets' compressor for these parameters; None: the optimizer's ``compression``."""

    def __init__(self, name: str, params: list[torch.Tensor]) -> None:
        self.name = name
        self.params = params

    @classmethod
    def build(
        cls, scheme: Scheme, name: str, module: nn.Module | None, params: list[torch.Tensor], wiring: Wiring
    ) -> LayerComm:
        """The scheme's object for one layer (``module`` None: the optimizer's parameters as a whole)."""
        return cls(name, params)

    def bucket_compressor(self) -> type[Compressor] | None:
        """The compressor of this step's gradients that go through the buckets; None: the optimizer's."""
        return self.compressor

    def offer(self, param: torch.Tensor) -> bool:
        """Called by the gradient hook with a final gradient: send it if this scheme sends ``param`` itself (True), else
        leave it to the optimizer's buckets (False)."""
        return False

    def claim_missing(self, missing: list[torch.Tensor]) -> list[torch.Tensor]:
        """At ``synchronize()``: the parameters without a gradient this step that this scheme covers anyway."""
        return []

    def finish(self, average: bool) -> None:
        """At ``synchronize()``, after the buckets were submitted: complete this step's exchange into ``.grad``."""

    def reset(self) -> None:
        """Forget an unfinished step (elastic recovery)."""

    def remove(self) -> None:
        """Detach whatever the scheme hooked into the model (before a re-plan)."""

    def exchange_names(self, names: dict[int, str]) -> list[str]:
        """The engine request names that carry these parameters (``names``: the optimizer's, by ``id``)."""
        return [gradient_request_name(names[id(p)]) for p in self.params]


class CastAllreduce(LayerComm):
    """Half precision on the wire: the buckets cast these gradients to float16 or bfloat16 and back."""

    def __init__(self, name: str, params: list[torch.Tensor], scheme: Scheme) -> None:
        super().__init__(name, params)
        self.scheme = scheme
        self.compressor = Compression.fp16 if scheme == Scheme.FP16 else Compression.bf16

    @classmethod
    def build(
        cls, scheme: Scheme, name: str, module: nn.Module | None, params: list[torch.Tensor], wiring: Wiring
    ) -> LayerComm:
        return cls(name, params, scheme)


class SufficientFactors(LayerComm):
    """Sufficient factor broadcasting for one ``nn.Linear``: its two factors are allgathered, the gradient rebuilt."""

    scheme = Scheme.SFB

    def __init__(self, name: str, module: nn.Linear, params: list[torch.Tensor], process_set: ProcessSet) -> None:
        super().__init__(name, params)
        self.layer = SufficientFactorLayer(name or "model", module, process_set)

    @classmethod
    def build(
        cls, scheme: Scheme, name: str, module: nn.Module | None, params: list[torch.Tensor], wiring: Wiring
    ) -> LayerComm:
        if not isinstance(module, nn.Linear):
            kind = "not a module" if module is None else f"a {type(module).__name__}"
            raise ValueError(f"sfb needs an nn.Linear, but '{name or 'the model'}' is {kind}")
        return cls(name, module, params, wiring.process_set)

    def offer(self, param: torch.Tensor) -> bool:
        return True  # finish() rebuilds the gradients, or allreduces them when some rank ran the layer twice

    def claim_missing(self, missing: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.params)  # finish() sends empty factors if it did not run

    def finish(self, average: bool) -> None:
        self.layer.finish(average)

    def reset(self) -> None:
        self.layer.reset()

    def remove(self) -> None:
        self.layer.remove()

    def exchange_names(self, names: dict[int, str]) -> list[str]:
        return list(self.layer.exchange_names)

    @property
    def rebuild_seconds(self) -> float:
        return self.layer.rebuild_seconds


class ParameterServer(LayerComm):
    """Every parameter server-routed parameter of one optimizer: one session pushes gradients and pulls values."""

    scheme = Scheme.PS

    def __init__(
        self, name: str, params: list[torch.Tensor], session: PSSession, lr_of: Callable[[torch.Tensor], float]
    ) -> None:
        super().__init__(name, params)
        self.session = session
        self._lr_of = lr_of

    @classmethod
    def build(
        cls, scheme: Scheme, name: str, module: nn.Module | None, params: list[torch.Tensor], wiring: Wiring
    ) -> LayerComm:
        assert wiring.session is not None and wiring.lr_of is not None, "open the parameter-server session first"
        return cls(name, params, wiring.session, wiring.lr_of)

    def offer(self, param: torch.Tensor) -> bool:
        if not self.session.manages(param):
            return False
        self.session.push(param, self._lr_of(param))
        return True

    def claim_missing(self, missing: list[torch.Tensor]) -> list[torch.Tensor]:
        claimed = [p for p in missing if self.session.manages(p)]
        for param in claimed:  # a zero gradient stands in, so no server waits for this worker
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.session.push(param, self._lr_of(param))
        self.session.wait_pushes()  # p.grad may be edited (clipped) once synchronize() returns
        return claimed

    def exchange_names(self, names: dict[int, str]) -> list[str]:
        return []  # not engine collectives
