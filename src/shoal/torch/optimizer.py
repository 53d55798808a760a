"""DistributedOptimizer: wait-free backprop (Poseidon) behind Horovod's optimizer wrapper.

Each parameter gets a post-accumulate-grad hook. The moment its gradient is final for the step, the hook submits an
asynchronous in-place allreduce, so the engine fuses and reduces late layers while earlier layers are still in
backprop. ``step()`` (or ``synchronize()``) waits for the results and then applies the wrapped optimizer's update.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.config import worker_setting
from shoal.core import basics
from shoal.core import session as handles
from shoal.core.balance import check_balanced_reduction
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.requests import barrier
from shoal.core.rules import ReduceOp, resolve_groups, split_groups
from shoal.plan.far import LocalSteps
from shoal.plan.schemes import Compressed, Planned, forces_outer, parse_comm
from shoal.ps.config import resolve_config
from shoal.torch.balanced_loader import BalancedLoader
from shoal.torch.compression import Compression, Compressor
from shoal.torch.exchange import AdasumExchange, GradientExchange
from shoal.torch.far_choice import FarChoice
from shoal.torch.host_groups import host_groups, local_options
from shoal.torch.layer_comm.carriers import OptimizerFacts
from shoal.torch.layer_comm.report import plan_report
from shoal.torch.layer_comm.router import LayerRouter
from shoal.torch.local_steps import OuterFactory, OuterRounds
from shoal.torch.micro_batch_grads import MicroBatchWeights, check_ordered_params
from shoal.torch.optimizer_class import is_mixed_with, mix_into
from shoal.torch.param_names import parameter_names

__all__ = ["DistributedOptimizer", "LocalSteps", "drop_unfinished_step", "plan_report", "rounds_of"]


_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
    "This can cause training slowdown. You may want to consider using optimizer.skip_synchronize() context if you "
    "use optimizer.synchronize() in your code."
)
"""Horovod's warning, word for word."""


def exchange_of(optimizer: torch.optim.Optimizer) -> GradientExchange:
    """The gradient exchange of a Shoal ``DistributedOptimizer`` (its buckets, sparse gradients, shared memory and
    router): what the benchmarks and the tests inspect.

    Raises:
        TypeError: ``optimizer`` is not a Shoal ``DistributedOptimizer`` (or is Adasum's, which has no such exchange).
    """
    exchange = getattr(optimizer, "_shoal_exchange", None)
    if not isinstance(exchange, GradientExchange):
        raise TypeError(f"exchange_of takes a Shoal DistributedOptimizer, not {type(optimizer).__name__}")
    return exchange


def router_of(optimizer: torch.optim.Optimizer) -> LayerRouter:
    """The per-layer communication (schemes, the ``auto`` planner, drift) of a Shoal ``DistributedOptimizer``.

    Raises:
        TypeError: ``optimizer`` is not a Shoal ``DistributedOptimizer``.
    """
    return exchange_of(optimizer).router


def rounds_of(optimizer: torch.optim.Optimizer) -> OuterRounds | None:
    """The outer rounds of a ``DistributedOptimizer`` with local steps (``comm="local"``), else None."""
    return getattr(optimizer, "_shoal_outer", None)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Horovod's optimizer surface, mixed into a subclass of the user's optimizer class (so ``isinstance`` still
    holds); every step's state and work is the ``GradientExchange``'s, and with local steps the ``OuterRounds``'."""

    _shoal_base: type[torch.optim.Optimizer]
    _shoal_exchange: GradientExchange
    _shoal_outer: OuterRounds | None = None

    def _shoal_compressor(self, param: torch.Tensor) -> type[Compressor]:
        return self._shoal_exchange.compressor(param)

    def synchronize(self) -> None:
        """Wait for every gradient reduction of this step (submitting any a parameter never started)."""
        self._shoal_exchange.wait()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` yourself first, e.g. to clip)."""
        self._shoal_exchange.skip_synchronize = True
        try:
            yield
        finally:
            self._shoal_exchange.skip_synchronize = False

    def step(self, closure: Any = None) -> Any:
        """Wait for the reduced gradients (unless inside ``skip_synchronize``), then apply the update."""
        exchange = self._shoal_exchange
        should_synchronize = not exchange.skip_synchronize
        already_synchronized = exchange.synchronized and not exchange.pending  # the user called synchronize()
        if should_synchronize and already_synchronized:
            # Horovod's warning; Horovod then reduces again, Shoal keeps the reduced gradients as they are.
            warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=2)
        waited = time.perf_counter()
        if should_synchronize and not already_synchronized:
            exchange.wait()
        waited = time.perf_counter() - waited
        exchange.synchronized = False
        # The servers already applied their layers' update (and their values are in p.data now): hide those
        # parameters from the local optimizer.
        hidden = [(p, p.grad) for p in exchange.router.start_update(should_synchronize)]
        with exchange.marks.span("UPDATE"):
            for param, _ in hidden:
                param.grad = None
            try:
                loss = self._shoal_base.step(self, closure)
            finally:
                for param, grad in hidden:
                    param.grad = grad
                exchange.marks.step_ended()
        if self._shoal_outer is not None and should_synchronize:
            self._shoal_outer.after_step(waited)
        return loss

    def outer_step(self) -> bool:
        """With local steps (``comm="local"``, or ``"auto-far"`` once it chose them): make the hosts meet now, whatever
        the round's length: land the exchange in flight, then average the hosts' weights; return once every rank has.
        Call it on every rank at the same step, at the end of training: the inner steps since the last round are
        otherwise lost, and a host that shuts down first would end the others' exchanges. Returns whether anything
        was exchanged (False without local steps, or without inner steps since the last round)."""
        outer = self._shoal_outer
        if outer is None:
            return False
        ran = outer.finish()
        barrier()
        return ran

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refuses while reductions are still writing into them."""
        if self._shoal_exchange.pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): the gradient reductions in flight would be lost"
            )
        self._shoal_base.zero_grad(self, set_to_none)
        self._shoal_exchange.marks.step_ended()


class _AdasumOptimizer(torch.optim.Optimizer):
    """Horovod's Adasum optimizer surface (see ``AdasumExchange``), mixed in the same way."""

    _shoal_base: type[torch.optim.Optimizer]
    _shoal_exchange: AdasumExchange

    def synchronize(self) -> None:
        """Horovod's Adasum optimizer synchronizes in ``step()``; this does nothing, as there."""

    def skip_synchronize(self) -> Any:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def step(self, closure: Any = None) -> Any:
        """Exchange any delta not started yet (no gradient this step), then apply old value + combined delta."""
        loss = closure() if closure is not None else None
        self._shoal_exchange.apply()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refuses while exchanges are in flight."""
        if self._shoal_exchange.pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        self._shoal_base.zero_grad(self, set_to_none)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] | Compressed = Compression.none,
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
    comm_overrides: dict[Any, Any] | None = None,
    ps_mode: str | None = None,
    ps_staleness: int | None = None,
    loader: BalancedLoader | None = None,
    every: int | None = None,
    local_steps: LocalSteps | None = None,
    outer_optimizer: OuterFactory | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged across ranks, overlapping backprop.

    The returned object is an instance of a subclass of ``optimizer``'s class that shares its state, param groups
    and hyperparameters. Arguments follow ``horovod.torch.DistributedOptimizer``; ``groups`` is a list of parameter
    lists reduced together (or, as in Horovod, an int meaning ``num_groups``).

    ``bucket_bytes`` (Shoal's addition; default: the ``BUCKET_BYTES`` knob or 2 MiB) batches gradients that become
    ready one after another until this many bytes are waiting, then submits them together: each submission costs
    a negotiation cycle and a collective, which on CPU outweighs the overlap won by sending every small gradient
    alone. 0 submits every gradient the moment it is ready (pure wait-free backprop).

    Shoal's per-layer communication (Poseidon), keyword-only: ``comm`` is ``"allreduce"`` (default), ``"fp16"``,
    ``"bf16"``, ``"sfb"`` (sufficient factor broadcasting for every ``nn.Linear``) or ``"auto"`` (after the first
    step, calibrate the network and let the planner choose per layer; see ``plan_report()``). ``comm_overrides``
    forces a scheme per module name or type, e.g. ``{"fc1": "sfb", nn.Conv2d: "allreduce"}``. ``sfb``, ``auto`` and
    overrides need ``model=``. ``compression=Compression.powersgd(rank=4)`` or ``.topk(ratio=0.01)`` compress with
    error feedback (lossy); ``comm="auto-lossy"`` lets the planner choose them per layer (docs/communication.md).

    ``comm="ps"`` (or ``"ps"`` in ``comm_overrides``) routes parameters through the sharded parameter server: the
    hook pushes each gradient to the servers that own its pieces, the servers run this optimizer's class and
    hyperparameters (SGD or Adam/AdamW), and ``step()`` pulls the fresh values into ``p.data``. ``ps_mode`` is
    ``"bsp"`` (default; the same update as allreduce), ``"ssp"`` (stale synchronous, bound ``ps_staleness``) or
    ``"async"``; the environment fallbacks are the ``PS_MODE`` and ``PS_STALENESS`` knobs (docs/knobs.md). The servers are
    dedicated processes under ``shoalrun --num-servers S``, otherwise a thread in every worker (co-located).

    ``loader``: a ``BalancedLoader`` whose steps this optimizer reduces, each rank's gradient weighted so that the
    average is one process's mean gradient over the whole global batch, with any share (``micro_batch_grads``).
    Needs ``op=Average``, ``backward_passes_per_step=1`` and the global set; ``sfb`` layers fall back to allreduce.

    ``comm="local"``: local steps with outer updates (DiLoCo) for far-apart hosts, every ``every`` steps, with
    ``local_steps=LocalSteps(...)`` and ``outer_optimizer`` (a callable over the parameters), as docs/far.md says.
    """
    mode = parse_comm(comm)  # a ValueError lists the choices
    local = local_options(mode, every, local_steps, outer_optimizer)
    compressed, compression, comm = _split_compression(compression, comm)
    ps_config = resolve_config(ps_mode, ps_staleness)
    bucket_bytes = _bucket_bytes(bucket_bytes)
    handles.engine()  # raises Horovod's ValueError before init()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if loader is not None:
        _check_balanced(loader, ReduceOp(op), backward_passes_per_step, process_set, comm, comm_overrides, compression, params)
    hosts = host_groups(mode, local, ReduceOp(op), process_set, compressed is not None or bool(comm_overrides), bool(loader))
    process_set = hosts.inner if hosts is not None and forces_outer(mode) else process_set
    if ReduceOp(op) == ReduceOp.Adasum and basics.size() > 1:  # as in Horovod: one rank needs no delta optimizer
        if process_set is not global_process_set or comm != "allreduce":
            raise NotImplementedError("op=Adasum supports the global process set and comm='allreduce' only")
        wrapped, names = _adasum(optimizer, params, named_parameters, compression, backward_passes_per_step)
    else:
        names = parameter_names(optimizer.param_groups, named_parameters)
        router = functools.partial(LayerRouter, model=model, comm=comm, overrides=comm_overrides, ps_config=ps_config)
        make_exchange = functools.partial(
            GradientExchange,
            compression=compression,
            passes=backward_passes_per_step,
            op=ReduceOp(op),
            gradient_predivide_factor=gradient_predivide_factor,
            groups=_checked_groups(params, groups, num_groups),
            sparse_as_dense=sparse_as_dense,
            bucket_bytes=bucket_bytes,
        )
        facts = functools.partial(
            OptimizerFacts,
            params,
            names,
            average=ReduceOp(op) == ReduceOp.Average,
            passes=0 if loader is not None else backward_passes_per_step,
            process_set=process_set,
        )
        wrapped = _wrap_gradients(optimizer, make_exchange, router, compressed, loader, facts)
        if local is not None and hosts is not None:
            weigh = FarChoice(wrapped._shoal_exchange, hosts) if mode is Planned.AUTO_FAR else None
            wrapped._shoal_outer = OuterRounds(params, local, hosts, outer_optimizer, weigh)
    # Horovod's attribute (code written for Horovod reads it): each parameter's name.
    wrapped._parameter_names = {p: names[id(p)] for group in wrapped.param_groups for p in group["params"] if id(p) in names}
    wrapped._shoal_exchange.attach()
    return wrapped


def _bucket_bytes(given: int | None) -> int:
    """The bucket size: ``given``, else the ``bucket_bytes`` setting; never negative."""
    chosen: int = worker_setting("bucket_bytes") if given is None else given
    if chosen < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {chosen}")
    return chosen


def _adasum(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    named_parameters: Any,
    compression: type[Compressor],
    passes: int,
) -> tuple[Any, dict[int, str]]:
    """``optimizer`` mixed with Horovod's Adasum surface over an ``AdasumExchange``, and the parameters' names."""
    names = parameter_names(optimizer.param_groups, named_parameters, adasum=True)
    wrapped = mix_into(optimizer, _AdasumOptimizer)
    wrapped._shoal_exchange = AdasumExchange(wrapped, params, names, compression, passes)
    return wrapped, names


def _wrap_gradients(
    optimizer: torch.optim.Optimizer,
    exchange: Callable[[LayerRouter, MicroBatchWeights | None], GradientExchange],
    router: Callable[..., LayerRouter],
    compressed: Compressed | None,
    loader: BalancedLoader | None,
    facts: Callable[..., OptimizerFacts],
) -> _DistributedOptimizer:
    """``optimizer`` mixed with Horovod's surface over its exchange (``exchange(router, weights)``): its router
    built (``router(facts(param_groups=..., base=...), compressed=...)``) and, with a balanced loader, the micro-batch
    weights the loader drives."""
    wrapped = mix_into(optimizer, _DistributedOptimizer)
    layers = router(facts(param_groups=wrapped.param_groups, base=wrapped._shoal_base), compressed=compressed)
    weights = MicroBatchWeights(loader.deterministic) if loader is not None else None
    wrapped._shoal_exchange = exchange(layers, weights)
    if loader is not None:
        loader.attach(wrapped._shoal_exchange)
    return wrapped


def _split_compression(
    compression: type[Compressor] | Compressed, comm: str
) -> tuple[Compressed | None, type[Compressor], str]:
    """``compression=Compression.powersgd(...)`` or ``.topk(...)``: that scheme for every layer (with the default
    ``comm="allreduce"``), or its settings for ``comm="auto-lossy"``'s plan; the buckets then send plain gradients.
    Returns (the compressed scheme or None, the buckets' compressor, comm)."""
    if not isinstance(compression, Compressed):
        return None, compression, comm
    if comm == "allreduce":
        return compression, Compression.none, compression.scheme.value
    if comm in ("auto-lossy", compression.scheme.value):
        return compression, Compression.none, comm
    raise ValueError(
        f"compression={compression.scheme.value} sets the scheme of every layer, or its settings with comm='auto-lossy'; "
        f"it cannot go with comm={comm!r}"
    )


def _check_balanced(
    loader: BalancedLoader,
    op: ReduceOp,
    passes: int,
    process_set: ProcessSet,
    comm: str,
    overrides: dict[Any, str] | None,
    compression: type[Compressor],
    params: list[torch.Tensor],
) -> None:
    """What ``loader=`` needs of the optimizer's other arguments and parameters.

    Raises:
        ValueError: an argument the balanced global batch cannot honour.
    """
    if not isinstance(loader, BalancedLoader):
        raise ValueError(f"loader must be a shoal.torch.BalancedLoader, got {type(loader).__name__}")
    check_balanced_reduction(op, passes, process_set, "backward_passes_per_step")
    if loader.deterministic and (comm != "allreduce" or overrides or compression is not Compression.none):
        raise ValueError("BalancedLoader(deterministic=True) sums exact rows: use comm='allreduce' and no compression")
    if loader.deterministic:
        check_ordered_params(params)


def _checked_groups(
    params: list[torch.Tensor], groups: list[list[torch.Tensor]] | int | None, num_groups: int
) -> list[list[torch.Tensor]] | None:
    """Horovod's ``groups``/``num_groups`` (``rules.resolve_groups``): the parameter lists reduced together, checked,
    or None."""
    groups = resolve_groups(num_groups, groups)
    if isinstance(groups, int):
        groups = split_groups(params, min(groups, len(params)))
    if groups:
        listed = [id(p) for group in groups for p in group]
        if len(set(listed)) != len(listed):
            raise ValueError("a parameter appears in more than one group")
        known = {id(p) for p in params}
        if any(key not in known for key in listed):
            raise ValueError("groups contain a tensor that is not a trainable parameter of this optimizer")
    return groups or None


def drop_unfinished_step(optimizer: torch.optim.Optimizer) -> None:
    """Forget the gradient exchanges of an unfinished step (elastic recovery after a failed collective); a no-op
    for an optimizer that is not a ``DistributedOptimizer``."""
    if is_mixed_with(optimizer, _DistributedOptimizer) or is_mixed_with(optimizer, _AdasumOptimizer):
        optimizer._shoal_exchange.reset(discard=True)  # type: ignore[attr-defined]
