"""DistributedOptimizer: wait-free backprop (Poseidon) behind Horovod's optimizer wrapper.

Each parameter gets a post-accumulate-grad hook. The moment its gradient is final for the step, the hook submits an
asynchronous in-place allreduce, so the engine fuses and reduces late layers while earlier layers are still in
backprop. ``step()`` (or ``synchronize()``) waits for the results and then applies the wrapped optimizer's update.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.config import env_int
from shoal.engine.request import ReduceOp
from shoal.log import get_logger
from shoal.plan.calibration import Calibration, job_calibration, keep_calibration
from shoal.plan.drift import DriftMonitor, refit
from shoal.plan.planner import SCHEMES, LayerPlan, build_plan, forced_scheme, format_plan
from shoal.plan.sfb import SufficientFactorLayer
from shoal.ps.config import PSConfig, resolve_config
from shoal.ps.optimizers import describe_optimizer
from shoal.torch import adasum_optimizer, basics, functions, handles
from shoal.torch.compression import Compression, Compressor
from shoal.torch.objects import broadcast_object
from shoal.torch.optimizer_class import computed_too_often, mix_into
from shoal.torch.process_sets import ProcessSet, global_process_set, set_id_of

DEFAULT_BUCKET_BYTES = 2 * 1024 * 1024
_SCHEME_COMPRESSION: dict[str, type[Compressor]] = {"fp16": Compression.fp16, "bf16": Compression.bf16}


@dataclass
class LastPlan:
    """The most recent plan made by any DistributedOptimizer in this process."""

    plans: list[LayerPlan]
    workers: int
    refits: int
    """How many times drift made it recalibrate."""
    calibration: Calibration


_last_plan: LastPlan | None = None


def last_plan() -> LastPlan | None:
    """The most recent ``comm="auto"`` plan in this process (its ``plans`` fill in measured times as training runs)."""
    return _last_plan


def describe_choices(plans: list[LayerPlan]) -> str:
    """``allreduce: 3, sfb: 2`` for a plan."""
    counts: dict[str, int] = {}
    for plan in plans:
        counts[plan.choice] = counts.get(plan.choice, 0) + 1
    return ", ".join(f"{scheme}: {count}" for scheme, count in sorted(counts.items()))


def describe_calibration(calibration: Calibration) -> str:
    """What the plan rests on: the measured allreduce line and the matmul rate."""
    latency, per_byte = calibration.lines["allreduce"]
    return (f"allreduce {latency * 1e3:.3f} ms + {1 / per_byte / 1e9 if per_byte else float('inf'):.2f} GB/s, "
            f"matmul {calibration.flops_per_s / 1e9:.1f} GFLOP/s")  # fmt: skip


def plan_report(print_table: bool | None = None) -> str:
    """The last plan of ``comm="auto"``: per layer, shape, bytes, K, predicted ms per scheme, choice, measured ms.

    Args:
        print_table: print the table too; by default only rank 0 prints (every rank holds the same plan).

    Returns:
        The table, on every rank.
    """
    if _last_plan is None:
        text = "no plan yet: use DistributedOptimizer(..., model=model, comm='auto') and take one step"
    else:
        text = format_plan(_last_plan.plans, _last_plan.workers, _last_plan.calibration)
    if print_table or (print_table is None and (not basics.is_initialized() or basics.rank() == 0)):
        print(text)
    return text


class _ComputeMarks:
    """The optimizer's spans on the timeline's compute row, written only while a timeline is open.

    FORWARD runs from ``zero_grad()`` (or the end of the previous ``step()``) to the first final gradient, so it
    holds data loading, the forward pass, the loss and backward up to that gradient; BACKWARD runs from the first
    final gradient to the last (the span in which reductions start, overlapping the rest of backprop);
    SYNCHRONIZE is the wait for the reduced gradients; UPDATE the local optimizer's step.
    """

    def __init__(self) -> None:
        self._since: float | None = None
        self._first: float | None = None
        self._last = 0.0

    @staticmethod
    def _timeline() -> Any:
        current = handles.current_session()
        return None if current is None else current.engine.timeline

    def gradient(self) -> None:
        timeline = self._timeline()
        if timeline is None:
            return
        now = timeline.now_us()
        if self._first is None:
            self._first = now
            if self._since is not None and self._since <= now:
                timeline.compute("FORWARD", self._since, now)
        self._last = now

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        timeline = self._timeline()
        if timeline is None:
            yield
            return
        if name == "SYNCHRONIZE" and self._first is not None:
            timeline.compute("BACKWARD", self._first, self._last)
            self._first = None
        start = timeline.now_us()
        try:
            yield
        finally:
            timeline.compute(name, start, timeline.now_us())

    def step_ended(self) -> None:
        timeline = self._timeline()
        self._since = None if timeline is None else timeline.now_us()
        self._first = None


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (so ``isinstance`` still holds)."""

    _shoal_base: type[torch.optim.Optimizer]

    def _shoal_setup(self, named_parameters: list[tuple[str, torch.Tensor]] | None, compression: type[Compressor],
                     backward_passes_per_step: int, op: ReduceOp, gradient_predivide_factor: float,
                     groups: list[list[torch.Tensor]] | None, sparse_as_dense: bool,
                     process_set: ProcessSet, bucket_bytes: int) -> None:  # fmt: skip
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            names = [name for name, _ in named_parameters]
            if len(set(names)) != len(names):
                duplicates = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"named_parameters has duplicate names: {duplicates}")
            by_id = {id(p): name for name, p in named_parameters}
            unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
            if unnamed:
                raise ValueError(
                    "named_parameters was given, but the optimizer has parameters that are not in it "
                    f"(positions {unnamed[:5]}{'...' if len(unnamed) > 5 else ''}); pass model.named_parameters() "
                    "for the same model the optimizer was built on"
                )
            self._shoal_names = {id(p): by_id[id(p)] for p in params}
        else:
            self._shoal_names = {id(p): f"param.{i}" for i, p in enumerate(params)}
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):  # Adasum here: a world of one rank
            raise ValueError(f"DistributedOptimizer supports op=Average or Sum, not {ReduceOp(op).name}")
        if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
            raise ValueError("gradient_predivide_factor is only valid with op=Average")
        self._shoal_compression = compression
        self._shoal_passes = backward_passes_per_step
        self._shoal_op = ReduceOp(op)
        # Divide before the sum (and multiply back after) to keep fp16 sums in range; Average divides by size.
        self._shoal_prescale = 1.0 / gradient_predivide_factor
        self._shoal_postscale = gradient_predivide_factor
        self._shoal_sparse_as_dense = sparse_as_dense
        self._shoal_process_set = process_set
        self._shoal_params = [p for p in params if p.requires_grad]
        self._shoal_group_of: dict[int, int] = {}
        self._shoal_groups: list[list[torch.Tensor]] = []
        if groups:
            for index, group in enumerate(groups):
                self._shoal_groups.append(list(group))
                for p in group:
                    self._shoal_group_of[id(p)] = index
        self._shoal_counts: dict[int, int] = {id(p): 0 for p in self._shoal_params}
        self._shoal_bucket_bytes = bucket_bytes
        self._shoal_bucket: list[torch.Tensor] = []
        self._shoal_bucket_size = 0
        self._shoal_submitted: set[int] = set()
        self._shoal_group_ready: dict[int, set[int]] = {}
        self._shoal_in_flight: list[tuple[int, list[torch.Tensor], list[torch.Tensor], list[Any]]] = []
        self._shoal_sparse: list[torch.Tensor] = []
        self._shoal_synchronized = False
        self._shoal_should_synchronize = True
        self._shoal_marks = _ComputeMarks()
        # As in Horovod, a rank outside the optimizer's process set exchanges nothing: step() is the local one.
        self._shoal_member = process_set.included()
        self._shoal_hooks = (
            [p.register_post_accumulate_grad_hook(self._shoal_on_grad) for p in self._shoal_params]
            if self._shoal_member
            else []
        )

    # ----- hooks: start each reduction as soon as its gradient is final -----

    def _shoal_on_grad(self, param: torch.Tensor) -> None:
        self._shoal_marks.gradient()
        key = id(param)
        if key in self._shoal_submitted:
            raise computed_too_often(self._shoal_names[key], self._shoal_passes,
                                     "call optimizer.step() (or synchronize()) between backward passes, or raise "
                                     "backward_passes_per_step to accumulate locally")  # fmt: skip
        self._shoal_counts[key] += 1
        if self._shoal_counts[key] < self._shoal_passes:
            return
        self._shoal_counts[key] = 0
        if self._shoal_ps is not None and self._shoal_ps.manages(param):
            self._shoal_submitted.add(key)  # pushed to its parameter servers now; step() pulls the fresh values
            self._shoal_ps.push(param, self._shoal_lr_of[key]["lr"])
            return
        layer = self._shoal_sfb_of.get(key)
        if layer is not None and layer.usable:
            self._shoal_submitted.add(key)  # its layer allgathers the factors instead
            return
        group = self._shoal_group_of.get(key)
        if group is not None:
            ready = self._shoal_group_ready.setdefault(group, set())
            ready.add(key)
            if len(ready) == len(self._shoal_groups[group]):
                self._shoal_submit(self._shoal_groups[group])
                self._shoal_group_ready.pop(group, None)
            return
        self._shoal_bucket.append(param)
        self._shoal_bucket_size += param.numel() * param.element_size()
        if self._shoal_bucket_size >= self._shoal_bucket_limit():
            self._shoal_flush_bucket()

    def _shoal_bucket_limit(self) -> int:
        """The bucket size: autotune's choice while it runs (or once frozen), else the optimizer's own."""
        tuned = handles.engine().tuned_bucket_bytes
        return self._shoal_bucket_bytes if tuned is None else tuned

    def _shoal_flush_bucket(self) -> None:
        if self._shoal_bucket:
            self._shoal_submit(self._shoal_bucket)
        self._shoal_bucket, self._shoal_bucket_size = [], 0

    def _shoal_grad(self, param: torch.Tensor) -> torch.Tensor:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        elif param.grad.is_sparse and self._shoal_sparse_as_dense:
            param.grad = param.grad.to_dense()
        return param.grad

    def _shoal_submit(self, params: list[torch.Tensor]) -> None:
        """Start reducing these parameters' gradients together, each under its parameter's name."""
        dense: list[torch.Tensor] = []
        for param in params:
            self._shoal_submitted.add(id(param))
            (self._shoal_sparse if self._shoal_grad(param).is_sparse else dense).append(param)
        if not dense:
            return
        packed = [self._shoal_compressor(p).compress(self._shoal_grad(p)) for p in dense]
        names = [f"DistributedOptimizer.{self._shoal_names[id(p)]}" for p in dense]
        handle = functions.allreduce_named_async_([c for c, _ in packed], names, self._shoal_op, self._shoal_prescale,
                                                  self._shoal_postscale, self._shoal_process_set)  # fmt: skip
        self._shoal_in_flight.append((handle, dense, [c for c, _ in packed], [ctx for _, ctx in packed]))

    # ----- the Horovod optimizer surface -----

    def synchronize(self) -> None:
        """Wait for every gradient reduction of this step (submitting any a parameter never started)."""
        if not self._shoal_member:
            self._shoal_synchronized = True
            return
        with self._shoal_marks.span("SYNCHRONIZE"):
            self._shoal_synchronize()

    def _shoal_synchronize(self) -> None:
        self._shoal_flush_bucket()
        layers = list(dict.fromkeys(self._shoal_sfb_of.values()))
        for layer in layers:
            if layer.usable:
                self._shoal_submitted.update(id(p) for p in layer.parameters)
        missing = [p for p in self._shoal_params if id(p) not in self._shoal_submitted]
        if self._shoal_ps is not None:
            for param in [p for p in missing if self._shoal_ps.manages(p)]:
                self._shoal_grad(param)  # a zero gradient stands in, so no server waits for this worker
                self._shoal_submitted.add(id(param))
                self._shoal_ps.push(param, self._shoal_lr_of[id(param)]["lr"])
            missing = [p for p in missing if not self._shoal_ps.manages(p)]
            self._shoal_ps.wait_pushes()  # p.grad may be edited (clipped) once synchronize() returns
        if missing:  # no gradient this step here (or a layer that fell back): stand in, so no rank ever hangs
            self._shoal_submit(missing)
        for layer in layers:
            if layer.usable:
                layer.finish(average=self._shoal_op == ReduceOp.Average)
            layer.reset()
        for handle, params, compressed_list, contexts in self._shoal_in_flight:
            handles.synchronize(handle)
            for param, compressed, ctx in zip(params, compressed_list, contexts, strict=True):
                if compressed is not param.grad:
                    assert param.grad is not None
                    param.grad.copy_(self._shoal_compressor(param).decompress(compressed, ctx))
        for param in self._shoal_sparse:
            param.grad = self._shoal_sparse_allreduce(param.grad, self._shoal_names[id(param)])
        self._shoal_in_flight.clear()
        self._shoal_sparse.clear()
        self._shoal_submitted.clear()
        self._shoal_group_ready.clear()
        self._shoal_counts = dict.fromkeys(self._shoal_counts, 0)
        self._shoal_synchronized = True

    def _shoal_sparse_allreduce(self, grad: torch.Tensor | None, name: str) -> torch.Tensor:
        """Sparse gradients: allgather indices and values, then sum duplicates (averaging if op is Average)."""
        assert grad is not None
        op = ReduceOp.Average if self._shoal_op == ReduceOp.Average else ReduceOp.Sum  # Adasum on one rank: a sum
        result = functions.sparse_allreduce_async(grad, f"DistributedOptimizer.{name}", op, self._shoal_process_set)
        return result().coalesce()

    # ----- per-layer schemes (Poseidon) -----

    def _shoal_compressor(self, param: torch.Tensor) -> type[Compressor]:
        return self._shoal_compressor_of.get(id(param), self._shoal_compression)

    def _shoal_setup_comm(self, model: nn.Module | None, comm: str, overrides: dict[Any, str] | None,
                          ps_config: PSConfig) -> None:  # fmt: skip
        self._shoal_comm = comm
        self._shoal_model = model
        self._shoal_overrides = dict(overrides or {})
        self._shoal_ps_config = ps_config
        self._shoal_ps: Any = None
        self._shoal_lr_of = {id(p): group for group in self.param_groups for p in group["params"]}
        self._shoal_compressor_of: dict[int, type[Compressor]] = {}
        self._shoal_sfb_of: dict[int, SufficientFactorLayer] = {}
        self._shoal_plans: list[LayerPlan] | None = None
        self._shoal_drift: DriftMonitor | None = None
        self._shoal_calibration: Calibration | None = None
        self._shoal_rows: dict[str, int] = {}
        self._shoal_row_hooks: list[Any] = []
        if model is None:
            if comm in ("sfb", "auto") or overrides:
                raise ValueError(f"comm={comm!r} and comm_overrides need model= (the nn.Module being trained)")
            if comm in ("fp16", "bf16"):
                self._shoal_compression = _SCHEME_COMPRESSION[comm]
            if comm == "ps":
                self._shoal_open_ps(self._shoal_params)
            return
        if comm == "auto":
            for name, module in model.named_modules():
                if isinstance(module, nn.Linear):
                    self._shoal_row_hooks.append(module.register_forward_hook(self._shoal_row_counter(name)))
            return
        schemes = {}
        for name, module in model.named_modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                forced = forced_scheme(name, module, self._shoal_overrides)
                default = "sfb" if comm == "sfb" and isinstance(module, nn.Linear) else comm
                schemes[name] = forced or default
        self._shoal_assign(schemes)

    def _shoal_row_counter(self, name: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            rows = args[0].numel() // args[0].shape[-1] if args[0].dim() else 1
            self._shoal_rows[name] = max(self._shoal_rows.get(name, 0), rows)

        return record

    def _shoal_assign(self, schemes: dict[str, str]) -> None:
        """Apply a scheme per module name: a compressor, or a sufficient-factor layer for ``sfb``."""
        assert self._shoal_model is not None
        modules = dict(self._shoal_model.named_modules())
        served: list[torch.Tensor] = []
        for name, scheme in schemes.items():
            module = modules[name]
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if scheme == "sfb":
                if not isinstance(module, nn.Linear):
                    raise ValueError(f"sfb needs an nn.Linear, but '{name}' is a {type(module).__name__}")
                if self._shoal_passes > 1:
                    get_logger().info("sfb is off for '%s': backward_passes_per_step > 1 accumulates gradients", name)
                    continue
                layer = SufficientFactorLayer(name or "model", module, self._shoal_process_set)
                for param in params:
                    self._shoal_sfb_of[id(param)] = layer
            elif scheme in _SCHEME_COMPRESSION:
                for param in params:
                    self._shoal_compressor_of[id(param)] = _SCHEME_COMPRESSION[scheme]
            elif scheme == "ps":
                served += params
            elif scheme != "allreduce":
                raise ValueError(f"scheme {scheme!r} for '{name}' is not available; choose from {SCHEMES}")
        if served:
            self._shoal_open_ps(served)

    def _shoal_open_ps(self, params: list[torch.Tensor]) -> None:
        """Route these parameters through the parameter server (joins its group on first use; every rank calls)."""
        from shoal.ps.connect import connect  # the PS joins its own group only when some layer uses it

        if self._shoal_process_set is not global_process_set:
            raise ValueError("comm='ps' works on the global process set only")
        from shoal.runtime.elastic_rendezvous import is_elastic_worker

        if is_elastic_worker():
            raise ValueError("comm='ps' is not available in elastic jobs yet: a server shard cannot move to new workers")
        owned = {id(p) for p in self._shoal_params}
        params = [p for p in dict.fromkeys(params) if id(p) in owned]
        if not params:
            return
        name, groups = describe_optimizer(self._shoal_base, self.param_groups)
        group_index = {id(p): i for i, group in enumerate(self.param_groups) for p in group["params"]}
        config = self._shoal_ps_config
        spec = {"optimizer": name, "groups": groups, "param_groups": [group_index[id(p)] for p in params],
                "mode": config.mode, "staleness": config.staleness, "average": self._shoal_op == ReduceOp.Average}  # fmt: skip
        client, store = connect(config)
        self._shoal_ps = client.open_session(params, [self._shoal_names[id(p)] for p in params], spec, store)

    def _shoal_apply_plan(self, calibration: Calibration | None = None) -> None:
        """Calibrate, agree on row counts, plan and switch schemes (all ranks): after the first step of
        ``comm="auto"``, and again with a refitted ``calibration`` when measurements drift from the plan."""
        refresh = calibration is not None
        assert self._shoal_model is not None
        for hook in self._shoal_row_hooks:
            hook.remove()
        self._shoal_row_hooks = []
        names = sorted(self._shoal_rows)
        rows = torch.tensor([self._shoal_rows[n] for n in names], dtype=torch.int64)
        if names and not refresh:
            rows = functions.allreduce(rows, op=functions.Max, name="DistributedOptimizer.plan.rows",
                                       process_set=self._shoal_process_set)  # fmt: skip
            self._shoal_rows = dict(zip(names, rows.tolist(), strict=True))
        calibration = calibration or job_calibration()
        self._shoal_calibration = calibration
        workers = self._shoal_process_set.size()
        dedicated = self._shoal_ps_config.dedicated
        # ps only when servers exist, and only in the first plan: one session holds a fixed set of layers, so a
        # re-plan keeps the layers already served (their optimizer state lives there) and adds none.
        allowed = SCHEMES if dedicated and self._shoal_ps is None else tuple(s for s in SCHEMES if s != "ps")
        overrides = dict(self._shoal_overrides)
        modules = dict(self._shoal_model.named_modules())
        if self._shoal_plans is not None:  # layers already on the servers stay there (their state lives there)
            overrides.update({modules[p.name]: "ps" for p in self._shoal_plans if p.choice == "ps"})
            self._shoal_clear_schemes()
        self._shoal_plans = build_plan(self._shoal_model, calibration, workers, self._shoal_rows, overrides, allowed,
                                       self._shoal_ps_config.num_servers if dedicated else workers)  # fmt: skip
        # With a session open, every ps layer of this plan is one it already serves (a re-plan adds none).
        self._shoal_assign({p.name: p.choice for p in self._shoal_plans
                            if not (p.choice == "ps" and self._shoal_ps is not None)})  # fmt: skip
        exchanges = {plan.name: self._shoal_exchange_names(plan, modules[plan.name]) for plan in self._shoal_plans}
        if self._shoal_drift is None:
            self._shoal_drift = DriftMonitor(self._shoal_plans, exchanges, calibration)
        else:
            self._shoal_drift.replan(self._shoal_plans, exchanges, calibration)
        global _last_plan
        _last_plan = LastPlan(self._shoal_plans, workers, self._shoal_drift.recalibrations, calibration)
        if basics.rank() == 0:  # one line per (re-)plan, so that the planner never works silently
            print(f"[shoal] comm='auto' {'re-planned' if refresh else 'planned'} {len(self._shoal_plans)} layers "
                  f"({describe_choices(self._shoal_plans)}) from {describe_calibration(calibration)}",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _shoal_clear_schemes(self) -> None:
        """Undo ``_shoal_assign`` (before a re-plan): drop SFB layers' hooks and per-layer compressors."""
        for layer in dict.fromkeys(self._shoal_sfb_of.values()):
            layer.remove()
        self._shoal_sfb_of.clear()
        self._shoal_compressor_of.clear()

    def _shoal_exchange_names(self, plan: LayerPlan, module: nn.Module) -> list[str]:
        """The engine request names that carry ``plan``'s layer's exchange (none for ps: not an engine collective)."""
        if plan.choice == "ps":
            return []
        if plan.choice == "sfb":
            base = f"DistributedOptimizer.sfb.{plan.name or 'model'}"
            return [f"{base}.input", f"{base}.output_grad"]
        return [f"DistributedOptimizer.{self._shoal_names[id(p)]}" for p in module.parameters(recurse=False)
                if p.requires_grad and id(p) in self._shoal_names]  # fmt: skip

    def _shoal_watch_drift(self) -> None:
        """After a synchronized step: compare measured exchange times with the plan; re-plan together on drift."""
        monitor = self._shoal_drift
        if monitor is None or not monitor.plans:
            return
        engine = handles.engine()
        set_id = set_id_of(self._shoal_process_set)
        rebuilds = {layer.name: layer.rebuild_seconds for layer in self._shoal_sfb_of.values()}
        monitor.record_step(lambda name: engine.execution(name, set_id), rebuilds)
        if not monitor.check_due():
            return
        local = torch.tensor(monitor.pending(), dtype=torch.float64)
        agreed = functions.allreduce(local, op=functions.Min, name="DistributedOptimizer.plan.measured",
                                     process_set=self._shoal_process_set)  # fmt: skip
        error = monitor.agree(agreed.tolist())
        if monitor.drifted():  # the same verdict on every rank: all hold the same agreed times
            log = get_logger().warning if basics.rank() == 0 else get_logger().debug  # said once, by rank 0
            log(
                "measured exchange times drift from the plan (median error %.0f%% for %d steps): "
                "recalibrating from the measurements and re-planning",
                100 * (error or 0.0),
                monitor.config.steps,
            )
            assert self._shoal_plans is not None and self._shoal_calibration is not None
            fitted = broadcast_object(refit(self._shoal_calibration, self._shoal_plans, monitor.terms,
                                            monitor.rebuilds), root_rank=0,
                                      name="DistributedOptimizer.plan.refit", process_set=self._shoal_process_set)  # fmt: skip
            keep_calibration(fitted)
            self._shoal_apply_plan(fitted)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` yourself first, e.g. to clip)."""
        self._shoal_should_synchronize = False
        try:
            yield
        finally:
            self._shoal_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Wait for the reduced gradients (unless inside ``skip_synchronize``), then apply the update."""
        already_synchronized = self._shoal_synchronized and not self._shoal_submitted  # the user called synchronize()
        if self._shoal_should_synchronize and not already_synchronized:
            self.synchronize()
        self._shoal_synchronized = False
        session = self._shoal_ps  # (auto may open one below; its layers were allreduced this step)
        if session is not None:
            session.finish()  # fresh values from the servers are now in p.data
        if self._shoal_comm == "auto":
            if self._shoal_plans is None:
                self._shoal_apply_plan()
            elif self._shoal_should_synchronize:
                self._shoal_watch_drift()
        with self._shoal_marks.span("UPDATE"):
            try:
                if session is None:
                    return self._shoal_base.step(self, closure)
                # The servers already applied the update to their parameters: hide them from the local optimizer.
                hidden = [(p, p.grad) for p in session.params]
                for param, _ in hidden:
                    param.grad = None
                try:
                    return self._shoal_base.step(self, closure)
                finally:
                    for param, grad in hidden:
                        param.grad = grad
            finally:
                self._shoal_marks.step_ended()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refuses while reductions are still writing into them."""
        if self._shoal_submitted or self._shoal_bucket:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): the gradient reductions in flight would be lost"
            )
        self._shoal_base.zero_grad(self, set_to_none)
        self._shoal_marks.step_ended()

    def _shoal_drop_step(self) -> None:
        """Forget the gradient exchanges of an unfinished step (elastic training, after a failed collective)."""
        for entry in self._shoal_in_flight:
            handles.discard(entry[0])
        self._shoal_in_flight.clear()
        self._shoal_sparse.clear()
        self._shoal_submitted.clear()
        self._shoal_group_ready.clear()
        self._shoal_bucket, self._shoal_bucket_size = [], 0
        self._shoal_counts = dict.fromkeys(self._shoal_counts, 0)
        self._shoal_synchronized = False
        self._shoal_marks.step_ended()
        for layer in dict.fromkeys(self._shoal_sfb_of.values()):
            layer.reset()
        for param in self._shoal_params:
            param.grad = None


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: list[list[torch.Tensor]] | int | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    bucket_bytes: int | None = None,
    *,
    model: nn.Module | None = None,
    comm: str = "allreduce",
    comm_overrides: dict[Any, str] | None = None,
    ps_mode: str | None = None,
    ps_staleness: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged across ranks, overlapping backprop.

    The returned object is an instance of a subclass of ``optimizer``'s class that shares its state, param groups
    and hyperparameters. Arguments follow ``horovod.torch.DistributedOptimizer``; ``groups`` is a list of parameter
    lists reduced together (or, as in Horovod, an int meaning ``num_groups``).

    ``bucket_bytes`` (Shoal's addition; default ``SHOAL_BUCKET_BYTES`` or 2 MiB) batches gradients that become
    ready one after another until this many bytes are waiting, then submits them together: each submission costs
    a negotiation cycle and a collective, which on CPU outweighs the overlap won by sending every small gradient
    alone. 0 submits every gradient the moment it is ready (pure wait-free backprop).

    Shoal's per-layer communication (Poseidon), keyword-only: ``comm`` is ``"allreduce"`` (default), ``"fp16"``,
    ``"bf16"``, ``"sfb"`` (sufficient factor broadcasting for every ``nn.Linear``) or ``"auto"`` (after the first
    step, calibrate the network and let the planner choose per layer; see ``plan_report()``). ``comm_overrides``
    forces a scheme per module name or type, e.g. ``{"fc1": "sfb", nn.Conv2d: "allreduce"}``. ``sfb``, ``auto`` and
    overrides need ``model=``.

    ``comm="ps"`` (or ``"ps"`` in ``comm_overrides``) routes parameters through the sharded parameter server: the
    hook pushes each gradient to the servers that own its pieces, the servers run this optimizer's class and
    hyperparameters (SGD or Adam/AdamW), and ``step()`` pulls the fresh values into ``p.data``. ``ps_mode`` is
    ``"bsp"`` (default; the same update as allreduce), ``"ssp"`` (stale synchronous, bound ``ps_staleness``) or
    ``"async"``; the environment fallbacks are ``SHOAL_PS_MODE`` and ``SHOAL_PS_STALENESS``. The servers are
    dedicated processes under ``shoalrun --num-servers S``, otherwise a thread in every worker (co-located).
    """
    if comm not in ("allreduce", "fp16", "bf16", "sfb", "ps", "auto"):
        raise ValueError(f"comm must be allreduce, fp16, bf16, sfb, ps or auto, got {comm!r}")
    ps_config = resolve_config(ps_mode, ps_staleness)
    if bucket_bytes is None:
        bucket_bytes = env_int("BUCKET_BYTES", DEFAULT_BUCKET_BYTES)
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    handles.engine()  # raises Horovod's ValueError before init()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if ReduceOp(op) == ReduceOp.Adasum and basics.size() > 1:  # as in Horovod: one rank needs no delta optimizer
        if process_set is not global_process_set or comm != "allreduce":
            raise NotImplementedError("op=Adasum supports the global process set and comm='allreduce' only")
        pairs = list(named_parameters) if named_parameters is not None else [(f"param.{i}", p) for i, p in enumerate(params)]
        by_id = {id(p): name for name, p in pairs}
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"named_parameters was given, but the optimizer has parameters that are not in it ({missing[:5]})")
        return adasum_optimizer.wrap(optimizer, by_id, compression, backward_passes_per_step)
    if isinstance(groups, int):
        num_groups, groups = groups, None
    if num_groups < 0:
        raise ValueError(f"num_groups must be >= 0, got {num_groups}")
    if num_groups and groups:
        raise ValueError("give either num_groups or groups, not both")
    if num_groups:
        count = min(num_groups, len(params))
        size, extra = divmod(len(params), count)
        groups, start = [], 0
        for index in range(count):
            stop = start + size + (1 if index < extra else 0)
            groups.append(params[start:stop])
            start = stop
    if groups:
        listed = [id(p) for group in groups for p in group]
        if len(set(listed)) != len(listed):
            raise ValueError("a parameter appears in more than one group")
        known = {id(p) for p in params}
        if any(key not in known for key in listed):
            raise ValueError("groups contain a tensor that is not a trainable parameter of this optimizer")
    wrapped = mix_into(optimizer, _DistributedOptimizer)
    named = list(named_parameters) if named_parameters is not None else None
    wrapped._shoal_setup(named, compression, backward_passes_per_step, ReduceOp(op), gradient_predivide_factor,
                         groups or None, sparse_as_dense, process_set, bucket_bytes)  # fmt: skip
    wrapped._shoal_setup_comm(model, comm, comm_overrides, ps_config)
    return wrapped
