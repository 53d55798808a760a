"""``GradientExchange``: one step of averaging (or summing) gradients across ranks, overlapping backprop.

A post-accumulate-grad hook per parameter counts its backward passes (``BackwardHooks``), and the moment a gradient
is final it goes, in this order, to the first part that takes it:
- the gradients in shared memory (``SharedAdoption``), once adopted;
- its layer's scheme (``LayerRouter``: SFB's factors, the parameter server, the compressed schemes);
- the ``Buckets``: a user's group, or the open bucket, sent as one asynchronous in-place allreduce when full, so the
  engine reduces late layers while earlier ones are still in backprop. A sparse gradient leaves a bucket for
  ``SparseGradients``, reduced by allgather at the step's end.

With a ``BalancedLoader``, ``MicroBatchWeights`` weighs each micro-batch's gradient first. ``wait()`` finishes the
step (the gradients are then reduced in place); ``reset()`` forgets it. The exchange only orchestrates its parts.
"""

from __future__ import annotations

import torch

from shoal.core.balance import StepPlan
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import ReduceOp, ReduceSpec
from shoal.torch.compression import Compression, Compressor
from shoal.torch.exchange.adoption import SharedAdoption
from shoal.torch.exchange.buckets import Buckets
from shoal.torch.exchange.hooks import BackwardHooks
from shoal.torch.exchange.marks import ComputeMarks
from shoal.torch.exchange.scattered import ScatteredGradients
from shoal.torch.exchange.sparse import SparseGradients
from shoal.torch.layer_comm.router import LayerRouter
from shoal.torch.micro_batch_grads import MicroBatchWeights
from shoal.torch.shared_grads import SharedGradients


class GradientExchange(BackwardHooks):
    """One step of averaging (or summing) gradients across ranks, overlapping backprop: the hooks, and the parts
    (buckets, sparse gradients, shared memory, micro-batch weights, the layers' router) each gradient goes to."""

    __slots__ = (
        "_adoption",
        "_submitted",
        "buckets",
        "compression",
        "marks",
        "member",
        "op",
        "process_set",
        "router",
        "scattered",
        "skip_synchronize",
        "sparse",
        "synchronized",
        "weights",
    )

    def __init__(
        self,
        router: LayerRouter,
        weights: MicroBatchWeights | None,
        compression: type[Compressor],
        passes: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: list[list[torch.Tensor]] | None,
        sparse_as_dense: bool,
        bucket_bytes: int,
        scattered: ScatteredGradients | None = None,
    ) -> None:
        """``router``: the layers' schemes, over the parameters, names and process set of its ``OptimizerFacts``;
        ``weights``: with a ``BalancedLoader``, each step's micro-batch shares and gradient scale; ``scattered``:
        with ``shard='gradients'``, the part that reduce-scatters every gradient into the shards."""
        facts = router.facts
        super().__init__(
            facts.params,
            facts.names,
            passes,
            "call optimizer.step() (or synchronize()) between backward passes, or raise backward_passes_per_step to "
            "accumulate locally",
        )
        if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):  # Adasum here: a world of one rank
            raise ValueError(f"DistributedOptimizer supports op=Average or Sum, not {ReduceOp(op).name}")
        self.op = ReduceOp(op)
        self.router = router
        self.weights = weights
        self.compression = compression
        self.process_set = facts.process_set
        self.member = self.process_set.included()
        """As in Horovod, a rank outside the optimizer's process set exchanges nothing: ``step()`` is the local one."""
        self.marks = ComputeMarks()
        spec = ReduceSpec.for_gradients(op, gradient_predivide_factor)
        self.buckets = Buckets(facts.names, spec, [list(g) for g in groups or []], bucket_bytes, self.compressor, self.marks)
        self.sparse = SparseGradients(router.model, sparse_as_dense)
        self.scattered = scattered
        self._adoption = SharedAdoption()
        self.skip_synchronize = False
        """Inside ``optimizer.skip_synchronize()``: ``step()`` does not wait."""
        self.synchronized = False
        """``wait()`` ran and no gradient arrived since (the user called ``synchronize()`` before ``step()``)."""
        self._submitted: set[int] = set()
        """The parameters whose gradient left for its part this step."""

    @property
    def spec(self) -> ReduceSpec:
        """How the gradients are scaled before and after the sum."""
        return self.buckets.spec

    @property
    def shared(self) -> SharedGradients | None:
        """The gradients in shared memory (``shared_grads.SharedGradients``), or None before their adoption."""
        return self._adoption.shared

    @property
    def pending(self) -> bool:
        """Gradients of this step are being (or waiting to be) reduced."""
        shared = self._adoption.shared
        scattered = self.scattered is not None and self.scattered.pending
        return bool(self._submitted or self.buckets.holding or scattered or (shared is not None and shared.pending))

    @property
    def sent(self) -> int:
        """How many of this step's gradients have left for their part."""
        return len(self._submitted)

    def attach(self) -> None:
        if self.member:
            super().attach()

    def point_at(self, process_set: ProcessSet) -> None:
        """Reduce the gradients in ``process_set`` from the next step on (a rank outside it reduces none)."""
        self.detach()
        self.process_set, self.member = process_set, process_set.included()
        self.attach()

    def compressor(self, param: torch.Tensor) -> type[Compressor]:
        """The buckets' compressor for ``param``: its layer scheme's (fp16/bf16), else the optimizer's."""
        return self.router.compressor(param) or self.compression

    # ----- the BalancedLoader's micro-batches -----

    def begin_step(self, plan: StepPlan, sizes: tuple[int, ...]) -> None:
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
        weights = self.weights
        if weights is not None:
            if weights.ordered is not None:  # the deterministic mode sums whole rows at wait()
                return
            weights.weigh(param)
        if self.scattered is not None:
            self._submitted.add(id(param))
            self.scattered.ready(param, self.spec, self.process_set)
            return
        shared = self._adoption.current()
        if shared is None:
            self._adoption.note(param)
        elif shared.holds(param):
            self._submitted.add(id(param))
            shared.ready(param)
            return
        if self.router.offer(param):  # its scheme sends it (SFB's factors, the parameter server)
            self._submitted.add(id(param))
            return
        self._submit(self.buckets.add(param))

    def flush(self, driven: bool = False) -> None:
        """Submit the gradients waiting in the open bucket (``driven``: the caller synchronizes next)."""
        self._submit(self.buckets.take_open(), driven)

    def _submit(self, params: list[torch.Tensor], driven: bool = False) -> None:
        """Start reducing these parameters' gradients: the dense ones together, each under its parameter's name."""
        dense = []
        for param in params:
            self._submitted.add(id(param))
            if not self.sparse.claim(param):
                dense.append(param)
        if dense:
            self.buckets.send(dense, self.op, self.process_set, driven)

    # ----- the end of a step -----

    def wait(self) -> None:
        """Finish the step: submit what never started (so no rank hangs), wait, and leave every gradient reduced."""
        if not self.member:
            self.synchronized = True
            return
        with self.marks.span("SYNCHRONIZE"):
            self._finish()
        order = self._adoption.order
        self.reset()
        keep_out = self.buckets.grouped
        self._adoption.after_step(
            order, self.params, self.names, self.spec, self.process_set, self.buckets.bucket_bytes, keep_out, self._refusal
        )
        self.synchronized = True

    def _refusal(self, candidates: list[torch.Tensor]) -> str | None:
        """Why this optimizer's gradients stay where autograd puts them (beyond what ``SharedAdoption`` checks), or
        None."""
        if self.scattered is not None:
            return "the gradients are reduce-scattered into shards (shard='gradients')"
        if self.weights is not None and self.weights.ordered is not None:
            return "the BalancedLoader's deterministic mode sums whole rows instead"
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
        if self.scattered is not None:
            self.scattered.finish(self.spec, self.process_set)
            return
        shared = self._adoption.current()
        if shared is not None:
            self._submitted.update(id(p) for p in self.params if shared.holds(p))
            shared.submit_rest()
        known_sparse = self.sparse.known()  # never a compressed layer's: the other ranks send theirs sparse
        missing = [p for p in self.params if id(p) not in self._submitted and id(p) not in known_sparse]
        for layer in self.router.layers():
            self._submitted.update(id(p) for p in layer.claim_missing(missing))
        missing = [p for p in self.params if id(p) not in self._submitted]
        if missing:  # no gradient this step here (or a layer that fell back): stand in, so no rank ever hangs
            self._submit(missing)
        self.router.finish(average=self.op == ReduceOp.Average)
        if shared is not None:
            shared.wait()
        self.buckets.wait()
        self.sparse.reduce(self.names, self.op, self.process_set)
        self.sparse.restore(self.params)

    def reset(self, discard: bool = False) -> None:
        """Forget this step. ``discard``: it never finished (elastic recovery after a failed collective), so also
        drop the reductions in flight, the layers' exchanges and the gradients."""
        if discard:
            for layer in self.router.layers():
                layer.reset()
            for param in self.params:
                param.grad = None
            self.synchronized = False
            self.marks.step_ended()
        super().reset()
        self.buckets.reset(discard)
        self._adoption.reset(discard)
        self.sparse.reset()
        if self.scattered is not None:
            self.scattered.reset(discard)
        self._submitted.clear()
