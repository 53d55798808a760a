"""Which scheme carries each layer's gradients, and the ``comm="auto"`` planner that decides it.

``LayerRouter`` is the per-layer half of ``DistributedOptimizer``: it maps every parameter to its ``LayerComm``
(``schemes.py``), chooses those from ``comm=`` and ``comm_overrides`` or, with ``comm="auto"``, after the first step
from the calibrated cost model (``shoal.plan``), and watches the measured exchange times for drift. The optimizer
keeps Horovod's surface (hooks, buckets, synchronize, step) and asks the router per parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shoal.core import basics
from shoal.core import session as handles
from shoal.core.objects import broadcast_object
from shoal.core.process_sets import set_id_of
from shoal.log import get_logger
from shoal.plan.calibration import Calibration
from shoal.plan.costs import CostContext, LayerShape, LossyOptions, local_cost
from shoal.plan.drift import DriftMonitor, refit
from shoal.plan.far import RoundPlan
from shoal.plan.planner import LayerPlan, forced_scheme, forced_setting, keep_measured
from shoal.plan.schemes import COMPRESSED, Compressed, Planned, Scheme, parse_comm, scheme_of
from shoal.ps.config import PSConfig
from shoal.runtime import context
from shoal.torch import functions
from shoal.torch.compression import Compression, Compressor
from shoal.torch.layer_comm.calibrate import job_calibration, keep_calibration
from shoal.torch.layer_comm.carriers import Carriers, OptimizerFacts
from shoal.torch.layer_comm.layers import build_plan
from shoal.torch.layer_comm.lossy import LossyState
from shoal.torch.layer_comm.report import LastPlan, describe_calibration, describe_choices, warmup_note
from shoal.torch.layer_comm.schemes import LayerComm, SufficientFactors


def row_counter(rows: dict[str, int], name: str) -> Callable[..., None]:
    """A forward hook that keeps in ``rows[name]`` the most rows (K) a fully-connected layer saw in one step."""

    def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        count = args[0].numel() // args[0].shape[-1] if args[0].dim() else 1
        rows[name] = max(rows.get(name, 0), count)

    return record


def settings_of(model: nn.Module, overrides: dict[Any, Any]) -> dict[str, Compressed]:
    """Per module name, the compressed scheme's settings an override gives it."""
    found = {}
    for name, module in model.named_modules():
        value = forced_setting(name, module, overrides)
        if isinstance(value, Compressed):
            found[name] = value
    return found


class LayerRouter:
    """Every parameter's ``LayerComm``, and with ``comm="auto"`` the plan and drift monitor that choose them."""

    def __init__(
        self,
        facts: OptimizerFacts,
        model: nn.Module | None,
        comm: str,
        overrides: dict[Any, Any] | None,
        ps_config: PSConfig,
        compressed: Compressed | None = None,
    ) -> None:
        self.facts = facts
        self.model = model
        self.comm = comm
        mode = parse_comm(comm)
        self.planned = mode if isinstance(mode, Planned) else None
        """The planner's mode (``auto``, ``auto-lossy``), or None where ``comm`` forces a scheme."""
        self.overrides = dict(overrides or {})
        for value in self.overrides.values():
            scheme_of(value, "comm_overrides")
        # The warm-up is the run's, whichever scheme a layer gets: the others take the given one's.
        warmup, total = (compressed.warmup_steps, compressed.total_steps) if compressed is not None else (None, None)
        self.settings = {scheme: Compressed(scheme, warmup_steps=warmup, total_steps=total) for scheme in COMPRESSED}
        """Each compressed scheme's settings where no override gives a layer its own."""
        if compressed is not None:
            self.settings[compressed.scheme] = compressed
        self.lossy = LossyState()
        """The compressed schemes' residuals, bases and step count (committed by the elastic ``TorchState``)."""
        self.ps_config = ps_config
        cast = Compression.bf16 if self.planned is not None and self.planned.compresses else None
        self.carriers = Carriers(facts, model, self.lossy, ps_config, self.settings, cast)
        self.plans: list[LayerPlan] | None = None
        self.drift: DriftMonitor | None = None
        self.calibration: Calibration | None = None
        self._rows: dict[str, int] = {}
        self._row_hooks: list[Any] = []
        if model is None:
            if self.planned is not None or Scheme(comm).row.needs_linear or overrides:
                raise ValueError(f"comm={comm!r} and comm_overrides need model= (the nn.Module being trained)")
            self.carriers.assign_all(Scheme(comm))
        elif self.planned is not None:
            for name, module in model.named_modules():
                if isinstance(module, nn.Linear):
                    self._row_hooks.append(module.register_forward_hook(row_counter(self._rows, name)))
        else:
            chosen = Scheme(comm)
            schemes = {}
            for name, module in model.named_modules():
                if any(p.requires_grad for p in module.parameters(recurse=False)):
                    # sfb is for fully-connected layers; the others keep the plain allreduce
                    default = Scheme.ALLREDUCE if chosen.row.needs_linear and not isinstance(module, nn.Linear) else chosen
                    schemes[name] = forced_scheme(name, module, self.overrides) or default
            self.carriers.assign(schemes, settings_of(model, self.overrides))

    # ----- asked by the optimizer -----

    def offer(self, param: torch.Tensor) -> bool:
        """The gradient hook: hand a final gradient to its parameter's scheme, which sends it (True) or leaves it to the
        optimizer's buckets (False)."""
        comm = self.carriers.of(param)
        return comm is not None and comm.offer(param)

    def compressor(self, param: torch.Tensor) -> type[Compressor] | None:
        """The buckets' compressor for ``param`` when its scheme sets one."""
        comm = self.carriers.of(param)
        return None if comm is None else comm.bucket_compressor()

    def layers(self) -> list[LayerComm]:
        """Every distinct ``LayerComm`` (each once)."""
        return self.carriers.layers()

    def finish(self, average: bool) -> None:
        """At ``synchronize()``: complete every layer's exchange of this step (the compressed schemes' together)."""
        for layer in reversed(self.layers()):  # backward's order: the last layers' exchanges were the first to leave
            layer.finish(average)
        self.lossy.finish(average, self.facts.process_set)

    def start_update(self, synchronized: bool) -> list[torch.Tensor]:
        """Before the local optimizer's step: pull the servers' values, (re-)plan if due. Returns the parameters
        the local step must skip (the servers updated them)."""
        ps = self.carriers.ps  # (auto may open one below; its layers were allreduced this step)
        if ps is not None:
            ps.session.finish()
        self.lossy.steps += 1  # every rank, every step: the compressed schemes' warm-up count
        if self.planned is not None:
            if self.plans is None:
                self.apply_plan()
            elif synchronized:
                self._watch_drift()
        return list(ps.session.params) if ps is not None else []

    # ----- schemes -----

    def lossy_options(self) -> LossyOptions:
        """The bounds the planner weighs the compressed schemes with (PowerSGD's rank and factors, top-k's ratio)."""
        low_rank, sparse = self.settings[Scheme.POWERSGD].options, self.settings[Scheme.TOPK].options
        return dataclasses.replace(low_rank, ratio=sparse.ratio)

    # ----- comm="auto" -----

    def apply_plan(self, calibration: Calibration | None = None) -> None:
        """Calibrate, agree on row counts, plan and switch schemes (all ranks): after the first step of
        ``comm="auto"``, and again with a refitted ``calibration`` when measurements drift from the plan."""
        refresh = calibration is not None
        assert self.model is not None
        facts = self.facts
        for hook in self._row_hooks:
            hook.remove()
        self._row_hooks = []
        names = sorted(self._rows)
        if names and not refresh:
            rows = torch.tensor([self._rows[n] for n in names], dtype=torch.int64)
            rows = functions.allreduce(
                rows, op=functions.Max, name="DistributedOptimizer.plan.rows", process_set=facts.process_set
            )
            self._rows = dict(zip(names, rows.tolist(), strict=True))
        calibration = calibration or job_calibration()
        self.calibration = calibration
        workers = facts.process_set.size()
        dedicated = self.ps_config.dedicated
        # ps only when servers exist, and only in the first plan: one session holds a fixed set of layers, so a
        # re-plan keeps the layers already served (their optimizer state lives there) and adds none.
        allowed = (self.planned or Planned.AUTO).allowed(servers=bool(dedicated) and self.carriers.ps is None)
        overrides = dict(self.overrides)
        modules = dict(self.model.named_modules())
        previous = self.plans or []
        if self.plans is not None:  # layers already on the servers stay there (their state lives there)
            overrides.update({modules[p.name]: p.choice for p in self.plans if p.choice.row.on_servers})
            self.carriers.clear()
        servers = self.ps_config.num_servers if dedicated else workers
        self.plans = build_plan(self.model, calibration, workers, self._rows, overrides, allowed, servers, self.lossy_options())
        keep_measured(self.plans, previous)  # the same on every rank: the agreed measurements, rank 0's refit
        # With a session open, every ps layer of this plan is one it already serves (a re-plan adds none).
        self.carriers.assign(
            {p.name: p.choice for p in self.plans if not (p.choice.row.on_servers and self.carriers.ps is not None)},
            settings_of(self.model, self.overrides),
            {p.name: p.rank for p in self.plans if p.rank},
        )
        exchanges = {plan.name: self.carriers.exchange_names(modules[plan.name]) for plan in self.plans}
        if self.drift is None:
            self.drift = DriftMonitor(self.plans, exchanges, calibration)
        else:
            self.drift.replan(self.plans, exchanges, calibration)
        note = functools.partial(warmup_note, self.layers, self.lossy, self.planned is not None and self.planned.compresses)
        last = LastPlan(self.plans, workers, self.drift.recalibrations, calibration, note=note)
        context.current().set_part("torch.last_plan", last)
        if basics.rank() == 0:  # one line per (re-)plan, so that the planner never works silently
            print(
                f"[shoal] comm='{self.comm}' {'re-planned' if refresh else 'planned'} {len(self.plans)} layers "
                f"({describe_choices(self.plans)}) from {describe_calibration(calibration)}",
                file=sys.stderr,
                flush=True,
            )

    def go_local(self, rounds: RoundPlan) -> None:
        """``auto-far`` chose local steps: every gradient now goes through the buckets, among the host's ranks (the
        plan's own carriers are removed), drift stops watching, and the plan reports local steps."""
        self.carriers.clear()
        refits = self.drift.recalibrations if self.drift is not None else 0
        self.drift = None
        if self.plans is None or self.calibration is None:  # never planned (an elastic newcomer taking the job's
            self.plans = self.plans or []  # choice): there is nothing to plan any more
            return
        ctx = CostContext(self.calibration, self.facts.process_set.size(), rounds=rounds)
        for plan in self.plans:
            plan.predicted_ms[Scheme.LOCAL] = local_cost(ctx, LayerShape(plan.nbytes)).seconds * 1e3
            plan.choice, plan.rank, plan.expected_ms, plan.measured_ms = Scheme.LOCAL, None, None, None
        last = LastPlan(self.plans, ctx.workers, refits, self.calibration, rounds)
        context.current().set_part("torch.last_plan", last)

    def _watch_drift(self) -> None:
        """After a synchronized step: compare measured exchange times with the plan; re-plan together on drift."""
        monitor = self.drift
        if monitor is None or not monitor.plans:
            return
        engine = handles.engine()
        set_id = set_id_of(self.facts.process_set)
        rebuilds = {c.layer.name: c.rebuild_seconds for c in self.layers() if isinstance(c, SufficientFactors)}
        monitor.record_step(lambda name: engine.execution(name, set_id), rebuilds)
        if not monitor.check_due():
            return
        local = torch.tensor(monitor.pending(), dtype=torch.float64)
        agreed = functions.allreduce(
            local, op=functions.Min, name="DistributedOptimizer.plan.measured", process_set=self.facts.process_set
        )
        error = monitor.agree(agreed.tolist())
        if monitor.drifted():  # the same verdict on every rank: all hold the same agreed times
            log = get_logger().warning if basics.rank() == 0 else get_logger().debug  # said once, by rank 0
            log(
                "measured exchange times drift from the plan (median error %.0f%% for %d steps): recalibrating "
                "from the measurements and re-planning",
                100 * (error or 0.0),
                monitor.config.steps,
            )
            assert self.plans is not None and self.calibration is not None
            fitted = broadcast_object(
                refit(self.calibration, self.plans, monitor.terms, monitor.rebuilds),
                root_rank=0,
                name="DistributedOptimizer.plan.refit",
                process_set=self.facts.process_set,
            )
            keep_calibration(fitted)
            self.apply_plan(fitted)
