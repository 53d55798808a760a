"""The gradient exchanges behind ``DistributedOptimizer``: each step's state and work, kept off the user's optimizer.

A ``GradientExchange`` owns one step of wait-free backprop (Poseidon): a post-accumulate-grad hook per parameter
counts its backward passes, and the moment a gradient is final it joins a bucket (or its group) that is submitted
as one asynchronous in-place allreduce, so the engine reduces late layers while earlier ones are still in backprop.
``wait()`` finishes the step (the gradients are then reduced in place); ``reset()`` forgets it.

``AdasumExchange`` is Horovod's delta optimizer on the same frame: the hook takes the parameter's local optimizer
step at once and starts the Adasum of the delta; ``apply()`` sets each parameter to its old value plus the
combined delta.

Both keep their state in ``__slots__``; the optimizer mixins (``optimizer.py``) are Horovod's surface and delegate.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet, set_id_of
from shoal.core.rules import ReduceOp, ReduceSpec
from shoal.plan.schemes import fill_bucket
from shoal.torch import functions, shared_grads
from shoal.torch.compression import Compression, Compressor
from shoal.torch.layer_comm.schemes import gradient_request_name
from shoal.torch.micro_batch_grads import MicroBatchWeights
from shoal.torch.optimizer_class import computed_too_often
from shoal.torch.shared_grads import SharedGradients


def overlaps_backward(device: torch.device) -> bool:
    """Whether gradients on ``device`` start their allreduce as soon as they are final (wait-free backprop), or
    all together when backward is over (the ``overlap_backward`` setting; see its help).

    Unset, overlap is off only where it cannot pay: CPU gradients reduced through shared memory on one host (no
    wire to wait on: the reduction keeps a core busy all the while) whose cores the ranks' compute threads already
    fill. There the reduction takes its core from backprop instead of running beside it, and starting it early only
    adds cycles and cache traffic to backward.
    """
    engine = handles.engine()
    wanted = engine.config.overlap_backward
    if wanted is not None:
        return bool(wanted)
    hierarchical = engine.hierarchical
    if device.type != "cpu" or hierarchical is None or hierarchical.cross_size > 1:
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return hierarchical.local.local_size * torch.get_num_threads() < cores


def empty_sparse_like(param: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """A sparse COO gradient of ``param``'s shape with no entries (``sparse_dim`` indexed dimensions)."""
    indices = torch.empty((sparse_dim, 0), dtype=torch.long, device=param.device)
    values = torch.empty((0, *param.shape[sparse_dim:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=True)


def sparse_embedding_dims(model: nn.Module) -> dict[int, int]:
    """The weights of ``model``'s embeddings made with ``sparse=True`` (sparse gradients, one indexed dimension), by
    id."""
    return {
        id(module.weight): 1
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    }


def _where(grad: torch.Tensor | None) -> int:
    """Where a dense gradient's values lie (0: none, or sparse: never kept in place)."""
    return 0 if grad is None or grad.is_sparse else grad.data_ptr()


class _ComputeMarks:
    """The optimizer's spans on the timeline's compute row, written only while a timeline is open.

    FORWARD runs from ``zero_grad()`` (or the end of the previous ``step()``) to the first final gradient, so it
    holds data loading, the forward pass, the loss and backward up to that gradient; BACKWARD runs from the first
    final gradient to the last (the span in which reductions start, overlapping the rest of backprop);
    SYNCHRONIZE is the wait for the reduced gradients; UPDATE the local optimizer's step.
    """

    __slots__ = ("_first", "_last", "_since")

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


class _Exchange:
    """What both exchanges share: the parameters and their names, a hook each, and the count of backward passes."""

    __slots__ = ("_counts", "_hooks", "advice", "names", "params", "passes")

    def __init__(self, params: list[torch.Tensor], names: dict[int, str], passes: int, advice: str) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.params = params
        self.names = names
        self.passes = passes
        self.advice = advice
        """What the error for a gradient computed too often suggests."""
        self._counts: dict[int, int] = dict.fromkeys(map(id, params), 0)
        self._hooks: list[Any] = []

    def attach(self) -> None:
        """Register the hooks: from now on every final gradient reaches ``on_grad``."""
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for p in self.params]

    def detach(self) -> None:
        """Remove the hooks: the gradients stay local."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_grad(self, param: torch.Tensor) -> None:
        """A gradient was accumulated: once it has all ``passes`` backward passes, start exchanging it."""
        self._before_count(param)
        key = id(param)
        if self._started(key):
            raise computed_too_often(self.names[key], self.passes, self.advice)
        self._counts[key] += 1
        if self._counts[key] == self.passes:
            self._counts[key] = 0
            self._ready(param)

    def reset(self) -> None:
        """Forget this step's passes."""
        self._counts = dict.fromkeys(self._counts, 0)

    def _before_count(self, param: torch.Tensor) -> None:
        """Called first for every gradient."""

    def _started(self, key: int) -> bool:
        raise NotImplementedError

    def _ready(self, param: torch.Tensor) -> None:
        raise NotImplementedError


class GradientExchange(_Exchange):
    """One step of averaging (or summing) gradients across ranks, overlapping backprop."""

    __slots__ = (
        "_bucket",
        "_bucket_size",
        "_densified",
        "_group_ready",
        "_in_flight",
        "_kept",
        "_moved",
        "_order",
        "_overlap",
        "_seen_sparse",
        "_shared_tried",
        "_sparse",
        "_submitted",
        "bucket_bytes",
        "compression",
        "group_of",
        "groups",
        "marks",
        "member",
        "op",
        "process_set",
        "router",
        "shared",
        "skip_synchronize",
        "sparse_as_dense",
        "spec",
        "synchronized",
        "weights",
    )

    def __init__(
        self,
        params: list[torch.Tensor],
        names: dict[int, str],
        compression: type[Compressor],
        passes: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: list[list[torch.Tensor]] | None,
        sparse_as_dense: bool,
        process_set: ProcessSet,
        bucket_bytes: int,
    ) -> None:
        super().__init__(
            params,
            names,
            passes,
            "call optimizer.step() (or synchronize()) between backward passes, or raise backward_passes_per_step to "
            "accumulate locally",
        )
        if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):  # Adasum here: a world of one rank
            raise ValueError(f"DistributedOptimizer supports op=Average or Sum, not {ReduceOp(op).name}")
        self.op = ReduceOp(op)
        self.spec = ReduceSpec.for_gradients(op, gradient_predivide_factor)
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.groups = [list(group) for group in groups or []]
        self.group_of = {id(p): index for index, group in enumerate(self.groups) for p in group}
        self.bucket_bytes = bucket_bytes
        self.router: Any = None
        """The per-layer communication (``LayerRouter``), set by ``DistributedOptimizer`` right after."""
        self.marks = _ComputeMarks()
        # As in Horovod, a rank outside the optimizer's process set exchanges nothing: step() is the local one.
        self.member = process_set.included()
        self.skip_synchronize = False
        """Inside ``optimizer.skip_synchronize()``: ``step()`` does not wait."""
        self.synchronized = False
        """``wait()`` ran and no gradient arrived since (the user called ``synchronize()`` before ``step()``)."""
        self._bucket: list[torch.Tensor] = []
        self._bucket_size = 0
        self._submitted: set[int] = set()
        self._group_ready: dict[int, set[int]] = {}
        self._in_flight: list[tuple[int, list[torch.Tensor], list[torch.Tensor], list[Any]]] = []
        self._sparse: list[torch.Tensor] = []
        self._densified: dict[int, int] = {}
        """Parameters whose sparse gradient was reduced densely (sparse_as_dense), with its sparse dimensions: sparse
        again after the exchange."""
        self._seen_sparse: tuple[Any, dict[int, int]] = (None, {})
        """The session, and the parameters known in it to get sparse gradients, with their sparse dimensions: the
        model's sparse embeddings, and those every rank reduced as sparse (learnt together, so every rank knows the
        same; a re-init, as after an elastic change, starts afresh with its new members). A rank without such a
        gradient stands in an empty sparse one, as the others allgather theirs (a dense zero would wait forever for
        a collective no other rank starts)."""
        self.shared: SharedGradients | None = None
        """The gradients in shared memory (``shared_grads``), adopted after a session's second step."""
        self._shared_tried: Any = None
        """The session in which adopting them was tried (once per session)."""
        self._order: list[torch.Tensor] = []
        """This step's parameters in the order their gradients became final (the arena's layout)."""
        self._kept: tuple[Any, dict[int, int]] | None = None
        """The session, and where each gradient was when its first step ended."""
        self._moved = False
        """A gradient was not accumulated where the previous step left it (zero_grad(set_to_none=True))."""
        self._overlap: tuple[Any, str, bool] | None = None
        """The session and device type last decided for, and whether full buckets leave during backward."""
        self.weights: MicroBatchWeights | None = None
        """With a ``BalancedLoader``: each step's micro-batch shares and gradient scale (set by the optimizer)."""

    @property
    def pending(self) -> bool:
        """Gradients of this step are being (or waiting to be) reduced."""
        return bool(self._submitted or self._bucket or (self.shared is not None and self.shared.pending))

    def attach(self) -> None:
        if self.member:
            super().attach()

    # ----- the BalancedLoader's micro-batches -----

    def begin_step(self, plan: Any, sizes: tuple[int, ...]) -> None:
        """The loader starts a step (``core.balance.StepPlan``): this rank runs its share of micro-batches in passes
        of ``sizes`` samples."""
        weights = self._weights()
        weights.begin_step(plan, self.process_set.size(), sizes)
        self.passes = weights.passes

    def begin_pass(self, index: int) -> None:
        """The loader hands out this rank's ``index``-th pass of the step."""
        self._weights().begin_pass(index, self.params)

    def _weights(self) -> MicroBatchWeights:
        if self.weights is None:
            raise RuntimeError("this DistributedOptimizer was not given the BalancedLoader (loader=)")
        return self.weights

    # ----- hooks: start each reduction as soon as its gradient is final -----

    def _before_count(self, param: torch.Tensor) -> None:
        self.marks.gradient()

    def _started(self, key: int) -> bool:
        return key in self._submitted

    def _ready(self, param: torch.Tensor) -> None:
        key = id(param)
        weights = self.weights
        if weights is not None:
            if weights.ordered is not None:  # the deterministic mode sums whole rows at wait()
                return
            weights.weigh(param)
        shared = self._shared()
        if shared is None:
            self._order.append(param)
            if self._kept is not None and _where(param.grad) != self._kept[1].get(key):
                self._moved = True
        elif shared.holds(param):
            self._submitted.add(key)
            shared.ready(param)
            return
        if self.router.offer(param):  # its scheme sends it (SFB's factors, the parameter server)
            self._submitted.add(key)
            return
        group = self.group_of.get(key)
        if group is not None:
            ready = self._group_ready.setdefault(group, set())
            ready.add(key)
            if len(ready) == len(self.groups[group]):
                self._submit(self.groups[group])
                self._group_ready.pop(group, None)
            return
        self._bucket.append(param)
        self._bucket_size, full = fill_bucket(self._bucket_size, param.numel() * param.element_size(), self._bucket_limit())
        if full and self._overlapping(param):
            self.flush()

    def _overlapping(self, param: torch.Tensor) -> bool:
        """Whether full buckets leave now (``overlaps_backward``); else the bucket holds every gradient until
        ``wait()`` sends them together. Decided once per session and device type."""
        current, device = handles.current_session(), param.device.type
        decided = self._overlap
        if decided is None or decided[0] is not current or decided[1] != device:
            decided = self._overlap = (current, device, overlaps_backward(param.device))
        return decided[2]

    def _bucket_limit(self) -> int:
        """The bucket size: autotune's choice while it runs (or once frozen), else the optimizer's own."""
        tuned = handles.engine().tuned.bucket_bytes
        return self.bucket_bytes if tuned is None else tuned

    def flush(self, driven: bool = False) -> None:
        """Submit the gradients waiting in the bucket (``driven``: the caller synchronizes next)."""
        if self._bucket:
            self._submit(self._bucket, driven)
        self._bucket, self._bucket_size = [], 0

    def _known_sparse(self) -> dict[int, int]:
        """The parameters known to get sparse gradients, on every rank alike: the model's, and those reduced as
        sparse in this session."""
        session = handles.session()
        if self._seen_sparse[0] is not session:
            model = self.router.model
            self._seen_sparse = (session, sparse_embedding_dims(model) if model is not None else {})
        return self._seen_sparse[1]

    def _grad(self, param: torch.Tensor) -> torch.Tensor:
        if param.grad is None:
            sparse_dim = self._known_sparse().get(id(param))
            if sparse_dim is not None and not self.sparse_as_dense:
                param.grad = empty_sparse_like(param, sparse_dim)
            else:
                param.grad = torch.zeros_like(param)
                if sparse_dim is not None:  # sparse again after the exchange, as the other ranks' gradients
                    self._densified[id(param)] = sparse_dim
        elif param.grad.is_sparse and self.sparse_as_dense:
            self._densified[id(param)] = self._known_sparse()[id(param)] = param.grad.sparse_dim()
            param.grad = param.grad.to_dense()
        return param.grad

    def _submit(self, params: list[torch.Tensor], driven: bool = False) -> None:
        """Start reducing these parameters' gradients together, each under its parameter's name."""
        dense: list[torch.Tensor] = []
        for param in params:
            self._submitted.add(id(param))
            (self._sparse if self._grad(param).is_sparse else dense).append(param)
        if not dense:
            return
        compressors = [self.compressor(p) for p in dense]
        with self._cast_span(compressors):
            packed = [c.compress(self._grad(p)) for c, p in zip(compressors, dense, strict=True)]
        names = [gradient_request_name(self.names[id(p)]) for p in dense]
        handle = functions.allreduce_named_async_(
            [c for c, _ in packed], names, self.op, self.spec.prescale, self.spec.postscale, self.process_set, driven
        )
        self._in_flight.append((handle, dense, [c for c, _ in packed], [ctx for _, ctx in packed]))

    # ----- the end of a step -----

    def wait(self) -> None:
        """Finish the step: submit what never started (so no rank hangs), wait, and leave every gradient reduced."""
        if not self.member:
            self.synchronized = True
            return
        with self.marks.span("SYNCHRONIZE"):
            self._finish()
        order = self._order
        self.reset()
        self._adopt_shared(order)
        self.synchronized = True

    def _shared(self) -> SharedGradients | None:
        """The gradients in shared memory, while the engine that knows their arena runs (after a re-init they are
        ordinary tensors until the next adoption)."""
        shared = self.shared
        if shared is not None and not shared.current():
            self.shared = shared = None
        return shared

    def _adopt_shared(self, order: list[torch.Tensor]) -> None:
        """After a session's second step, move the gradients into shared memory (every rank together; see
        ``shared_grads``), if that step accumulated them where the first left them. ``order``: the parameters as
        their gradients became final in this step."""
        current = handles.current_session()
        if self._shared() is not None or self._shared_tried is current or set_id_of(self.process_set) != 0:
            return
        if self._kept is None or self._kept[0] is not current:  # the session's first step: watch the next one
            self._kept = (current, {id(p): _where(p.grad) for p in self.params})
            self._moved = False
            return
        self._shared_tried, self._kept = current, None
        seen = {id(p) for p in order}
        ordered = [*order, *(p for p in reversed(self.params) if id(p) not in seen)]
        candidates = [p for p in ordered if id(p) not in self.group_of and shared_grads.eligible(p)]
        self.shared = shared_grads.adopt(
            candidates, self.names, self.spec, self.process_set, self.bucket_bytes, self._shared_refusal(candidates)
        )

    def _shared_refusal(self, candidates: list[torch.Tensor]) -> str | None:
        """Why this optimizer's gradients stay where autograd puts them, or None."""
        if not handles.engine().config.shared_gradients:
            return "switched off (shared_gradients)"
        if self.weights is not None and self.weights.ordered is not None:
            return "the BalancedLoader's deterministic mode sums whole rows instead"
        if self._moved:
            return (
                "gradients are set to None between steps (zero_grad(set_to_none=True), torch's default), so each would be "
                "copied into shared memory, which costs more than reducing it in place saves; zero_grad(set_to_none=False) "
                "keeps them in place"
            )
        if self.spec.prescale != 1.0:
            return "gradient_predivide_factor is set"
        if self.router.planned is not None or self.router.layers():
            return "per-layer communication (comm) is in use"
        if any(self.compressor(p) is not Compression.none for p in candidates):
            return "gradients are compressed"
        return None

    def _finish(self) -> None:
        weights = self.weights
        if weights is not None:
            weights.check_complete()
            if weights.ordered is not None:
                weights.ordered.finish(self.params, self.process_set, weights.last_weight())
                return
        self.flush(driven=True)  # this thread synchronizes below and runs the cycle itself if no other thread does
        if weights is not None:
            weights.weigh_rest(self.params)
        shared = self._shared()
        if shared is not None:
            self._submitted.update(id(p) for p in self.params if shared.holds(p))
            shared.submit_rest()
        layers = self.router.layers()
        known_sparse = self._known_sparse()  # never a compressed layer's: the other ranks send theirs sparse
        missing = [p for p in self.params if id(p) not in self._submitted and id(p) not in known_sparse]
        for layer in layers:
            self._submitted.update(id(p) for p in layer.claim_missing(missing))
        missing = [p for p in self.params if id(p) not in self._submitted]
        if missing:  # no gradient this step here (or a layer that fell back): stand in, so no rank ever hangs
            self._submit(missing)
        self.router.finish(average=self.op == ReduceOp.Average)
        if shared is not None:
            shared.wait()
        for handle, params, compressed_list, contexts in self._in_flight:
            handles.synchronize(handle)
            compressors = [self.compressor(p) for p in params]
            with self._cast_span(compressors):
                for param, compressor, compressed, ctx in zip(params, compressors, compressed_list, contexts, strict=True):
                    if compressed is not param.grad:
                        assert param.grad is not None
                        param.grad.copy_(compressor.decompress(compressed, ctx))
        # Every sparse reduction is started before any is waited for: ranks add their stand-ins last, in another
        # order than the gradients that backward produced.
        reductions = [(param, self._sparse_allreduce(param.grad, self.names[id(param)])) for param in self._sparse]
        for param, result in reductions:
            param.grad = result().coalesce()
            known_sparse[id(param)] = param.grad.sparse_dim()  # every rank reduced it as sparse: all know it now
        for param in self.params:
            # As Horovod does: a gradient that was sparse is sparse again (SparseAdam refuses dense ones).
            if id(param) in self._densified and param.grad is not None:
                param.grad = param.grad.to_sparse(self._densified[id(param)])

    def _sparse_allreduce(self, grad: torch.Tensor | None, name: str) -> Callable[[], torch.Tensor]:
        """Start reducing a sparse gradient (allgather indices and values; averaging if op is Average); the callable
        waits and gives the result, duplicates not yet summed."""
        assert grad is not None
        op = ReduceOp.Average if self.op == ReduceOp.Average else ReduceOp.Sum  # Adasum on one rank: a sum
        return functions.sparse_allreduce_async(grad, gradient_request_name(name), op, self.process_set)

    def reset(self, discard: bool = False) -> None:
        """Forget this step. ``discard``: it never finished (elastic recovery after a failed collective), so also
        drop the reductions in flight, the layers' exchanges and the gradients."""
        if discard:
            for entry in self._in_flight:
                handles.discard(entry[0])
            for layer in self.router.layers():
                layer.reset()
            for param in self.params:
                param.grad = None
            self.synchronized = False
            self.marks.step_ended()
        super().reset()
        if self.shared is not None:
            self.shared.reset(discard)
        self._order = []
        self._in_flight.clear()
        self._sparse.clear()
        self._densified.clear()
        self._submitted.clear()
        self._group_ready.clear()
        self._bucket, self._bucket_size = [], 0

    def _cast_span(self, compressors: list[type[Compressor]]) -> contextlib.AbstractContextManager[None]:
        """A CAST span on the timeline's compute row around casts (nothing to mark without one)."""
        if all(c is Compression.none for c in compressors):
            return contextlib.nullcontext()
        return self.marks.span("CAST")

    def compressor(self, param: torch.Tensor) -> type[Compressor]:
        """The buckets' compressor for ``param``: its layer scheme's (fp16/bf16), else the optimizer's."""
        return self.router.compressor(param) or self.compression


class AdasumExchange(_Exchange):
    """Horovod's Adasum delta optimizer: each parameter steps locally when its gradient is final, and the deltas are
    combined across ranks with Adasum."""

    __slots__ = ("_handles", "_starts", "compression", "optimizer")

    def __init__(
        self, optimizer: Any, params: list[torch.Tensor], names: dict[int, str], compression: type[Compressor], passes: int
    ) -> None:
        super().__init__(params, names, passes, "increase backward_passes_per_step")
        self.optimizer = optimizer
        """The wrapped optimizer, whose own class's ``step`` makes each parameter's local update."""
        self.compression = compression
        self._starts = {id(p): torch.zeros_like(p, requires_grad=False) for p in params}
        self._handles: dict[int, tuple[torch.Tensor, int, Any, torch.Tensor]] = {}

    @property
    def pending(self) -> bool:
        """Deltas of this step are being combined."""
        return bool(self._handles)

    def _started(self, key: int) -> bool:
        return key in self._handles

    def _ready(self, param: torch.Tensor) -> None:
        """Step this parameter alone, turn it into its delta, and start the Adasum of the deltas."""
        key = id(param)
        start = self._starts[key]
        groups = self.optimizer.param_groups
        stashed = [group["params"] for group in groups]
        for group in groups:
            group["params"] = [p for p in group["params"] if p is param]
        try:
            start.copy_(param.detach())
            with torch.no_grad():
                self.optimizer._shoal_base.step(self.optimizer)
                param.sub_(start)
        finally:
            for group, params in zip(groups, stashed, strict=True):
                group["params"] = params
        compressed, ctx = self.compression.compress(param.detach())
        handle = functions.allreduce_async_(compressed, name=gradient_request_name(self.names[key]), op=ReduceOp.Adasum)
        self._handles[key] = (param, handle, ctx, compressed)

    def apply(self) -> None:
        """Exchange any delta not started yet (no gradient this step), then set old value + combined delta."""
        for param in self.params:
            if id(param) not in self._handles:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._ready(param)
        for key, (param, handle, ctx, _) in list(self._handles.items()):
            delta = self.compression.decompress(handles.synchronize(handle), ctx)
            start = self._starts[key]
            with torch.no_grad():
                start.add_(delta.to(start.dtype))
                param.copy_(start)
        self.reset()

    def reset(self, discard: bool = False) -> None:
        """Forget this step (``discard``: it never finished, so drop the exchanges in flight too)."""
        if discard:
            for entry in self._handles.values():
                handles.discard(entry[1])
        super().reset()
        self._handles.clear()
