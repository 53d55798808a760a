"""DistributedOptimizer: wait-free backprop (Poseidon) behind Horovod's optimizer wrapper.

Each parameter gets a post-accumulate-grad hook. The moment its gradient is final for the step, the hook submits an
asynchronous in-place allreduce, so the engine fuses and reduces late layers while earlier layers are still in
backprop. ``step()`` (or ``synchronize()``) waits for the results and then applies the wrapped optimizer's update.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.core import basics
from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.requests import barrier
from shoal.core.rules import ReduceOp
from shoal.plan.far import LocalSteps
from shoal.plan.schemes import Compressed, Planned, Scheme, forces_outer, parse_comm
from shoal.ps.config import resolve_config
from shoal.torch.balanced_loader import BalancedLoader
from shoal.torch.compression import Compression, Compressor
from shoal.torch.exchange import GradientExchange
from shoal.torch.exchange.scattered import ScatteredGradients
from shoal.torch.far_choice import FarChoice
from shoal.torch.host_groups import HostGroups, host_groups, local_options
from shoal.torch.layer_comm.carriers import OptimizerFacts
from shoal.torch.layer_comm.report import plan_report
from shoal.torch.layer_comm.router import LayerRouter
from shoal.torch.local_steps import OuterFactory, OuterRounds
from shoal.torch.micro_batch_grads import MicroBatchWeights
from shoal.torch.optimizer_adasum import AdasumOptimizer, wrap_adasum
from shoal.torch.optimizer_args import bucket_bytes_of, check_balanced, checked_groups, split_compression
from shoal.torch.optimizer_class import is_mixed_with, mix_into
from shoal.torch.param_names import parameter_names
from shoal.torch.sharding import Shard, ShardedOptimizer, shard_optimizer

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
    _shoal_shards: ShardedOptimizer | None = None

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
                loss = self._shoal_step(closure)
            finally:
                for param, grad in hidden:
                    param.grad = grad
                exchange.marks.step_ended()
        if self._shoal_outer is not None and should_synchronize:
            self._shoal_outer.after_step(waited)
        return loss

    def _shoal_step(self, closure: Any) -> Any:
        """The update: the user's optimizer on the whole parameters, or, sharded, on this rank's shards (then the
        values are gathered)."""
        shards = self._shoal_shards
        if shards is None:
            return self._shoal_base.step(self, closure)
        if self._shoal_exchange.scattered is None:  # stage 1: the reduced gradients are whole in p.grad
            shards.take_grads()
        return shards.step(closure, self.param_groups)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradients so that their norm over the whole model is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does; return the norm before clipping. Call it on every rank after
        ``synchronize()``, then ``step()`` inside ``skip_synchronize()``. With ``shard='gradients'`` the reduced
        gradients exist only in the ranks' shards, and this is how to clip them (the norm is taken across shards).

        Raises:
            RuntimeError: gradient reductions are still in flight (call ``synchronize()`` first).
        """
        if self._shoal_exchange.pending:
            raise RuntimeError("clip_grad_norm_ needs the reduced gradients: call optimizer.synchronize() first")
        shards = self._shoal_shards
        if shards is not None and self._shoal_exchange.scattered is not None:
            return shards.clip_grad_norm_(max_norm, norm_type)
        params = [p for group in self.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state in torch's own form; sharded, gathered whole from every rank (call it on all)."""
        packed = self._shoal_base.state_dict(self)
        if self._shoal_shards is not None:
            packed["state"] = self._shoal_shards.full_state(_indices(self.param_groups))
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state in torch's own form (from any world size, sharded or not); sharded, each rank keeps only its
        pieces, without communicating (``broadcast_optimizer_state`` then hands a root's load to every rank)."""
        shards = self._shoal_shards
        if shards is None:
            self._shoal_base.load_state_dict(self, state_dict)
            return
        self._shoal_base.load_state_dict(self, {**state_dict, "state": {}})
        state = {int(k): v for k, v in state_dict["state"].items()}
        shards.load_full_state(state, _indices(self.param_groups))
        shards.loaded = state_dict

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
    shard: str | int | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged across ranks, overlapping backprop.

    The returned object is an instance of a subclass of ``optimizer``'s class that shares its state, param groups
    and hyperparameters. Arguments follow ``horovod.torch.DistributedOptimizer``; ``groups`` is a list of parameter
    lists reduced together (or, as in Horovod, an int meaning ``num_groups``).

    ``bucket_bytes`` (default: the ``BUCKET_BYTES`` knob or 2 MiB) batches gradients ready one after another until
    this many bytes wait, then submits them together (each submission costs a negotiation cycle and a collective,
    which on CPU outweighs the overlap won by sending each small gradient alone); 0 sends each the moment it is ready.

    Shoal's per-layer communication (Poseidon), keyword-only: ``comm`` is ``"allreduce"`` (default), ``"fp16"``,
    ``"bf16"``, ``"sfb"`` (sufficient factor broadcasting for every ``nn.Linear``) or ``"auto"`` (after the first
    step, calibrate the network and let the planner choose per layer; see ``plan_report()``). ``comm_overrides``
    forces a scheme per module name or type, e.g. ``{"fc1": "sfb", nn.Conv2d: "allreduce"}``. ``sfb``, ``auto`` and
    overrides need ``model=``. ``compression=Compression.powersgd(rank=4)`` or ``.topk(ratio=0.01)`` compress with
    error feedback (lossy); ``comm="auto-lossy"`` lets the planner choose them per layer (docs/communication.md).

    ``comm="ps"`` routes parameters through the sharded parameter server (docs/communication.md): ``ps_mode`` is
    ``"bsp"`` (default; the same update as allreduce), ``"ssp"`` (stale synchronous, bound ``ps_staleness``) or
    ``"async"`` (fallbacks: the ``PS_MODE`` and ``PS_STALENESS`` knobs).

    ``loader``: a ``BalancedLoader`` whose steps this optimizer reduces, each rank's gradient weighted so that the
    average is one process's mean gradient over the whole global batch, with any share (``micro_batch_grads``).
    Needs ``op=Average``, ``backward_passes_per_step=1`` and the global set; ``sfb`` layers fall back to allreduce.

    ``comm="local"``: local steps with outer updates (DiLoCo) for far-apart hosts, every ``every`` steps, with
    ``local_steps=LocalSteps(...)`` and ``outer_optimizer`` (a callable over the parameters), as docs/far.md says.

    ``shard`` (ZeRO, docs/sharding.md): ``"optimizer"`` or 1 keeps 1/N of the optimizer state on each rank,
    ``"gradients"`` or 2 also 1/N of the reduced gradients; None (default) or 0 shards nothing.
    """
    mode = parse_comm(comm)  # a ValueError lists the choices
    local = local_options(mode, every, local_steps, outer_optimizer)
    compressed, compression, comm = split_compression(compression, comm)
    bucket_bytes = bucket_bytes_of(bucket_bytes)
    handles.engine()  # raises Horovod's ValueError before init()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    overridden = compressed is not None or bool(comm_overrides)
    named = None if named_parameters is None else list(named_parameters)  # read twice below
    shards = shard_optimizer(optimizer, params, named, Shard.parse(shard), mode, overridden, process_set, bucket_bytes)
    check_balanced(loader, ReduceOp(op), backward_passes_per_step, process_set, comm, comm_overrides, compression, params)
    hosts = host_groups(mode, local, ReduceOp(op), process_set, overridden, bool(loader))
    process_set = hosts.inner if hosts is not None and forces_outer(mode) else process_set
    if ReduceOp(op) == ReduceOp.Adasum and basics.size() > 1:  # as in Horovod: one rank needs no delta optimizer
        if process_set is not global_process_set or comm != "allreduce" or shards is not None:
            raise NotImplementedError("op=Adasum supports the global process set, comm='allreduce' and no shard only")
        wrapped, names = wrap_adasum(optimizer, params, named, compression, backward_passes_per_step)
    else:
        names = parameter_names(optimizer.param_groups, named)
        ps_config = resolve_config(ps_mode, ps_staleness)
        router = functools.partial(LayerRouter, model=model, comm=comm, overrides=comm_overrides, ps_config=ps_config)
        make_exchange = functools.partial(
            GradientExchange,
            compression=compression,
            passes=backward_passes_per_step,
            op=ReduceOp(op),
            gradient_predivide_factor=gradient_predivide_factor,
            groups=checked_groups(params, groups, num_groups),
            sparse_as_dense=sparse_as_dense,
            bucket_bytes=bucket_bytes,
            scattered=_scattered(shards, mode, compression),
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
        _attach(wrapped, shards, _outer_rounds(wrapped._shoal_exchange, params, mode, local, hosts, outer_optimizer))
    # Horovod's attribute (code written for Horovod reads it): each parameter's name.
    wrapped._parameter_names = {p: names[id(p)] for group in wrapped.param_groups for p in group["params"] if id(p) in names}
    wrapped._shoal_exchange.attach()
    return wrapped


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


def _attach(wrapped: _DistributedOptimizer, shards: ShardedOptimizer | None, outer: OuterRounds | None) -> None:
    """Give the optimizer the parts that exist (its shards, its outer rounds): where one is None the class's None
    stands, so the user's optimizer holds no more than it needs."""
    if shards is not None:
        wrapped._shoal_shards = shards
    if outer is not None:
        wrapped._shoal_outer = outer


def _outer_rounds(
    exchange: GradientExchange,
    params: list[torch.Tensor],
    mode: Scheme | Planned,
    local: LocalSteps | None,
    hosts: HostGroups | None,
    outer_optimizer: OuterFactory | None,
) -> OuterRounds | None:
    """The outer rounds of local steps (``comm="local"``, or ``"auto-far"``, which may choose them), else None."""
    if local is None or hosts is None:
        return None
    weigh = FarChoice(exchange, hosts) if mode is Planned.AUTO_FAR else None
    return OuterRounds(params, local, hosts, outer_optimizer, weigh)


def _scattered(
    shards: ShardedOptimizer | None, mode: Scheme | Planned, compression: type[Compressor]
) -> ScatteredGradients | None:
    """Stage 2's part of the exchange (its reduce-scatters cast as ``comm`` or ``compression`` says), else None."""
    if shards is None or shards.stage is not Shard.GRADIENTS:
        return None
    casts: dict[Scheme | Planned, type[Compressor]] = {Scheme.FP16: Compression.fp16, Scheme.BF16: Compression.bf16}
    return ScatteredGradients(shards, casts.get(mode, compression))


def _indices(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """Each parameter's index in torch's state dict (its place across the param groups), by ``id``."""
    return {id(p): i for i, p in enumerate(p for group in param_groups for p in group["params"])}


def reshard(optimizer: torch.optim.Optimizer, committed: dict[str, Any]) -> None:
    """After an elastic re-form: a sharded ``DistributedOptimizer`` takes its pieces of the new world and loads them
    from ``committed``, the whole state of the last commit (the pieces a departed rank held exist nowhere else);
    ``broadcast_optimizer_state`` then hands rank 0's commit to every rank. A no-op for any other optimizer."""
    shards = getattr(optimizer, "_shoal_shards", None)
    if shards is None:
        return
    shards.relayout(shards.layout.for_world(basics.size(), basics.rank()))
    optimizer.load_state_dict(copy.deepcopy(committed))


def drop_unfinished_step(optimizer: torch.optim.Optimizer) -> None:
    """Forget the gradient exchanges of an unfinished step (elastic recovery after a failed collective); a no-op
    for an optimizer that is not a ``DistributedOptimizer``."""
    if is_mixed_with(optimizer, _DistributedOptimizer) or is_mixed_with(optimizer, AdasumOptimizer):
        optimizer._shoal_exchange.reset(discard=True)  # type: ignore[attr-defined]
