"""``DistributedOptimizer`` for Keras 3 and Keras 2 (``tf_keras``) optimizers, and ``load_model`` that restores one.

Keras 2's optimizers have a hook for exactly this: ``aggregate_gradients(grads_and_vars)`` (``tf_keras``'s optimizers)
or ``_aggregate_gradients`` (its legacy ``OptimizerV2``), called inside ``apply_gradients`` before the update. The
Keras 2 distributed optimizer overrides both with the TensorFlow front end's reduction. What follows is Keras 3's.

Keras 3 optimizers have none of the gradient hooks Horovod 0.28 overrode (``get_gradients``,
``_compute_gradients``, ``_aggregate_gradients``): ``Model.fit``'s step computes the gradients itself and calls
``optimizer.apply_gradients``, which calls ``optimizer.apply(grads, variables)``. The distributed optimizer is a
subclass of the wrapped optimizer's class (same name, rebuilt from its config, as Horovod does) whose ``apply``
reduces the gradients over the ranks first, then clips, decays and updates as the wrapped class does. The
reduction runs on the backend's tensors: ``shoal.tensorflow`` for the TensorFlow backend (also inside the compiled
train function), ``shoal.torch`` for the torch backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras

from shoal.core.balance import check_balanced_reduction
from shoal.core.gradient_lists import GradientOptions, ListReducer, plain_exchanging
from shoal.core.process_sets import ProcessSet, global_process_set
from shoal.core.rules import ReduceOp, ReduceSpec
from shoal.keras.flavour import is_keras2, keras2_module

Average, Sum = ReduceOp.Average, ReduceOp.Sum


def backend() -> str:
    """Keras's backend: ``tensorflow`` or ``torch`` (others are refused)."""
    name = str(keras.backend.backend())
    if name not in ("tensorflow", "torch"):
        raise NotImplementedError(f"shoal.keras supports the tensorflow and torch Keras backends, not {name!r}")
    return name


def default_compression() -> Any:
    """The backend's ``Compression`` class (``.none``, ``.fp16``)."""
    if backend() == "tensorflow":
        from shoal.tf_ops.compression import Compression as TFCompression

        return TFCompression
    from shoal.torch.compression import Compression as TorchCompression

    return TorchCompression


class TorchListAdapter:
    """Keras-on-torch's part of the one list reducer (``shoal.core.gradient_lists``): gradients are torch tensors,
    sparse ones made dense with ``to_dense()``, each group one ``shoal.torch.grouped_allreduce`` with the
    compression given; a ``BalancedData`` (``loader=``) weighs each rank's gradients by its share of the global batch
    before the average."""

    def __init__(self, compression: Any = None) -> None:
        from shoal.torch.compression import Compression

        self.compression = compression if compression is not None else Compression.none
        self.balanced: Any = None
        """A ``BalancedData`` whose steps these gradients come from (``loader=``)."""

    def key(self, source: Any) -> Any:
        return id(source)

    def densify(self, grad: Any) -> Any:
        return grad.to_dense() if getattr(grad, "is_sparse", False) else grad

    def weigh(self, grads: list[Any], process_set: ProcessSet) -> list[Any]:
        if self.balanced is None:
            return grads
        scale = self.balanced.end_step(process_set.size())
        return [grad * scale for grad in grads]

    def allreduce(self, grads: list[Any], spec: ReduceSpec, process_set: ProcessSet) -> list[Any]:
        import shoal.torch as hvd

        return hvd.grouped_allreduce(
            grads,
            compression=self.compression,
            op=spec.op,
            prescale_factor=spec.prescale,
            postscale_factor=spec.postscale,
            process_set=process_set,
        )

    def scale(self, grad: Any, factor: float, per_member_of: ProcessSet | None) -> Any:
        return grad * (factor / (per_member_of.size() if per_member_of is not None else 1))

    def exchanging(self, options: GradientOptions) -> bool:
        return plain_exchanging(options)


def make_reducer(
    options: GradientOptions, compression: Any, device_dense: str = "", device_sparse: str = "", keras2: bool = False
) -> ListReducer:
    """The one list reducer (``shoal.core.gradient_lists``) on Keras's backend: TensorFlow's tensors for Keras 2 and
    Keras 3 on TensorFlow, torch's for Keras 3 on torch."""
    from shoal.torch.compression import Compressed  # (torch is a dependency of every front end)

    if isinstance(compression, Compressed):
        raise NotImplementedError(
            f"compression={compression.scheme.value} (with error feedback) is for shoal.torch's DistributedOptimizer; "
            "Keras and TensorFlow optimizers take Compression.none, .fp16 or .bf16"
        )
    if not keras2 and backend() == "torch":
        return ListReducer(options, TorchListAdapter(compression))
    from shoal.tf_ops.compression import Compression as TFCompression
    from shoal.tf_ops.gradient_tape import tf_list_reducer

    return tf_list_reducer(options, compression or TFCompression.none, device_dense, device_sparse)


class _DistributedMethods:
    """What the distributed optimizer class adds to the wrapped optimizer's class.

    Keras calls ``_backend_apply_gradients(grads, variables)`` once a step (after dropping None gradients and
    unscaling a loss scale) and, inside it, ``_clip_gradients(grads)`` exactly where the update uses the gradients:
    every step, or with gradient accumulation only on the step that applies the accumulated mean (a ``cond`` branch,
    so the exchange happens once per update). The reduction sits in ``_clip_gradients``: first reduce, then clip.
    """

    _shoal_reducer: Any
    _shoal_variables: list[Any]

    def _backend_apply_gradients(self, grads: Any, trainable_variables: Any) -> Any:
        # Not through Keras's __setattr__: its tracker would adopt the list, and the model's variables with it.
        object.__setattr__(self, "_shoal_variables", list(trainable_variables))
        return super()._backend_apply_gradients(grads, trainable_variables)  # type: ignore[misc]

    def _clip_gradients(self, grads: Any) -> Any:
        grads = self._shoal_reducer.reduce(list(grads), self._shoal_variables)
        return super()._clip_gradients(grads)  # type: ignore[misc]

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: not reduced (divided by the number of ranks when
        ``scale_local_gradients``)."""
        self._shoal_reducer.register_local_source(var)


class _Keras2DistributedMethods:
    """What the distributed optimizer class adds to a Keras 2 optimizer class: the reduction in Keras 2's own
    aggregation hook (``aggregate_gradients``, or ``_aggregate_gradients`` on a legacy ``OptimizerV2``)."""

    _shoal_reducer: Any

    def _shoal_reduce_pairs(self, grads_and_vars: Any) -> list[tuple[Any, Any]]:
        pairs = list(grads_and_vars)
        variables = [variable for _, variable in pairs]
        reduced = self._shoal_reducer.reduce([grad for grad, _ in pairs], variables)
        return list(zip(reduced, variables, strict=True))

    def aggregate_gradients(self, grads_and_vars: Any) -> list[tuple[Any, Any]]:
        return self._shoal_reduce_pairs(grads_and_vars)

    def _aggregate_gradients(self, grads_and_vars: Any) -> list[tuple[Any, Any]]:
        return self._shoal_reduce_pairs(grads_and_vars)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: not reduced (divided by the number of ranks when
        ``scale_local_gradients``)."""
        self._shoal_reducer.register_local_source(var)


class _AgreedFiniteCheck:
    """A ``LossScaleOptimizer`` whose finiteness check holds on every rank when it holds on all of them (a Min over
    the ranks), so all ranks apply the step, or all skip it and lower the loss scale, together."""

    inner_optimizer: Any

    def check_finite(self, grads: Any) -> Any:
        local = super().check_finite(grads)  # type: ignore[misc]
        process_set = self.inner_optimizer._shoal_reducer.process_set
        balanced = getattr(self.inner_optimizer._shoal_reducer.adapter, "balanced", None)
        if process_set.size() < 2 or not process_set.included():
            if balanced is not None and not bool(local):
                balanced.skip_step()  # Keras skips the inner optimizer's apply, and with it the reduction
            return local
        if backend() == "torch":
            import shoal.torch as hvd

            agreed = hvd.allreduce(local.float().reshape(1), op=hvd.Min, process_set=process_set)[0] > 0.5
            if balanced is not None and not bool(agreed):
                balanced.skip_step()
            return agreed
        import tensorflow as tf

        from shoal.tf_ops.ops import Min, allreduce

        agreed = allreduce(tf.reshape(tf.cast(local, tf.float32), [1]), op=Min, process_set=process_set)
        return agreed[0] > 0.5


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
    *,
    loader: Any = None,
) -> Any:
    """A Keras optimizer of ``optimizer``'s class (rebuilt from its config) whose updates use gradients averaged
    (or summed) over the ranks; as ``horovod.tensorflow.keras.DistributedOptimizer``.

    ``loader`` (Shoal's): the ``BalancedData`` that ``fit`` trains on (Keras 3 on torch; docs/keras.md).

    ``backward_passes_per_step=N`` accumulates N batches' gradients locally (Keras's own
    ``gradient_accumulation_steps``) and exchanges them once, on the N-th; the update uses their sum, or their
    mean with ``average_aggregated_gradients=True``, as in Horovod. An optimizer built with
    ``gradient_accumulation_steps`` also exchanges once per update (the mean, Keras's rule).

    Raises:
        ValueError: ``op`` other than Average or Sum, a non-Keras optimizer, ``backward_passes_per_step`` < 1 or
            disagreeing with the optimizer's own ``gradient_accumulation_steps``, bad ``groups``.
    """
    if op not in (Average, Sum):
        raise ValueError("op currently only supports Average and Sum")
    keras2 = is_keras2(optimizer)
    if not keras2 and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"DistributedOptimizer needs a Keras optimizer (Keras 3, or Keras 2's tf_keras), got {type(optimizer).__name__}"
        )
    passes = backward_passes_per_step
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    if is_distributed(optimizer):
        return optimizer
    options = GradientOptions.parse(
        op, gradient_predivide_factor, num_groups, groups, sparse_as_dense, scale_local_gradients, process_set
    )
    groups = options.groups  # num_groups folded in, for the inner optimizer of a LossScaleOptimizer
    if keras2:
        _check_balanced(None, op, passes, process_set, optimizer, loader)
        reducer = make_reducer(options, compression, device_dense, device_sparse, keras2=True)
        return _keras2_distributed(optimizer, name, reducer, passes, average_aggregated_gradients)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return _loss_scaled(optimizer, name, locals())
    reducer = make_reducer(options, compression, device_dense, device_sparse)
    _check_balanced(reducer, op, passes, process_set, optimizer, loader)
    return _keras3_distributed(optimizer, name, reducer, backward_passes_per_step, average_aggregated_gradients)


def _loss_scaled(optimizer: Any, name: str | None, arguments: dict[str, Any]) -> Any:
    """A Keras 3 ``LossScaleOptimizer`` around the distributed inner optimizer (``arguments``: DistributedOptimizer's)."""
    # Its apply() checks the gradients and calls the inner optimizer's: distribute the inner one, and let every
    # rank agree on the check (a rank that skipped the step while others reduced would leave them waiting).
    keys = (
        "device_dense",
        "device_sparse",
        "compression",
        "sparse_as_dense",
        "gradient_predivide_factor",
        "op",
        "backward_passes_per_step",
        "average_aggregated_gradients",
        "groups",
        "process_set",
        "scale_local_gradients",
        "loader",
    )  # num_groups is already folded into groups
    inner = DistributedOptimizer(optimizer.inner_optimizer, None, num_groups=0, **{key: arguments[key] for key in keys})
    scaled: Any = type(
        "LossScaleOptimizer",
        (_AgreedFiniteCheck, keras.optimizers.LossScaleOptimizer),
        {"__module__": keras.optimizers.LossScaleOptimizer.__module__},
    )
    return scaled(
        inner,
        initial_scale=optimizer.initial_scale,
        dynamic_growth_steps=optimizer.dynamic_growth_steps,
        name=name or optimizer.name,
    )


def _check_balanced(reducer: Any, op: int, passes: int, process_set: ProcessSet, optimizer: Any, loader: Any) -> None:
    """What ``loader=`` needs; then the reducer weighs the loader's steps (nothing happens without a loader).

    Raises:
        NotImplementedError: a backend other than torch.
        ValueError: an argument the balanced global batch cannot honour.
    """
    if loader is None:
        return
    if not isinstance(getattr(reducer, "adapter", None), TorchListAdapter):
        raise NotImplementedError("loader= (BalancedData) needs Keras 3 on the torch backend (KERAS_BACKEND=torch)")
    own_steps = optimizer.get_config().get("gradient_accumulation_steps") or 1
    accumulation = passes * own_steps
    check_balanced_reduction(op, accumulation, process_set, "backward_passes_per_step and gradient_accumulation_steps")
    reducer.adapter.balanced = loader


def _keras3_distributed(optimizer: Any, name: str | None, reducer: Any, passes: int, average_aggregated: bool) -> Any:
    """A Keras 3 optimizer of ``optimizer``'s class, rebuilt from its config, that reduces with ``reducer``;
    ``passes`` > 1 is Keras's own ``gradient_accumulation_steps`` (summed, as Horovod does, unless
    ``average_aggregated``)."""
    config = optimizer.get_config()
    own_steps = config.get("gradient_accumulation_steps") or 1
    if passes > 1:
        if own_steps not in (1, passes):
            raise ValueError(
                f"backward_passes_per_step={passes} but the optimizer accumulates "
                f"gradient_accumulation_steps={own_steps}: set one of them"
            )
        config["gradient_accumulation_steps"] = passes
    if passes > 1 and not average_aggregated:
        reducer.aggregation = float(passes)  # Keras applies the mean; Horovod the sum
    base = optimizer.__class__
    cls: Any = type(base.__name__, (_DistributedMethods, base), {"__module__": base.__module__})
    if name is not None:
        config["name"] = name
    distributed = cls.from_config(config)
    object.__setattr__(distributed, "_shoal_reducer", reducer)
    return distributed


def _keras2_distributed(
    optimizer: Any, name: str | None, reducer: ListReducer, passes: int, average_aggregated: bool = False
) -> Any:
    """A Keras 2 optimizer of ``optimizer``'s class whose aggregation hook reduces over the ranks with ``reducer``;
    with ``passes`` > 1, one that accumulates that many batches' gradients and applies (and exchanges) once.

    A Keras 2 ``LossScaleOptimizer`` is rebuilt around its distributed inner optimizer: it calls the inner one's
    aggregation before its finiteness check, so a NaN or Inf on any rank reaches every rank, and all skip together.

    Raises:
        NotImplementedError: ``passes`` > 1 with a ``LossScaleOptimizer`` (its check would see one batch's share).
    """
    tf_keras = keras2_module()
    if isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer):
        if passes > 1:
            raise NotImplementedError(
                "backward_passes_per_step > 1 with a Keras 2 LossScaleOptimizer: accumulate in your train step, or "
                "use Keras 3, whose LossScaleOptimizer takes it"
            )
        inner = _keras2_distributed(optimizer.inner_optimizer, None, reducer, 1)
        return tf_keras.mixed_precision.LossScaleOptimizer(
            inner,
            dynamic=optimizer.dynamic,
            initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
        )
    base = optimizer.__class__
    mixins = (_Keras2Accumulation, _Keras2DistributedMethods) if passes > 1 else (_Keras2DistributedMethods,)
    cls: Any = type(base.__name__, (*mixins, base), {"__module__": base.__module__})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    distributed = cls.from_config(config)
    object.__setattr__(distributed, "_shoal_reducer", reducer)
    object.__setattr__(distributed, "_shoal_passes", passes)
    object.__setattr__(distributed, "_shoal_average_aggregated", bool(average_aggregated))
    return distributed


class _Keras2Accumulation:
    """Horovod's ``backward_passes_per_step`` for a Keras 2 optimizer: each ``apply_gradients`` adds the batch's
    gradients to local sums; every ``_shoal_passes``-th call applies the sums (their mean with
    ``average_aggregated_gradients``), so the exchange (the aggregation hook) and the update happen once per
    ``_shoal_passes`` batches. The other calls only count ``iterations``, as Horovod's do. It works eagerly and inside
    ``model.fit``'s compiled step (the decision is a ``tf.cond``; the sums are variables made when a variable first has
    a gradient). A variable without a gradient in the applying call is not updated, and its sum starts again."""

    _shoal_passes: int
    _shoal_average_aggregated: bool
    iterations: Any

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        import tensorflow as tf

        pairs = [(grad, variable) for grad, variable in grads_and_vars if grad is not None]
        sums, counter = self._shoal_sums([variable for _, variable in pairs])
        added = [total.assign_add(tf.convert_to_tensor(grad)) for total, (grad, _) in zip(sums, pairs, strict=True)]
        with tf.control_dependencies(added):
            count = counter.assign_add(1)
        factor = 1.0 / self._shoal_passes if self._shoal_average_aggregated else 1.0

        def apply() -> Any:
            summed = [total.read_value() * factor if factor != 1.0 else total.read_value() for total in sums]
            applied = super(_Keras2Accumulation, self).apply_gradients(  # type: ignore[misc]
                list(zip(summed, [variable for _, variable in pairs], strict=True)), *args, **kwargs
            )
            every_sum = list(self.__dict__["_shoal_accumulated"][0].values())  # this call's and any left from others
            with tf.control_dependencies([applied] if applied is not None else []):
                return tf.group(*[total.assign(tf.zeros_like(total)) for total in every_sum], counter.assign(0))

        def count_only() -> Any:
            return tf.group(self.iterations.assign_add(1))

        return tf.cond(count >= self._shoal_passes, apply, count_only)

    def _shoal_sums(self, variables: list[Any]) -> tuple[list[Any], Any]:
        """The gradient sums (one per variable, made once) and the count of batches added since the last update."""
        import tensorflow as tf

        state = self.__dict__.get("_shoal_accumulated")
        if state is None:
            with tf.init_scope():  # variables made where model.fit's compiled step may make them
                state = ({}, tf.Variable(0, dtype=tf.int64, trainable=False, name="shoal_passes"))
            object.__setattr__(self, "_shoal_accumulated", state)
        sums, counter = state
        missing = [v for v in variables if v.ref() not in sums]  # a variable whose gradient was None until now
        if missing:
            with tf.init_scope():
                sums.update({v.ref(): tf.Variable(tf.zeros_like(v), trainable=False, name="shoal_sum") for v in missing})
        return [sums[v.ref()] for v in variables], counter


def PartialDistributedOptimizer(
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
    groups: Sequence[Sequence[Any]] | int | None = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """A ``DistributedOptimizer`` whose ``local_layers`` (a Keras layer or a list of them) keep local gradients
    (divided by the number of ranks when ``scale_local_gradients``), as ``horovod.keras.PartialDistributedOptimizer``."""
    if local_layers is None:
        layers: list[Any] = []
    elif _is_layer(local_layers):
        layers = [local_layers]
    elif isinstance(local_layers, (list, tuple)) and all(_is_layer(layer) for layer in local_layers):
        layers = list(local_layers)
    else:
        raise ValueError("local_layers must be a Keras layer or a list of Keras layers")
    distributed = DistributedOptimizer(
        optimizer,
        name,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        gradient_predivide_factor,
        op,
        backward_passes_per_step,
        average_aggregated_gradients,
        0,
        groups,
        process_set,
        scale_local_gradients,
    )
    for layer in layers:
        for variable in layer.trainable_weights:
            distributed.register_local_var(variable)
    return distributed


def _is_layer(value: Any) -> bool:
    """A Keras 3 or a Keras 2 layer."""
    return isinstance(value, keras.layers.Layer) or (is_keras2(value) and hasattr(value, "trainable_weights"))


def is_distributed(optimizer: Any) -> bool:
    """True for an optimizer returned by ``DistributedOptimizer``."""
    return isinstance(optimizer, (_DistributedMethods, _Keras2DistributedMethods, _AgreedFiniteCheck))


def load_model(
    filepath: str,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: Mapping[str, Any] | None = None,
    compression: Any = None,
) -> Any:
    """``keras.models.load_model`` whose optimizer comes back as a ``DistributedOptimizer`` (with its state).

    A model saved by Keras 2 (a SavedModel directory, or a ``.keras``/``.h5`` file that records Keras 2.x) is loaded
    with ``tf_keras``; any other with Keras 3.
    """
    from shoal.keras.flavour import saved_by_keras2

    library = keras2_module() if saved_by_keras2(filepath) else keras

    def loader(cls: type) -> type:
        def from_config(klass: type, config: dict[str, Any], custom_objects: Any = None) -> Any:
            return DistributedOptimizer(cls.from_config(config), compression=compression)  # type: ignore[attr-defined]

        return type(cls.__name__, (cls,), {"from_config": classmethod(from_config), "__module__": cls.__module__})

    base = library.optimizers.Optimizer
    known = [cls for cls in vars(library.optimizers).values() if isinstance(cls, type) and issubclass(cls, base)]
    objects: dict[str, Any] = {}
    for cls in known:
        if cls is not base:
            objects[cls.__name__] = objects[cls.__name__.lower()] = loader(cls)
    for cls in custom_optimizers or []:
        objects[cls.__name__] = loader(cls)
    objects.update(custom_objects or {})
    return library.models.load_model(filepath, custom_objects=objects)
