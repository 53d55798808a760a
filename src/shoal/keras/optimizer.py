"""``DistributedOptimizer`` for Keras 3 optimizers, and ``load_model`` that restores one.

Keras 3 optimizers have none of the gradient hooks Horovod 0.28 overrode (``get_gradients``,
``_compute_gradients``, ``_aggregate_gradients``): ``Model.fit``'s step computes the gradients itself and calls
``optimizer.apply_gradients``, which calls ``optimizer.apply(grads, variables)``. The distributed optimizer is a
subclass of the wrapped optimizer's class (same name, rebuilt from its config, as Horovod does) whose ``apply``
reduces the gradients over the ranks first, then clips, decays and updates as the wrapped class does. The
reduction runs on the backend's tensors: ``shoal.tensorflow`` for the TensorFlow backend (also inside the compiled
train function), ``shoal.torch`` for the torch backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras

from shoal.torch.functions import Average, Sum
from shoal.torch.process_sets import ProcessSet, global_process_set


def backend() -> str:
    """Keras's backend: ``tensorflow`` or ``torch`` (others are refused)."""
    name = str(keras.backend.backend())
    if name not in ("tensorflow", "torch"):
        raise NotImplementedError(f"shoal.keras supports the tensorflow and torch Keras backends, not {name!r}")
    return name


def default_compression() -> Any:
    """The backend's ``Compression`` class (``.none``, ``.fp16``)."""
    if backend() == "tensorflow":
        from shoal.tensorflow.compression import Compression as TFCompression

        return TFCompression
    from shoal.torch.compression import Compression as TorchCompression

    return TorchCompression


def _torch_reducer(
    compression: Any, op: int, prescale: float, postscale: float, process_set: ProcessSet
) -> Callable[[list[Any], list[Any]], list[Any]]:
    import shoal.torch as hvd

    def reduce(grads: list[Any], variables: list[Any]) -> list[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present or process_set.size() < 2 or not process_set.included():
            return grads
        reduced = hvd.grouped_allreduce(
            [grads[i] for i in present],
            compression=compression,
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
        )
        out = list(grads)
        for index, value in zip(present, reduced, strict=True):
            out[index] = value
        return out

    return reduce


def make_reducer(
    compression: Any,
    sparse_as_dense: bool,
    op: int,
    gradient_predivide_factor: float,
    num_groups: int,
    groups: Any,
    process_set: ProcessSet,
    scale_local_gradients: bool,
    device_dense: str = "",
    device_sparse: str = "",
) -> Callable[[list[Any], list[Any]], list[Any]]:
    """A function (gradients, variables) -> gradients reduced over the ranks, for Keras's backend."""
    prescale = 1.0 / gradient_predivide_factor if op == Average else 1.0
    postscale = gradient_predivide_factor if op == Average else 1.0
    if backend() == "torch":
        return _torch_reducer(compression or default_compression().none, op, prescale, postscale, process_set)
    from shoal.tensorflow.gradient_tape import GradientReducer

    reducer = GradientReducer(
        compression or default_compression().none,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
        device_dense,
        device_sparse,
    )
    return reducer.reduce


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Sequence[Sequence[Any]] | int | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """A Keras optimizer of ``optimizer``'s class (rebuilt from its config) whose updates use gradients averaged
    (or summed) over the ranks; as ``horovod.tensorflow.keras.DistributedOptimizer``.

    Raises:
        ValueError: ``op`` other than Average or Sum, a non-Keras optimizer.
        NotImplementedError: ``backward_passes_per_step`` > 1 (use Keras's own ``gradient_accumulation_steps`` on
            the optimizer: the reduced gradients are then accumulated, one exchange per micro-batch).
    """
    if op not in (Average, Sum):
        raise ValueError("op currently only supports Average and Sum")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer needs a Keras optimizer, got {type(optimizer).__name__}")
    if backward_passes_per_step != 1:
        raise NotImplementedError(
            "backward_passes_per_step > 1 is not supported with Keras 3 optimizers yet; set "
            "gradient_accumulation_steps on the optimizer instead (each micro-batch's gradients are then reduced)"
        )
    if getattr(optimizer, "_shoal_reduce", None) is not None:
        return optimizer  # already distributed
    reduce = make_reducer(
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
        device_dense,
        device_sparse,
    )
    base = optimizer.__class__

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        grads = list(grads)
        if len(variables) != len(grads):  # Keras checks this itself; keep its message
            return base.apply(self, grads, trainable_variables)
        return base.apply(self, reduce(grads, variables), trainable_variables)

    cls: Any = type(base.__name__, (base,), {"apply": apply, "__module__": base.__module__})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    distributed = cls.from_config(config)
    distributed._shoal_reduce = reduce
    return distributed


def is_distributed(optimizer: Any) -> bool:
    """True for an optimizer returned by ``DistributedOptimizer``."""
    return getattr(optimizer, "_shoal_reduce", None) is not None


def load_model(
    filepath: str,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: Mapping[str, Any] | None = None,
    compression: Any = None,
) -> Any:
    """``keras.models.load_model`` whose optimizer comes back as a ``DistributedOptimizer`` (with its state)."""

    def loader(cls: type) -> type:
        def from_config(klass: type, config: dict[str, Any], custom_objects: Any = None) -> Any:
            return DistributedOptimizer(cls.from_config(config), compression=compression)  # type: ignore[attr-defined]

        return type(cls.__name__, (cls,), {"from_config": classmethod(from_config), "__module__": cls.__module__})

    known = [
        cls for cls in vars(keras.optimizers).values() if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
    ]
    objects: dict[str, Any] = {}
    for cls in known:
        if cls is not keras.optimizers.Optimizer:
            objects[cls.__name__] = objects[cls.__name__.lower()] = loader(cls)
    for cls in custom_optimizers or []:
        objects[cls.__name__] = loader(cls)
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)
