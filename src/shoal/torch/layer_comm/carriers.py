"""Which carrier (``LayerComm``) each parameter's gradient goes through.

``Carriers`` maps every parameter to the object that carries its layer's scheme (``schemes.py``, ``lossy.py``), each
built with its ``Wiring``: one scheme for every parameter, or a scheme per module (from ``comm=``, the overrides or the
planner); the parameter server's session once some layer uses it. The registry ``LAYER_COMM`` names each scheme's
carrier class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.log import get_logger
from shoal.plan.planner import refuse_tied_sfb
from shoal.plan.schemes import Compressed, Scheme
from shoal.ps.client import PSSession
from shoal.ps.config import PSConfig
from shoal.ps.messages import SessionSpec
from shoal.torch.compression import Compressor
from shoal.torch.layer_comm.layers import tied_modules
from shoal.torch.layer_comm.lossy import LossyState, LowRank, TopK
from shoal.torch.layer_comm.schemes import CastAllreduce, LayerComm, ParameterServer, SufficientFactors, Wiring

LAYER_COMM: dict[Scheme, type[LayerComm]] = {
    Scheme.ALLREDUCE: LayerComm,
    Scheme.FP16: CastAllreduce,
    Scheme.BF16: CastAllreduce,
    Scheme.SFB: SufficientFactors,
    Scheme.PS: ParameterServer,
    Scheme.POWERSGD: LowRank,
    Scheme.TOPK: TopK,
    Scheme.LOCAL: LayerComm,  # the buckets carry it, inside the host (shoal.torch.local_steps)
}
"""The class that carries each scheme; every ``Scheme`` has one."""


def make_layer_comm(
    scheme: Scheme, name: str, module: nn.Module | None, params: list[torch.Tensor], wiring: Wiring
) -> LayerComm:
    """The object that carries ``scheme`` for one layer."""
    return LAYER_COMM[scheme].build(scheme, name, module, params, wiring)


@dataclass
class OptimizerFacts:
    """What the router needs to know about its optimizer."""

    params: list[torch.Tensor]
    """The trainable parameters."""
    names: dict[int, str]
    """Each parameter's name, by ``id``."""
    param_groups: list[dict[str, Any]]
    base: type[torch.optim.Optimizer]
    """The wrapped optimizer's class (the servers run the same update)."""
    average: bool
    passes: int
    """backward_passes_per_step; 0: as many as each step's micro-batches (a ``BalancedLoader``)."""
    process_set: ProcessSet


class Carriers:
    """Every parameter's carrier, by ``id``: parameters without one go through the optimizer's buckets as they are.

    ``settings``: each compressed scheme's settings where no override gives a layer its own; ``cast``: the bucket
    compressor the planner's modes that compress give every carrier.
    """

    def __init__(
        self,
        facts: OptimizerFacts,
        model: nn.Module | None,
        lossy: LossyState,
        ps_config: PSConfig,
        settings: dict[Scheme, Compressed],
        cast: type[Compressor] | None,
    ) -> None:
        self.facts = facts
        self.model = model
        self.lossy = lossy
        self.ps_config = ps_config
        self.settings = settings
        self.cast = cast
        self.ps: ParameterServer | None = None
        """The parameter server's carrier, once some layer uses it (it keeps its layers for the rest of the run)."""
        self._comm_of: dict[int, LayerComm] = {}
        self._lr_of = {id(p): group for group in facts.param_groups for p in group["params"]}

    def of(self, param: torch.Tensor) -> LayerComm | None:
        """``param``'s carrier, or None (the buckets carry it)."""
        return self._comm_of.get(id(param))

    def layers(self) -> list[LayerComm]:
        """Every distinct carrier (each once)."""
        return list({id(comm): comm for comm in self._comm_of.values()}.values())

    def _lr(self, param: torch.Tensor) -> float:
        """A parameter's current learning rate (the servers apply the update)."""
        return float(self._lr_of[id(param)]["lr"])

    def _wiring(
        self,
        session: PSSession | None = None,
        setting: Compressed | None = None,
        rank: int | None = None,
        factored: bool = False,
    ) -> Wiring:
        names, lossy = self.facts.names, self.lossy
        return Wiring(self.facts.process_set, session, self._lr, names, lossy, setting, rank, factored, self.cast)

    def assign_all(self, scheme: Scheme) -> None:
        """Without a model: one scheme for every parameter."""
        if scheme.row.on_servers:
            self.open_ps(self.facts.params)
        elif scheme.row.carrier:
            comm = make_layer_comm(scheme, "", None, self.facts.params, self._wiring(setting=self.settings.get(scheme)))
            self._comm_of.update({id(p): comm for p in self.facts.params})

    def assign(
        self, schemes: dict[str, Scheme], settings: dict[str, Compressed] | None = None, ranks: dict[str, int] | None = None
    ) -> None:
        """A scheme per module name (parameters of modules not named keep the plain allreduce), with a compressed
        scheme's settings and rank per module where given."""
        assert self.model is not None
        modules = dict(self.model.named_modules())
        tied = tied_modules(self.model)
        served: list[torch.Tensor] = []
        for name, scheme in schemes.items():
            params = [p for p in modules[name].parameters(recurse=False) if p.requires_grad]
            if scheme.row.on_servers:
                served += params
                continue
            if scheme.row.one_pass and self.facts.passes != 1:
                why = "backward_passes_per_step > 1" if self.facts.passes else "a BalancedLoader's micro-batches"
                get_logger().info("%s is off for '%s': %s accumulate gradients", scheme, name, why)
                continue
            if scheme.row.needs_linear and name in tied:
                refuse_tied_sfb(name)
                continue
            if scheme.row.carrier:
                setting = (settings or {}).get(name) or self.settings.get(scheme)
                factored = self.facts.passes == 1 and name not in tied  # PowerSGD from a linear layer's factors
                wiring = self._wiring(setting=setting, rank=(ranks or {}).get(name), factored=factored)
                comm = make_layer_comm(scheme, name, modules[name], params, wiring)
                self._comm_of.update({id(p): comm for p in params})
        if served:
            self.open_ps(served)

    def open_ps(self, params: list[torch.Tensor]) -> None:
        """Route these parameters through the parameter server (joins its group on first use; every rank calls)."""
        from shoal.ps.connect import connect  # the PS joins its own group only when some layer uses it
        from shoal.ps.optimizers import describe_optimizer
        from shoal.runtime.elastic_rendezvous import is_elastic_worker

        facts = self.facts
        if facts.process_set is not global_process_set:
            raise ValueError("comm='ps' works on the global process set only")
        if is_elastic_worker():
            raise ValueError("comm='ps' is not available in elastic jobs yet: a server shard cannot move to new workers")
        owned = {id(p) for p in facts.params}
        params = [p for p in dict.fromkeys(params) if id(p) in owned]
        if not params:
            return
        name, groups = describe_optimizer(facts.base, facts.param_groups)
        group_index = {id(p): i for i, group in enumerate(facts.param_groups) for p in group["params"]}
        config = self.ps_config
        spec = SessionSpec(name, groups, [group_index[id(p)] for p in params], config.mode, config.staleness, facts.average)
        client, store = connect(config)
        session = client.open_session(params, [facts.names[id(p)] for p in params], spec, store)
        ps = make_layer_comm(Scheme.PS, "ps", None, params, self._wiring(session))
        assert isinstance(ps, ParameterServer)
        self.ps = ps
        self._comm_of.update({id(p): ps for p in params})

    def clear(self) -> None:
        """Undo ``assign`` before a re-plan (the parameter server keeps the layers it serves)."""
        for comm in self.layers():
            if comm is not self.ps:
                comm.remove()
        self._comm_of = {key: comm for key, comm in self._comm_of.items() if comm is self.ps}

    def exchange_names(self, module: nn.Module) -> list[str]:
        params = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) in self.facts.names]
        comm = self._comm_of.get(id(params[0])) if params else None
        return (comm or LayerComm("", list(params))).exchange_names(self.facts.names)
