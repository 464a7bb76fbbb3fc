"""Training straight from a Spark DataFrame: rows reach the tasks as Arrow batches, in place.

The frame is cut into K partitions once and persisted in Spark's own block manager (memory, then
the executors' disks); every round's job maps over it with `mapInArrow`, so partition k's rows come
to task k as Arrow record batches. Nothing is collected to the driver and nothing is written out to
another system: a table, a Parquet dataset or any query result trains as it is.

A frame holds a label column of class indices and an input column that is either encoded images
(binary: decoded and transformed like shard samples) or fixed-length numeric arrays (features,
reshaped to `feature_shape`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from sparknet.data.sources import EVAL_BATCH, Source, TaskInput, batch_positions
from sparknet.errors import SparknetError

INPUT_COLUMNS = ("image", "features")


@dataclass(frozen=True)
class FrameSource(Source):
    """The worker's view of a DataFrame: how to turn its partition's Arrow rows into batches."""

    label_col: str
    input_col: str
    kind: Literal["image", "features"]
    input_shape: tuple[int, ...]
    num_classes: int | None
    train_size: int
    image_size: int
    #: None: chosen from the task's cores (`loader.default_loader_workers`)
    loader_workers: int | None
    name: str = "a DataFrame"

    def describe(self) -> str:
        return self.name

    def example(self) -> torch.Tensor:
        return torch.zeros(self.input_shape)

    def _columns(self, rows: list | None) -> tuple[np.ndarray, list | np.ndarray]:
        if not rows:
            return np.empty(0, dtype=np.int64), []
        labels = np.concatenate([b.column(self.label_col).to_numpy() for b in rows])
        if self.kind == "image":
            inputs: list | np.ndarray = [
                v for b in rows for v in b.column(self.input_col).to_pylist()
            ]
        else:
            flat = np.concatenate(
                [b.column(self.input_col).flatten().to_numpy(zero_copy_only=False) for b in rows]
            )
            inputs = flat.astype(np.float32, copy=False).reshape(-1, *self.input_shape)
        return labels.astype(np.int64), inputs

    def _batches(self, steps: Iterator[np.ndarray], labels, inputs, transform, g0: int,
                 inp: TaskInput) -> Iterator:  # fmt: skip
        from sparknet.data.loader import Batch, decoded_batches, derived_seed

        if self.kind == "features":
            for idx in steps:
                yield Batch(torch.from_numpy(inputs[idx]), torch.from_numpy(labels[idx]))
            return

        def items() -> Iterator[list]:
            for s, idx in enumerate(steps):
                yield [
                    (inputs[i], int(labels[i]), derived_seed(inp.seed, inp.partition, g0 + s, j))
                    for j, i in enumerate(idx)
                ]

        yield from decoded_batches(
            items(), transform, min_size=self.image_size, workers=self.loader_workers,
            cores=inp.threads,
        )  # fmt: skip

    def train_batches(self, inp: TaskInput, rnd: int, tau: int, batch_size: int) -> Iterator:
        from sparknet.data.imagenet import train_transform

        labels, inputs = self._columns(inp.rows)
        if len(labels) == 0:
            raise SparknetError(f"partition {inp.partition} of {self.name} has no rows")
        steps = (
            batch_positions(inp.seed, inp.partition, len(labels), rnd * tau + s, batch_size)
            for s in range(tau)
        )
        transform = train_transform(self.image_size) if self.kind == "image" else None
        yield from self._batches(steps, labels, inputs, transform, rnd * tau, inp)

    def eval_batches(self, inp: TaskInput) -> Iterator:
        from sparknet.data.imagenet import eval_transform

        labels, inputs = self._columns(inp.rows)
        steps = (
            np.arange(s, min(s + EVAL_BATCH, len(labels)))
            for s in range(0, len(labels), EVAL_BATCH)
        )
        transform = eval_transform(self.image_size) if self.kind == "image" else None
        yield from self._batches(steps, labels, inputs, transform, 0, inp)


@dataclass
class Frames:
    """The driver's handles on the persisted, K-way partitioned train (and eval) frames."""

    train: object  # pyspark.sql.DataFrame
    eval: object | None

    def release(self) -> None:
        """Drop the persisted blocks; a no-op once the session is gone (and its blocks with it)."""
        for df in (self.train, self.eval):
            if df is not None:
                # the session may be stopped already (Ctrl-C): then its blocks went with it
                with contextlib.suppress(Exception):
                    df.unpersist()


def read_frame(spark, spec: str):
    """`parquet:PATH` or `table:NAME` as a DataFrame; a one-line error when it cannot be read."""
    kind, _, target = spec.partition(":")
    try:
        if kind == "parquet":
            return spark.read.parquet(target)
        return spark.table(target)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SparknetError(f"cannot read {spec}: {first}") from exc


def _input_column(df, wanted: str | None, name: str) -> str:
    if wanted is not None:
        if wanted not in df.columns:
            raise SparknetError(
                f"{name} has no column {wanted!r} (it has: {', '.join(df.columns)}); "
                "set --input-col"
            )
        return wanted
    found = [c for c in INPUT_COLUMNS if c in df.columns]
    if not found:
        raise SparknetError(
            f"{name} has no 'image' or 'features' column (it has: {', '.join(df.columns)}); "
            "set --input-col to the column of encoded images or feature arrays"
        )
    return found[0]


def _kind(df, col: str, name: str) -> Literal["image", "features"]:
    from pyspark.sql.types import ArrayType, BinaryType, NumericType

    dtype = df.schema[col].dataType
    if isinstance(dtype, BinaryType):
        return "image"
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, NumericType):
        return "features"
    raise SparknetError(
        f"{name}: column {col!r} is {dtype.simpleString()}; it must hold encoded images "
        "(binary) or numeric arrays"
    )


def prepare_frames(
    train_df,
    eval_df,
    *,
    workers: int,
    label_col: str,
    input_col: str | None,
    num_classes: int | None,
    image_size: int,
    loader_workers: int | None,
    feature_shape: tuple[int, ...] | None = None,
    name: str = "the DataFrame",
) -> tuple[FrameSource, Frames]:
    """Check the frame's columns, count it on the executors, and persist it in K partitions."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegralType

    if label_col not in train_df.columns:
        raise SparknetError(
            f"{name} has no label column {label_col!r} (it has: {', '.join(train_df.columns)}); "
            "set --label-col"
        )
    if not isinstance(train_df.schema[label_col].dataType, IntegralType):
        raise SparknetError(f"{name}: label column {label_col!r} must hold integer class indices")
    col = _input_column(train_df, input_col, name)
    kind = _kind(train_df, col, name)
    aggs = [
        F.count(F.lit(1)).alias("n"),
        F.min(label_col).alias("lo"),
        F.max(label_col).alias("hi"),
        F.sum(F.when(F.col(label_col).isNull() | F.col(col).isNull(), 1).otherwise(0)).alias(
            "nulls"
        ),
    ]
    if kind == "features":
        aggs += [F.min(F.size(col)).alias("min_len"), F.max(F.size(col)).alias("max_len")]
    stats = train_df.agg(*aggs).first().asDict()  # one row of numbers, computed on the executors
    n = stats["n"]
    if n == 0:
        raise SparknetError(f"{name} has no rows")
    if stats["nulls"]:
        raise SparknetError(
            f"{name} has {stats['nulls']} rows with a null label or input; drop them"
        )
    if stats["lo"] < 0:
        raise SparknetError(f"{name}: labels must be class indices >= 0, found {stats['lo']}")
    classes = num_classes or stats["hi"] + 1
    if stats["hi"] >= classes:
        raise SparknetError(
            f"{name}: label {stats['hi']} is out of range for --num-classes {classes}"
        )
    if kind == "features":
        if stats["min_len"] != stats["max_len"]:
            raise SparknetError(
                f"{name}: feature arrays in {col!r} differ in length "
                f"({stats['min_len']} to {stats['max_len']}); they must all be the same"
            )
        shape = feature_shape or (stats["max_len"],)
        if int(np.prod(shape)) != stats["max_len"]:
            raise SparknetError(
                f"{name}: feature shape {shape} does not hold {stats['max_len']} values"
            )
    else:
        shape = (3, image_size, image_size)
    if n < workers:
        raise SparknetError(f"{name} has {n} rows, fewer than --workers {workers}")
    source = FrameSource(
        label_col, col, kind, tuple(shape), classes, n, image_size, loader_workers, name
    )

    def place(df):
        return df.select(label_col, col).repartition(workers).persist(StorageLevel.MEMORY_AND_DISK)

    train = place(train_df)
    evaluation = None
    if eval_df is not None:
        for c in (label_col, col):
            if c not in eval_df.columns:
                raise SparknetError(f"the eval frame has no column {c!r}")
        evaluation = place(eval_df)
    return source, Frames(train, evaluation)
