"""``shoal.spark.TorchEstimator``: Horovod's ``horovod.spark.torch.TorchEstimator``, fit on a Spark DataFrame.

``TorchEstimator(model=..., optimizer=..., loss=..., feature_cols=[...], label_cols=[...], store=...).fit(df)``
writes the DataFrame's feature and label columns to the store as Parquet, trains on ``num_proc`` ranks through
``shoal.spark.run`` (each rank reads its share with pyarrow, shuffled per epoch), and returns a ``TorchModel``: a
Spark ML ``Model`` whose ``transform(df)`` adds one ``<label>__output`` column per label, and which saves and loads
(``model.save(path)``, ``TorchModel.load(path)``).
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

from shoal.spark._remote import OptimizerSpec, TrainSpec
from shoal.spark.store import Store

__all__ = ["LightningEstimator", "TorchEstimator", "TorchModel"]

_ESTIMATOR_PARAMS: dict[str, tuple[str, Any]] = {  # name: (what it is, default)
    "num_proc": ("ranks (one Spark task each); default spark.default.parallelism", None),
    "model": ("the torch.nn.Module to train; model(*features) gives one output per label column", None),
    "store": ("a shoal.spark.Store (or a path) for the data and checkpoints; local mode: a temporary one", None),
    "optimizer": ("a torch optimizer built on model.parameters()", None),
    "loss": ("a loss fn(output, label), or a list of them, one per label column", None),
    "loss_weights": ("each loss's weight (default 1 each)", None),
    "gradient_compression": ("shoal.torch.Compression for the gradients", None),
    "feature_cols": ("feature columns, one per positional argument of model.forward", None),
    "label_cols": ("label columns, one per model output", None),
    "input_shapes": ("each feature's batch shape, e.g. [-1, 1, 8, 8] (default: as stored)", None),
    "label_shapes": ("each label's batch shape (default: as stored)", None),
    "validation": ("a fraction of rows (float) or a boolean column (name) held out for validation", None),
    "callbacks": ("not used by the torch estimator (Horovod's ignores them too); must be empty", None),
    "batch_size": ("rows per rank per step", 32),
    "val_batch_size": ("rows per validation batch (default batch_size)", None),
    "epochs": ("passes over the training data", 1),
    "verbose": ("0 quiet, 1 the loss per epoch on the driver, 2 also what the job does", 1),
    "random_seed": ("seed of the torch and shuffling generators (default 0)", None),
    "shuffle": ("shuffle each rank's rows each epoch", True),
    "run_id": ("the run's name in the store; a run with a checkpoint resumes from it", None),
    "train_steps_per_epoch": ("steps per epoch (default: rows // (batch_size * num_proc))", None),
    "validation_steps_per_epoch": ("validation batches per rank per epoch (default: all)", None),
    "backward_passes_per_step": ("backward passes accumulated per optimizer step", 1),
    "use_gpu": ("train on the local rank's GPU when CUDA is available", True),
}
_MODEL_PARAMS: dict[str, tuple[str, Any]] = {
    "model": ("the trained torch.nn.Module", None),
    "history": ("the loss (and val_loss) per epoch", None),
    "feature_columns": ("feature columns", None),
    "label_columns": ("label columns", None),
    "output_cols": ("the prediction columns transform adds (default <label>__output)", None),
    "input_shapes": ("each feature's batch shape", None),
    "optimizer": ("the optimizer, holding the trained state", None),
    "loss": ("the loss(es)", None),
    "run_id": ("the run's name in the store", None),
    "_metadata": ("the label columns' Spark types", None),
}


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.strip("_").split("_"))


def _declare(cls: type, specs: dict[str, tuple[str, Any]]) -> None:
    """Spark ML ``Param``s with Horovod's ``getX``/``setX`` accessors, for every entry of ``specs``."""
    for name, (doc, _default) in specs.items():
        setattr(cls, name, Param(Params._dummy(), name, doc))
        camel = _camel(name)
        if not hasattr(cls, f"get{camel}"):
            setattr(cls, f"get{camel}", lambda self, _name=name: self.getOrDefault(_name))
        if not hasattr(cls, f"set{camel}"):
            setattr(cls, f"set{camel}", lambda self, value, _name=name: self._set(**{_name: value}))


class TorchEstimator(Estimator, MLWritable):
    """Spark Estimator that fits a PyTorch model to a DataFrame on ``num_proc`` Shoal ranks.

    Horovod's ``TorchEstimator``, keyword for keyword where Shoal has the feature; see docs/spark.md for the
    parameters and what differs. ``fit(df)`` returns a ``TorchModel``.
    """

    _title = "shoal.spark.TorchEstimator"
    _required: tuple[str, ...] = ("model", "optimizer", "loss", "feature_cols", "label_cols")

    @keyword_only
    def __init__(
        self,
        *,
        num_proc: int | None = None,
        model: Any = None,
        backend: Any = None,
        store: Store | str | None = None,
        optimizer: Any = None,
        loss: Any = None,
        loss_weights: list[float] | None = None,
        gradient_compression: Any = None,
        feature_cols: list[str] | None = None,
        input_shapes: list[list[int]] | None = None,
        validation: float | str | None = None,
        label_cols: list[str] | None = None,
        label_shapes: list[list[int]] | None = None,
        callbacks: list[Any] | None = None,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        epochs: int = 1,
        verbose: int = 1,
        random_seed: int | None = None,
        shuffle: bool = True,
        run_id: str | None = None,
        train_steps_per_epoch: int | None = None,
        validation_steps_per_epoch: int | None = None,
        backward_passes_per_step: int = 1,
        use_gpu: bool = True,
    ) -> None:
        super().__init__()
        if backend is not None:
            raise NotImplementedError("shoal.spark.TorchEstimator: backend= is not supported; it always runs on Spark")
        self._setDefault(**{name: default for name, (_doc, default) in _ESTIMATOR_PARAMS.items()})
        self._set(**{name: value for name, value in self.__dict__["_input_kwargs"].items() if name != "backend"})

    @keyword_only
    def setParams(self, **kwargs: Any) -> TorchEstimator:
        """Set any of the constructor's parameters."""
        return self._set(**kwargs)

    def _fit(self, df: Any) -> TorchModel:
        from shoal.spark import run
        from shoal.spark._data import row_count

        self._check()
        context = df.sparkSession.sparkContext
        num_proc = self.getOrDefault("num_proc") or int(context.defaultParallelism)
        store = self._store(context)
        run_id = self.getOrDefault("run_id") or f"shoal_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}"
        train_path, val_path = store.get_train_data_path(run_id), store.get_val_data_path(run_id)
        store.remove(val_path)  # a crashed fit of the same run may have left one; this fit may have none
        metadata = _write_data(self, df, train_path, val_path)
        has_val = val_path if os.path.isdir(val_path) and row_count(val_path) > 0 else None
        train_rows = row_count(train_path)
        val_rows = row_count(has_val) if has_val else 0
        for kind, rows in (("training", train_rows), ("validation", val_rows)):
            if rows < num_proc and (kind == "training" or rows > 0):
                store.remove(train_path)
                store.remove(val_path)
                raise ValueError(
                    f"{self._title}: {rows} {kind} rows for {num_proc} processes; every process needs at least one"
                )
        steps = self.getOrDefault("train_steps_per_epoch") or train_rows // (self.getOrDefault("batch_size") * num_proc)
        if steps < 1:
            raise ValueError(
                f"{self._title}: {train_rows} training rows are fewer than batch_size "
                f"({self.getOrDefault('batch_size')}) x num_proc ({num_proc}); lower either, or set train_steps_per_epoch"
            )
        spec = self._spec(
            {
                **self._data_settings(),
                "train_steps": int(steps),
                "train_path": train_path,
                "val_path": has_val,
                "checkpoint_file": os.path.join(store.get_checkpoint_path(run_id), store.get_checkpoint_filename()),
            }
        )
        verbose = self.getOrDefault("verbose")
        if verbose >= 1:
            print(
                f"{self._title}: run {run_id}: {train_rows} training rows, {num_proc} processes, {steps} steps per epoch",
                file=sys.stderr,
                flush=True,
            )
        try:
            results = run(
                self._entry(), args=(spec,), num_proc=num_proc, verbose=max(0, verbose - 1),
                stdout=sys.stdout if verbose >= 1 else None, stderr=sys.stderr if verbose >= 1 else None,
            )  # fmt: skip
        finally:
            store.remove(train_path)
            store.remove(val_path)
        return self._model(results[0], run_id, metadata)

    def _check(self) -> None:
        """Refuse what cannot train, before anything is written or started."""
        for name in self._required:
            if not self.getOrDefault(name):
                raise ValueError(f"{self._title}: {name} is required")
        for name in ("batch_size", "epochs"):
            if int(self.getOrDefault(name)) < 1:
                raise ValueError(f"{self._title}: {name} must be >= 1, got {self.getOrDefault(name)}")
        validation = self.getOrDefault("validation")
        if isinstance(validation, float) and not 0.0 <= validation < 1.0:
            raise ValueError(f"{self._title}: a validation fraction must be in [0, 1), got {validation}")
        self._check_more()

    def _check_more(self) -> None:
        if self.getOrDefault("callbacks"):
            raise ValueError(
                f"{self._title}: callbacks are not used by the torch estimator (Horovod's ignores them); pass none"
            )
        losses = self._losses()
        if len(losses) != len(self.getOrDefault("label_cols")):
            raise ValueError(
                f"{self._title}: {len(losses)} loss(es) for {len(self.getOrDefault('label_cols'))} label "
                "column(s); give one loss, or one per label column"
            )
        weights = self.getOrDefault("loss_weights")
        if weights is not None and len(weights) != len(self.getOrDefault("label_cols")):
            raise ValueError(f"{self._title}: {len(weights)} loss weight(s) for {len(losses)} loss(es)")
        OptimizerSpec.of(self.getOrDefault("model"), self.getOrDefault("optimizer"))  # the model's parameters?

    def _losses(self) -> list[Any]:
        loss = self.getOrDefault("loss")
        labels = self.getOrDefault("label_cols") or []
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss] * max(1, len(labels))
        return losses

    def _store(self, context: Any) -> Store:
        store = self.getOrDefault("store")
        if isinstance(store, Store):
            return store
        if isinstance(store, str):
            return Store.create(store)
        master = context.master
        if not master.startswith("local"):
            raise ValueError(
                f"{self._title}: store is required on a cluster (master {master!r}): "
                "store=shoal.spark.Store.create('/a/path/every/executor/mounts')"
            )
        return Store.create(tempfile.mkdtemp(prefix="shoal-store-"))

    def _data_settings(self) -> dict[str, Any]:
        """The DataSpec fields that come straight from the parameters."""
        features, labels = list(self.getOrDefault("feature_cols")), list(self.getOrDefault("label_cols"))
        batch = int(self.getOrDefault("batch_size"))
        seed = self.getOrDefault("random_seed")
        return {
            "model": self.getOrDefault("model"),
            "feature_cols": features,
            "label_cols": labels,
            "input_shapes": list(self.getOrDefault("input_shapes") or [None] * len(features)),
            "label_shapes": list(self.getOrDefault("label_shapes") or [None] * len(labels)),
            "batch_size": batch,
            "val_batch_size": int(self.getOrDefault("val_batch_size") or batch),
            "epochs": int(self.getOrDefault("epochs")),
            "val_steps": self.getOrDefault("validation_steps_per_epoch"),
            "shuffle": bool(self.getOrDefault("shuffle")),
            "seed": 0 if seed is None else int(seed),
            "verbose": int(self.getOrDefault("verbose")),
            "use_gpu": bool(self.getOrDefault("use_gpu")),
        }

    def _spec(self, data: dict[str, Any]) -> Any:
        """What each rank runs with: the data settings, and the optimizer and losses."""
        labels = data["label_cols"]
        weights = self.getOrDefault("loss_weights") or [1.0] * len(labels)
        return TrainSpec(
            **data,
            optimizer=OptimizerSpec.of(self.getOrDefault("model"), self.getOrDefault("optimizer")),
            losses=self._losses(),
            loss_weights=[float(weight) for weight in weights],
            backward_passes_per_step=int(self.getOrDefault("backward_passes_per_step")),
            compression=self.getOrDefault("gradient_compression"),
        )

    def _entry(self) -> Callable[..., Any]:
        return _train_entry

    def _model(self, result: dict[str, Any], run_id: str, metadata: dict[str, str]) -> TorchModel:
        import torch

        state = torch.load(io.BytesIO(result["state"]), map_location="cpu", weights_only=False)
        model = copy.deepcopy(self.getOrDefault("model"))
        model.load_state_dict(state["model"])
        model.eval()
        optimizer = OptimizerSpec.of(self.getOrDefault("model"), self.getOrDefault("optimizer")).build(model)
        optimizer.load_state_dict(state["optimizer"])
        return TorchModel(
            history=result["history"],
            model=model,
            feature_columns=list(self.getOrDefault("feature_cols")),
            label_columns=list(self.getOrDefault("label_cols")),
            input_shapes=self.getOrDefault("input_shapes"),
            optimizer=optimizer,
            loss=self.getOrDefault("loss"),
            run_id=run_id,
            _metadata=metadata,
        )

    def write(self) -> MLWriter:
        raise NotImplementedError(f"{self._title}: saving an unfitted estimator is not supported; save the fitted TorchModel")


_declare(TorchEstimator, _ESTIMATOR_PARAMS)


class LightningEstimator(TorchEstimator):
    """Spark Estimator that fits a Lightning ``LightningModule`` to a DataFrame on ``num_proc`` Shoal ranks.

    Horovod's ``horovod.spark.lightning.TorchEstimator``: each rank runs ``lightning.pytorch.Trainer`` with
    ``shoal.lightning.ShoalStrategy`` on its share of the rows. The module brings its own
    ``configure_optimizers`` and ``training_step`` (and ``validation_step`` when ``validation`` is set); each batch
    is a dict of tensors keyed by column name. ``callbacks`` are Lightning callbacks. ``fit(df)`` returns a
    ``TorchModel`` around the trained module (``transform`` calls its ``forward``).
    """

    _title = "shoal.spark.LightningEstimator"
    _required = ("model", "feature_cols", "label_cols")

    @keyword_only
    def __init__(
        self,
        *,
        num_proc: int | None = None,
        model: Any = None,
        store: Store | str | None = None,
        feature_cols: list[str] | None = None,
        input_shapes: list[list[int]] | None = None,
        validation: float | str | None = None,
        label_cols: list[str] | None = None,
        label_shapes: list[list[int]] | None = None,
        callbacks: list[Any] | None = None,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        epochs: int = 1,
        verbose: int = 1,
        random_seed: int | None = None,
        shuffle: bool = True,
        run_id: str | None = None,
        train_steps_per_epoch: int | None = None,
        validation_steps_per_epoch: int | None = None,
        use_gpu: bool = True,
    ) -> None:
        Estimator.__init__(self)
        self._setDefault(**{name: default for name, (_doc, default) in _ESTIMATOR_PARAMS.items()})
        self._set(**self.__dict__["_input_kwargs"])

    def _check_more(self) -> None:
        import lightning.pytorch as pl

        if not isinstance(self.getOrDefault("model"), pl.LightningModule):
            raise TypeError(f"{self._title}: model must be a lightning.pytorch.LightningModule")

    def _spec(self, data: dict[str, Any]) -> Any:
        from shoal.spark._lightning import LightningSpec

        return LightningSpec(**data, callbacks=list(self.getOrDefault("callbacks") or []))

    def _entry(self) -> Callable[..., Any]:
        return _lightning_entry

    def _model(self, result: dict[str, Any], run_id: str, metadata: dict[str, str]) -> TorchModel:
        import torch

        model = copy.deepcopy(self.getOrDefault("model"))
        model.load_state_dict(torch.load(io.BytesIO(result["state"]), map_location="cpu", weights_only=False))
        model.eval()
        return TorchModel(
            history=result["history"],
            model=model,
            feature_columns=list(self.getOrDefault("feature_cols")),
            label_columns=list(self.getOrDefault("label_cols")),
            input_shapes=self.getOrDefault("input_shapes"),
            run_id=run_id,
            _metadata=metadata,
        )


def _lightning_entry(spec: Any) -> Any:
    """What each rank of a ``LightningEstimator`` runs."""
    from shoal.spark._lightning import train_lightning

    return train_lightning(spec)


def _train_entry(spec: Any) -> Any:
    """The function ``shoal.spark.run`` runs on each rank (imports on the worker, not the driver)."""
    from shoal.spark._remote import train

    return train(spec)


def _write_data(estimator: TorchEstimator, df: Any, train_path: str, val_path: str) -> dict[str, str]:
    """Write the feature and label columns as Parquet (vectors as arrays); the label columns' Spark types."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, BooleanType, DecimalType, NumericType

    features, labels = estimator.getOrDefault("feature_cols"), estimator.getOrDefault("label_cols")
    validation = estimator.getOrDefault("validation")
    wanted = list(dict.fromkeys([*features, *labels, *([validation] if isinstance(validation, str) else [])]))
    fields = {field.name: field.dataType for field in df.schema.fields}
    missing = [name for name in wanted if name not in fields]
    if missing:
        raise ValueError(f"{estimator._title}: the DataFrame has no column(s) {missing}; it has {sorted(fields)}")
    selected = []
    for name in dict.fromkeys([*features, *labels]):  # a column both feature and label is written once
        kind = fields[name]
        if isinstance(kind, VectorUDT):
            selected.append(vector_to_array(F.col(name)).alias(name))
        elif (isinstance(kind, (NumericType, BooleanType)) and not isinstance(kind, DecimalType)) or (
            isinstance(kind, ArrayType)
            and isinstance(kind.elementType, (NumericType, BooleanType))
            and not isinstance(kind.elementType, DecimalType)
        ):
            selected.append(F.col(name))
        else:
            raise TypeError(
                f"{estimator._title}: column {name!r} is {kind.simpleString()}; use numbers, arrays of numbers "
                "or ML vectors (cast decimals to double)"
            )
    if isinstance(validation, str):
        train, val = df.filter(~F.col(validation).cast("boolean")), df.filter(F.col(validation).cast("boolean"))
    elif validation:
        seed = estimator.getOrDefault("random_seed")
        train, val = df.randomSplit([1.0 - float(validation), float(validation)], seed=0 if seed is None else seed)
    else:
        train, val = df, None
    train.select(*selected).write.mode("overwrite").parquet(train_path)
    if val is not None:
        val.select(*selected).write.mode("overwrite").parquet(val_path)
    return {name: fields[name].json() for name in labels}


class TorchModel(Model, MLWritable, MLReadable):
    """Spark Transformer around a trained PyTorch model: ``transform(df)`` adds each output as ``<label>__output``.

    ``getModel()`` is the torch module, ``getHistory()`` the loss per epoch. A scalar output per row keeps the
    label's type (rounded for integer labels); a larger one becomes an ML ``DenseVector``, as in Horovod.
    """

    @keyword_only
    def __init__(
        self,
        *,
        history: dict[str, list[float]] | None = None,
        model: Any = None,
        feature_columns: list[str] | None = None,
        input_shapes: list[list[int]] | None = None,
        label_columns: list[str] | None = None,
        optimizer: Any = None,
        run_id: str | None = None,
        _metadata: dict[str, str] | None = None,
        loss: Any = None,
        output_cols: list[str] | None = None,
    ) -> None:
        super().__init__()
        self._setDefault(**{name: default for name, (_doc, default) in _MODEL_PARAMS.items()})
        kwargs = dict(self.__dict__["_input_kwargs"])
        if label_columns and not output_cols:
            kwargs["output_cols"] = [f"{name}__output" for name in label_columns]
        self._set(**kwargs)

    def _transform(self, df: Any) -> Any:
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        from shoal.spark._predict import output_fields, predict_batches

        model = self.getOrDefault("model")
        features = list(self.getOrDefault("feature_columns"))
        outputs = list(self.getOrDefault("output_cols"))
        labels = list(self.getOrDefault("label_columns"))
        shapes = self.getOrDefault("input_shapes") or [None] * len(features)
        prepared, inputs = _with_array_inputs(df, features)
        fields, vectors = output_fields(model, prepared, inputs, shapes, labels, outputs, self.getOrDefault("_metadata"))
        schema = _schema(df, fields)
        keep = [field.name for field in df.schema.fields]  # a plain list: the closure must not hold the DataFrame
        predicted = prepared.mapInArrow(lambda batches: predict_batches(batches, model, inputs, shapes, fields, keep), schema)
        for name in vectors:
            predicted = predicted.withColumn(name, array_to_vector(F.col(name)))
        return predicted

    def write(self) -> MLWriter:
        return _TorchModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _TorchModelReader()


_declare(TorchModel, _MODEL_PARAMS)


def _with_array_inputs(df: Any, features: list[str]) -> tuple[Any, list[str]]:
    """``df`` with each ML-vector feature also as a hidden array column; the columns the model reads."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    fields = {field.name: field.dataType for field in df.schema.fields}
    missing = [name for name in features if name not in fields]
    if missing:
        raise ValueError(f"shoal.spark.TorchModel: the DataFrame has no feature column(s) {missing}")
    inputs = []
    for position, name in enumerate(features):
        if isinstance(fields[name], VectorUDT):
            hidden = f"__shoal_input_{position}"
            df = df.withColumn(hidden, vector_to_array(F.col(name)))
            inputs.append(hidden)
        else:
            inputs.append(name)
    return df, inputs


def _schema(df: Any, fields: list[Any]) -> Any:
    from pyspark.sql.types import StructType

    names = {field.name for field in fields}
    return StructType([field for field in df.schema.fields if field.name not in names] + fields)


class _TorchModelWriter(MLWriter):
    """A directory: ``metadata.json`` (columns, history, run) and ``model.pkl`` (the module, optimizer, loss)."""

    def __init__(self, instance: TorchModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        from shoal.runner.function_job import dumps

        path = _local(path)
        if os.path.exists(path) and not self.shouldOverwrite:
            raise FileExistsError(f"shoal.spark.TorchModel: {path} already exists; use model.write().overwrite().save(path)")
        os.makedirs(path, exist_ok=True)
        model = self.instance
        names = ["history", "feature_columns", "label_columns", "output_cols", "input_shapes", "run_id", "_metadata"]
        meta = {"class": "shoal.spark.TorchModel", "params": {name: model.getOrDefault(name) for name in names}}
        with open(os.path.join(path, "metadata.json"), "w") as handle:
            json.dump(meta, handle, indent=1)
        optimizer = model.getOrDefault("optimizer")
        payload = {
            "model": model.getOrDefault("model"),
            "optimizer": None if optimizer is None else OptimizerSpec.of(model.getOrDefault("model"), optimizer),
            "loss": model.getOrDefault("loss"),
        }
        with open(os.path.join(path, "model.pkl"), "wb") as handle:
            handle.write(dumps(payload))


class _TorchModelReader(MLReader):
    def load(self, path: str) -> TorchModel:
        path = _local(path)
        with open(os.path.join(path, "metadata.json")) as handle:
            meta = json.load(handle)
        if meta.get("class") != "shoal.spark.TorchModel":
            raise ValueError(f"shoal.spark.TorchModel: {path} holds no saved TorchModel")
        with open(os.path.join(path, "model.pkl"), "rb") as handle:
            payload = pickle.load(handle)  # a file this class wrote: loading runs code, as torch.load does
        optimizer = None if payload["optimizer"] is None else payload["optimizer"].build(payload["model"])
        return TorchModel(model=payload["model"], optimizer=optimizer, loss=payload["loss"], **meta["params"])


def _local(path: str) -> str:
    """A local or shared path (``file://`` stripped); a URI of another filesystem is refused, as by the store."""
    local = path[len("file://") :] if path.startswith("file://") else path
    if "://" in local or local.startswith("dbfs:"):
        raise ValueError(
            f"shoal.spark.TorchModel: {path!r} is not a local or shared path; models are saved through the filesystem "
            "(on Databricks, /dbfs/...)"
        )
    return local
