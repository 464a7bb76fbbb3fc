"""A run's model applied to a DataFrame column on the executors, in batches.

The driver checks the column against what the model takes (`model.json`) and builds a
`predict_batch_udf` whose closure holds the model as bytes (pyspark ships a closure over 1 MB as
a broadcast, so a ResNet-50 travels once to each executor, not with every task). Each executor's
Python worker rebuilds the module once and keeps it for the UDF's life, on the GPU Spark gave the
task where there is one. An image is decoded, resized, centre-cropped and normalised exactly as
the run's evaluation did, so a prediction is the one the run's own test figures counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sparknet.errors import SparknetError, first_line
from sparknet.training.saved_model import ModelInfo, SavedModel

#: the struct the UDF returns; the transformer spreads it into the output columns
PREDICTION, PROBABILITY, TOP_K = "prediction", "probability", "top_k"


@dataclass(frozen=True)
class ColumnInput:
    """How an input column reaches the model: encoded images, or flat numbers reshaped."""

    column: str
    images: bool
    #: features: how many numbers one row holds (the product of the model's input shape)
    length: int | None = None
    #: features: a Spark ML vector column, not an array
    vector: bool = False


def column_input(df, column: str, info: ModelInfo, where: str) -> ColumnInput:
    """Check `df[column]` against the model's input on the driver (no Spark job): one line
    naming what to change where the column cannot be what the model takes."""
    from pyspark.ml.linalg import VectorUDT  # lazy: pyspark
    from pyspark.sql.types import ArrayType, BinaryType, NumericType  # lazy: pyspark

    same = [c for c in df.columns if c.lower() == column.lower()]
    if column not in df.columns and len(same) == 1:
        column = same[0]  # as Spark resolves it (spark.sql.caseSensitive is off)
    if column not in df.columns:
        raise SparknetError(
            f"the DataFrame has no column {column!r} (it has: {', '.join(df.columns)}); set "
            "inputCol to the column the model reads"
        )
    field = df.schema[column]
    dtype = field.dataType
    shape = info.input.shape
    if info.input.kind == "image":
        if not isinstance(dtype, BinaryType):
            raise SparknetError(
                f"column {column!r} is {dtype.simpleString()}, but the model of {where} takes "
                f"encoded images (binary, as spark.read.format('binaryFile') reads them); set "
                "inputCol to such a column"
            )
        return ColumnInput(column, True)
    length = int(np.prod(shape))
    numbers = isinstance(dtype, ArrayType) and isinstance(dtype.elementType, NumericType)
    if not (numbers or isinstance(dtype, VectorUDT)):
        takes = "shape " + "x".join(map(str, shape))
        raise SparknetError(
            f"column {column!r} is {dtype.simpleString()}, but the model of {where} takes "
            f"{length} numbers a row ({takes}) as an array or a Spark ML vector; set inputCol "
            "to such a column"
        )
    size = field.metadata.get("ml_attr", {}).get("num_attrs")  # VectorAssembler records it
    if size is not None and size != length:
        raise SparknetError(
            f"column {column!r} holds vectors of {size} values, but the model of {where} takes "
            f"{length}: assemble the features it trained on"
        )
    return ColumnInput(column, False, length, isinstance(dtype, VectorUDT))


def checked_column(inp: ColumnInput, where: str):
    """The input column as the UDF takes it, checked row by row on the executors before any
    row reaches Python: a null, an array of another length, or a null, NaN or infinite number
    in it fails the task with one line (Spark's `raise_error`), where a reshape error deep in
    pyspark, or a silent prediction from NaN, would be. (The null test comes first: Spark's
    `vector_to_array` of a null fails in the JVM.)"""
    from pyspark.ml.functions import vector_to_array  # lazy: pyspark
    from pyspark.sql import functions as F  # lazy: pyspark

    raw = column_of(inp.column)
    null = F.raise_error(F.lit(f"sparknet: a row's {inp.column!r} is null; drop or fill it"))
    if inp.images:
        return F.when(raw.isNull(), null).otherwise(raw)
    col = vector_to_array(raw, "float32") if inp.vector else raw
    pattern = (
        _literal(f"sparknet: a row's {inp.column!r} holds ") + "%d"
        + _literal(f" values, but the model of {where} takes {inp.length}")
    )  # fmt: skip
    wrong = F.raise_error(F.format_string(pattern, F.size(col)))
    bad = F.raise_error(
        F.lit(f"sparknet: a row's {inp.column!r} holds a null, NaN or infinite number; fill or "
              "drop it")
    )  # fmt: skip
    finite = F.forall(
        col, lambda v: v.isNotNull() & ~F.isnan(v) & (F.abs(v) != float("inf"))
    )  # fmt: skip
    return (
        F.when(raw.isNull(), null)
        .when(F.size(col) != inp.length, wrong)
        .when(~finite, bad)
        .otherwise(col)
    )


def column_of(name: str):
    """A column by its name as it is: a `.` or a backtick in it is part of the name, not a
    path into a struct."""
    from pyspark.sql import functions as F  # lazy: pyspark

    return F.col("`" + name.replace("`", "``") + "`")


def _literal(text: str) -> str:
    """`text` for `format_string`'s pattern, its own `%` kept as text (a run dir may hold one)."""
    return text.replace("%", "%%")


def prediction_udf(saved: SavedModel, inp: ColumnInput, *, top_k: int, batch_size: int,
                   device: str):  # fmt: skip
    """The `predict_batch_udf` that maps the (checked) input column to the prediction struct."""
    from pyspark.ml.functions import predict_batch_udf  # lazy: pyspark
    from pyspark.sql.types import (  # lazy: pyspark
        ArrayType,
        DoubleType,
        FloatType,
        IntegerType,
        StructField,
        StructType,
    )

    fields = [
        StructField(PREDICTION, DoubleType()),
        StructField(PROBABILITY, ArrayType(FloatType())),
    ]
    if top_k:
        fields.append(StructField(TOP_K, ArrayType(IntegerType())))
    info_json, weights, where = saved.info_json(), saved.weights, saved.where

    def make_predict_fn() -> Callable[[np.ndarray], dict[str, np.ndarray]]:
        return Predictor(SavedModel.of(info_json, weights, where), inp, top_k, device)

    udf = predict_batch_udf(
        make_predict_fn,
        return_type=StructType(fields),
        batch_size=batch_size,
        input_tensor_shapes=None if inp.images else [[inp.length]],
    )
    # deterministic, Spark may copy the call into a filter on `prediction` as well as the
    # projection: the model would run twice over every row
    return udf.asNondeterministic()


class Predictor:
    """On an executor: the module on the task's device, and a batch of column values in, the
    prediction struct's columns out (what `predict_batch_udf` calls)."""

    def __init__(self, saved: SavedModel, inp: ColumnInput, top_k: int, device: str) -> None:
        from sparknet.training.device import task_device  # lazy: pyspark's TaskContext

        self.info, self.inp, self.top_k = saved.info, inp, top_k
        self.device = task_device(device)
        self.model = saved.build().to(self.device)
        self.where = saved.where
        if inp.images:
            from sparknet.data.decode import EvalDecoder  # lazy: PIL, torchvision

            self.decode = EvalDecoder(saved.info.input.image_size)

    def inputs(self, values: np.ndarray) -> torch.Tensor:
        """A batch as the model takes it: images decoded and transformed as the run evaluated
        them; numbers as float32 in the recorded shape."""
        if not self.inp.images:
            x = torch.from_numpy(np.asarray(values, dtype=np.float32))
            return x.reshape(len(values), *self.info.input.shape)
        from sparknet.data.decode import normalize  # lazy: PIL, torchvision

        images = []
        for value in values:
            try:
                images.append(self.decode(bytes(value)))
            except Exception as exc:  # PIL raises several kinds for bytes that are no image
                raise SparknetError(
                    f"a row's {self.inp.column!r} is not an image sparknet can decode: "
                    f"{first_line(exc)}; drop it or re-encode it (JPEG or PNG)"
                ) from exc
        spec = self.info.input
        return normalize(torch.stack(images), spec.mean, spec.std)

    @torch.no_grad()
    def __call__(self, values: np.ndarray) -> dict[str, np.ndarray]:
        x = self.inputs(values).to(self.device)
        try:
            logits = self.model(x).float()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not _out_of_memory(exc):
                raise
            raise SparknetError(
                f"a batch of {len(x)} does not fit in the memory of {self.device}: set batchSize "
                "lower"
            ) from exc
        probability = logits.softmax(1)
        out = {
            PREDICTION: logits.argmax(1).double().cpu().numpy(),
            PROBABILITY: probability.cpu().numpy(),
        }
        if self.top_k:
            out[TOP_K] = logits.topk(self.top_k, dim=1).indices.int().cpu().numpy()
        return out


def _out_of_memory(exc: BaseException) -> bool:
    """A GPU's out-of-memory error, or the CPU allocator's (a plain RuntimeError: "can't
    allocate memory")."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)
