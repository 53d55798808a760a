"""DistributedOptimizer: wait-free backprop (Poseidon) behind Horovod's optimizer wrapper.

Each parameter gets a post-accumulate-grad hook. The moment its gradient is final for the step, the hook submits an
asynchronous in-place allreduce, so the engine fuses and reduces late layers while earlier layers are still in
backprop. ``step()`` (or ``synchronize()``) waits for the results and then applies the wrapped optimizer's update.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.config import worker_settings
from shoal.core import basics
from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import ReduceOp, ReduceSpec, split_groups
from shoal.ps.config import resolve_config
from shoal.torch import adasum_optimizer, functions
from shoal.torch.compression import Compression, Compressor
from shoal.torch.layer_comm.router import COMM_CHOICES, LayerRouter, OptimizerFacts, plan_report
from shoal.torch.layer_comm.schemes import gradient_request_name
from shoal.torch.optimizer_class import computed_too_often, is_mixed_with, mix_into

__all__ = ["DistributedOptimizer", "drop_unfinished_step", "plan_report"]


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


_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
    "This can cause training slowdown. You may want to consider using optimizer.skip_synchronize() context if you "
    "use optimizer.synchronize() in your code."
)
"""Horovod's warning, word for word."""


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (so ``isinstance`` still holds)."""

    _shoal_base: type[torch.optim.Optimizer]
    _shoal_router: LayerRouter
    """Per-layer communication (schemes, the auto planner); set right after ``_shoal_setup``."""

    def _shoal_setup(
        self,
        named_parameters: list[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: list[list[torch.Tensor]] | None,
        sparse_as_dense: bool,
        process_set: ProcessSet,
        bucket_bytes: int,
    ) -> None:
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
        else:  # Horovod's names for unnamed parameters: group index, then position in the group
            self._shoal_names = {
                id(p): f"allreduce.noname.{i}.{j}"
                for i, group in enumerate(self.param_groups)
                for j, p in enumerate(group["params"])
            }
        # Horovod's attribute (code written for Horovod reads it): each parameter's name.
        self._parameter_names = {p: self._shoal_names[id(p)] for p in params}
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):  # Adasum here: a world of one rank
            raise ValueError(f"DistributedOptimizer supports op=Average or Sum, not {ReduceOp(op).name}")
        spec = ReduceSpec.for_gradients(op, gradient_predivide_factor)
        self._shoal_compression = compression
        self._shoal_passes = backward_passes_per_step
        self._shoal_op = ReduceOp(op)
        self._shoal_prescale = spec.prescale
        self._shoal_postscale = spec.postscale
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
        self._shoal_densified: dict[int, int] = {}
        """Parameters whose sparse gradient was reduced densely (sparse_as_dense), with its sparse dimensions: sparse
        again after the exchange."""
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
            raise computed_too_often(
                self._shoal_names[key],
                self._shoal_passes,
                "call optimizer.step() (or synchronize()) between backward passes, or raise "
                "backward_passes_per_step to accumulate locally",
            )
        self._shoal_counts[key] += 1
        if self._shoal_counts[key] < self._shoal_passes:
            return
        self._shoal_counts[key] = 0
        if self._shoal_router.takes(param):  # its scheme sends it (SFB's factors, the parameter server)
            self._shoal_submitted.add(key)
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
            self._shoal_densified[id(param)] = param.grad.sparse_dim()
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
        compressors = [self._shoal_compressor(p) for p in dense]
        with self._shoal_cast_span(compressors):
            packed = [c.compress(self._shoal_grad(p)) for c, p in zip(compressors, dense, strict=True)]
        names = [gradient_request_name(self._shoal_names[id(p)]) for p in dense]
        handle = functions.allreduce_named_async_(
            [c for c, _ in packed], names, self._shoal_op, self._shoal_prescale, self._shoal_postscale, self._shoal_process_set
        )
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
        layers = self._shoal_router.layers()
        missing = [p for p in self._shoal_params if id(p) not in self._shoal_submitted]
        for layer in layers:
            self._shoal_submitted.update(id(p) for p in layer.claim_missing(missing))
        missing = [p for p in self._shoal_params if id(p) not in self._shoal_submitted]
        if missing:  # no gradient this step here (or a layer that fell back): stand in, so no rank ever hangs
            self._shoal_submit(missing)
        for layer in reversed(layers):  # backward's order: the last layers' exchanges were the first to leave
            layer.finish(average=self._shoal_op == ReduceOp.Average)
        for handle, params, compressed_list, contexts in self._shoal_in_flight:
            handles.synchronize(handle)
            compressors = [self._shoal_compressor(p) for p in params]
            with self._shoal_cast_span(compressors):
                for param, compressor, compressed, ctx in zip(params, compressors, compressed_list, contexts, strict=True):
                    if compressed is not param.grad:
                        assert param.grad is not None
                        param.grad.copy_(compressor.decompress(compressed, ctx))
        for param in self._shoal_sparse:
            param.grad = self._shoal_sparse_allreduce(param.grad, self._shoal_names[id(param)])
        for param in self._shoal_params:
            # As Horovod does: a gradient that was sparse is sparse again (SparseAdam refuses dense ones).
            if id(param) in self._shoal_densified and param.grad is not None:
                param.grad = param.grad.to_sparse(self._shoal_densified[id(param)])
        self._shoal_densified.clear()
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
        result = functions.sparse_allreduce_async(grad, gradient_request_name(name), op, self._shoal_process_set)
        return result().coalesce()

    def _shoal_cast_span(self, compressors: list[type[Compressor]]) -> contextlib.AbstractContextManager[None]:
        """A CAST span on the timeline's compute row around casts (nothing to mark without one)."""
        if all(c is Compression.none for c in compressors):
            return contextlib.nullcontext()
        return self._shoal_marks.span("CAST")

    def _shoal_compressor(self, param: torch.Tensor) -> type[Compressor]:
        """The buckets' compressor for ``param``: its layer scheme's (fp16/bf16), else the optimizer's."""
        return self._shoal_router.compressor(param) or self._shoal_compression

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
        if self._shoal_should_synchronize and already_synchronized:
            # Horovod's warning; Horovod then reduces again, Shoal keeps the reduced gradients as they are.
            warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=2)
        if self._shoal_should_synchronize and not already_synchronized:
            self.synchronize()
        self._shoal_synchronized = False
        # The servers already applied their layers' update (and their values are in p.data now): hide those
        # parameters from the local optimizer.
        hidden = [(p, p.grad) for p in self._shoal_router.start_update(self._shoal_should_synchronize)]
        with self._shoal_marks.span("UPDATE"):
            for param, _ in hidden:
                param.grad = None
            try:
                return self._shoal_base.step(self, closure)
            finally:
                for param, grad in hidden:
                    param.grad = grad
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
        self._shoal_densified.clear()
        self._shoal_submitted.clear()
        self._shoal_group_ready.clear()
        self._shoal_bucket, self._shoal_bucket_size = [], 0
        self._shoal_counts = dict.fromkeys(self._shoal_counts, 0)
        self._shoal_synchronized = False
        self._shoal_marks.step_ended()
        for layer in self._shoal_router.layers():
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
    if comm not in COMM_CHOICES:
        raise ValueError(f"comm must be one of {', '.join(COMM_CHOICES)}, got {comm!r}")
    ps_config = resolve_config(ps_mode, ps_staleness)
    if bucket_bytes is None:
        bucket_bytes = worker_settings().bucket_bytes
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    handles.engine()  # raises Horovod's ValueError before init()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if ReduceOp(op) == ReduceOp.Adasum and basics.size() > 1:  # as in Horovod: one rank needs no delta optimizer
        if process_set is not global_process_set or comm != "allreduce":
            raise NotImplementedError("op=Adasum supports the global process set and comm='allreduce' only")
        # Horovod's Adasum optimizer names unnamed parameters by their position alone.
        pairs = (
            list(named_parameters)
            if named_parameters is not None
            else [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
        )
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
        groups = split_groups(params, min(num_groups, len(params)))
    if groups:
        listed = [id(p) for group in groups for p in group]
        if len(set(listed)) != len(listed):
            raise ValueError("a parameter appears in more than one group")
        known = {id(p) for p in params}
        if any(key not in known for key in listed):
            raise ValueError("groups contain a tensor that is not a trainable parameter of this optimizer")
    wrapped = mix_into(optimizer, _DistributedOptimizer)
    named = list(named_parameters) if named_parameters is not None else None
    wrapped._shoal_setup(
        named,
        compression,
        backward_passes_per_step,
        ReduceOp(op),
        gradient_predivide_factor,
        groups or None,
        sparse_as_dense,
        process_set,
        bucket_bytes,
    )
    facts = OptimizerFacts(
        wrapped._shoal_params,
        wrapped._shoal_names,
        wrapped.param_groups,
        wrapped._shoal_base,
        ReduceOp(op) == ReduceOp.Average,
        backward_passes_per_step,
        process_set,
    )
    wrapped._shoal_router = LayerRouter(facts, model, comm, comm_overrides, ps_config)
    return wrapped


def drop_unfinished_step(optimizer: torch.optim.Optimizer) -> None:
    """Forget the gradient exchanges of an unfinished step (elastic recovery after a failed collective); a no-op
    for an optimizer that is not a ``DistributedOptimizer``."""
    if is_mixed_with(optimizer, _DistributedOptimizer):
        optimizer._shoal_drop_step()  # type: ignore[attr-defined]
