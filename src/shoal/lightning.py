"""``shoal.lightning.ShoalStrategy``: PyTorch Lightning's ``Trainer(strategy=ShoalStrategy())`` on Shoal.

The processes come from the launcher (``shoalrun``, ``shoal.ray.RayExecutor``, torchrun, srun...): one rank per
process, ``hvd.init()`` when the strategy is created. Gradients are reduced by ``shoal.torch.DistributedOptimizer``
while backward runs (wait-free backprop; compression and per-layer ``comm=`` schemes as options); parameters and
optimizer state are broadcast from rank 0 before training; ``self.log(..., sync_dist=True)`` reduces through
Shoal; rank 0 writes checkpoints; Lightning's distributed sampler gets Shoal's rank and size.

Lightning is optional: ``pip install 'shoal[lightning]'``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
    from lightning.pytorch.strategies.parallel import ParallelStrategy
except ImportError as error:  # pragma: no cover (the tests skip without Lightning)
    raise ImportError("shoal.lightning needs PyTorch Lightning: pip install 'shoal[lightning]'") from error

import shoal.torch as hvd

_REDUCE_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}


class ShoalEnvironment(ClusterEnvironment):
    """Lightning's view of the job: rank, size and node from ``shoal.torch`` (the launcher made the processes)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "shoal"  # Shoal's own rendezvous; Lightning never uses it under this strategy

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return hvd.is_initialized()

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        pass  # the launcher decides

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # the launcher decides

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


def _reduce_op(reduce_op: Any) -> int:
    """Lightning's reduce op (a string, or torch.distributed.ReduceOp) as Shoal's."""
    name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower().rpartition(".")[2]
    if name not in _REDUCE_OPS:
        raise ValueError(f"ShoalStrategy.reduce: unsupported reduce_op {reduce_op!r} (use one of {sorted(_REDUCE_OPS)})")
    return _REDUCE_OPS[name]


class ShoalStrategy(ParallelStrategy):
    """Data-parallel training for Lightning on Shoal's engine; ``Trainer(strategy=ShoalStrategy(), ...)``.

    Learning rates are not scaled: N ranks x batch B train as one process with batch N*B (Lightning's retired
    ``HorovodStrategy`` multiplied every learning rate by the world size; do that in ``configure_optimizers`` to
    keep its behaviour).
    """

    strategy_name = "shoal"

    def __init__(
        self,
        compression: Any = None,
        comm: str = "allreduce",
        comm_overrides: dict[Any, str] | None = None,
        bucket_bytes: int | None = None,
        op: int = hvd.Average,
        sparse_as_dense: bool = False,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        """Args:
        compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``/``bf16``.
        comm: Shoal's per-layer scheme: ``allreduce`` (default), ``fp16``, ``bf16``, ``sfb``, ``auto``, ``ps``.
        comm_overrides: a scheme per module name or type (see ``shoal.torch.DistributedOptimizer``).
        bucket_bytes: gradient bucket size (default: the ``BUCKET_BYTES`` knob or 2 MiB).
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        """
        hvd.init()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=None,
            cluster_environment=ShoalEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._options: dict[str, Any] = {
            "compression": compression if compression is not None else hvd.Compression.none,
            "comm": comm,
            "comm_overrides": comm_overrides,
            "bucket_bytes": bucket_bytes,
            "op": op,
            "sparse_as_dense": sparse_as_dense,
        }
        self._exit_stack: ExitStack | None = None

    @property
    def is_distributed(self) -> bool:
        """Lightning asks this of custom strategies to decide on a distributed sampler."""
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or []
        if devices and devices[0].type == "cuda":
            return torch.device("cuda", hvd.local_rank() % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's setup, then (when fitting) rank 0's parameters and optimizer state to every rank, and the
        optimizers wrapped in ``DistributedOptimizer``."""
        super().setup(trainer)
        assert self.lightning_module is not None
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        if trainer.state.fn != "fit":
            return
        wrapped = []
        self._exit_stack = ExitStack()
        for optimizer in self.optimizers:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            named = [(name, p) for name, p in self.lightning_module.named_parameters() if id(p) in ids]
            distributed = hvd.DistributedOptimizer(
                optimizer,
                named_parameters=named,
                backward_passes_per_step=trainer.accumulate_grad_batches,
                model=self.lightning_module,
                **self._options,
            )
            # step() must not synchronize before Lightning's closure has run backward: optimizer_step does it.
            self._exit_stack.enter_context(distributed.skip_synchronize())  # type: ignore[attr-defined]
            wrapped.append(distributed)
        self.optimizers = wrapped

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run Lightning's closure (forward and backward), wait for the reduced gradients, then step: gradient
        clipping and ``on_before_optimizer_step`` see the averaged gradients."""
        inner = getattr(optimizer, "_optimizer", optimizer)

        def closure_then_synchronize() -> Any:
            loss = closure()
            if hasattr(inner, "synchronize"):
                inner.synchronize()
            return loss

        return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over the ranks (``self.log(..., sync_dist=True)`` comes here); other values pass."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        value = tensor if tensor.is_floating_point() else tensor.to(torch.float64)  # booleans and counts too
        return hvd.allreduce(value, op=_reduce_op(reduce_op)).to(tensor.dtype)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's tensor, stacked along a new first dimension (Lightning's contract)."""
        gathered = hvd.allgather(tensor.unsqueeze(0))
        return gathered if sync_grads else gathered.detach()

    def barrier(self, name: str | None = None) -> None:
        hvd.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        yield None  # accumulation is DistributedOptimizer's backward_passes_per_step

    def teardown(self) -> None:
        if self._exit_stack is not None:
            self._exit_stack.close()
            self._exit_stack = None
        super().teardown()
