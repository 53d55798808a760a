"""``TorchModel.transform``'s work: the prediction columns' types (from one row, on the driver) and the predictions
themselves, batch by batch in the executors (``mapInArrow``: Arrow batches in, the same with the outputs added)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


def _inputs(columns: list[Any], names: list[str], shapes: list[list[int] | None]) -> list[Any]:
    from shoal.spark._data import _column_array, as_tensor

    return [as_tensor(_column_array(column, name), shape) for column, name, shape in zip(columns, names, shapes, strict=True)]


def _run(model: Any, inputs: list[Any]) -> list[Any]:
    import torch

    model.eval()
    with torch.no_grad():
        outputs = model(*inputs)
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def output_fields(
    model: Any,
    df: Any,
    inputs: list[str],
    shapes: list[list[int] | None],
    labels: list[str],
    outputs: list[str],
    metadata: dict[str, str] | None,
) -> tuple[list[Any], list[str]]:
    """The prediction columns' Spark fields (a scalar per row keeps its label's type, anything larger is an array
    of doubles), found by running the model on the first row; and the columns to turn into ML vectors."""
    from pyspark.sql.types import ArrayType, DoubleType, StructField, _parse_datatype_json_string

    if len(outputs) != len(labels):
        raise ValueError(f"shoal.spark.TorchModel: {len(outputs)} output column(s) for {len(labels)} label(s)")
    first = df.select(*inputs).limit(1).collect()  # (DataFrame.toArrow is pyspark 4 only)
    sizes = [1] * len(outputs)
    if first:
        from shoal.spark._data import as_tensor

        predicted = _run(
            model, [as_tensor(np.asarray([first[0][name]]), shape) for name, shape in zip(inputs, shapes, strict=True)]
        )
        if len(predicted) != len(outputs):
            raise ValueError(f"shoal.spark.TorchModel: the model gave {len(predicted)} output(s) for {len(outputs)} label(s)")
        sizes = [int(output.numel()) for output in predicted]
    fields, vectors = [], []
    for name, label, size in zip(outputs, labels, sizes, strict=True):
        if size == 1:
            kind = _parse_datatype_json_string((metadata or {}).get(label, '"double"'))
            fields.append(StructField(name, kind, True))
        else:
            fields.append(StructField(name, ArrayType(DoubleType(), True), True))
            vectors.append(name)
    return fields, vectors


def predict_batches(
    batches: Iterator[Any],
    model: Any,
    inputs: list[str],
    shapes: list[list[int] | None],
    fields: list[Any],
    keep: list[str],
) -> Iterator[Any]:
    """Each Arrow batch's ``keep`` columns, with the model's outputs added as ``fields``."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_type
    from pyspark.sql.types import ArrayType, BooleanType, IntegralType

    out_names = {field.name for field in fields}
    for batch in batches:
        predicted = _run(model, _inputs([batch.column(name) for name in inputs], inputs, shapes))
        columns = [batch.column(name) for name in keep if name not in out_names]
        names = [name for name in keep if name not in out_names]
        for field, output in zip(fields, predicted, strict=True):
            values = output.detach().cpu().reshape(batch.num_rows, -1).double().numpy()
            if isinstance(field.dataType, ArrayType):
                offsets = np.arange(0, values.size + 1, values.shape[1], dtype=np.int32)
                columns.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.reshape(-1))))
            else:
                scalar = values[:, 0]
                if isinstance(field.dataType, IntegralType):
                    scalar = np.rint(scalar)
                elif isinstance(field.dataType, BooleanType):
                    scalar = scalar >= 0.5  # a probability, or a 0/1 regression
                columns.append(pa.array(scalar).cast(to_arrow_type(field.dataType)))
            names.append(field.name)
        yield pa.RecordBatch.from_arrays(columns, names=names)
