"""Training straight from a Spark DataFrame: rows reach the tasks as Arrow batches, in place.

The frame is cut into K partitions once and persisted in Spark's own block manager (memory, then
the executors' disks); every round's job maps over it with `mapInArrow`, so partition k's rows come
to task k as Arrow record batches. Nothing is collected to the driver and nothing is written out to
another system: a table, a Parquet dataset or any query result trains as it is.

A frame holds a label column of class indices and an input column that is either encoded images
(binary: decoded and transformed like shard samples) or fixed-length numbers (features: arrays,
or Spark ML vectors taken as arrays, reshaped to `feature_shape`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from sparknet.data import loader
from sparknet.data.sources import EVAL_BATCH, Source, TaskInput, batch_positions
from sparknet.errors import SettingError, SparknetError, first_line

# `# lazy: X` below: pyspark and pyarrow only in the functions that touch a frame; the job's
# checks before a submit (`training.problem`) import this module without Spark

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

    @property
    def input_kind(self) -> str:
        return self.kind

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

    def _batches(self, steps: Iterator[np.ndarray], labels, inputs, decode, g0: int,
                 inp: TaskInput) -> Iterator:  # fmt: skip
        if self.kind == "features":
            for idx in steps:
                yield loader.Batch(torch.from_numpy(inputs[idx]), torch.from_numpy(labels[idx]))
            return

        def items() -> Iterator[list]:
            for s, idx in enumerate(steps):
                yield [
                    (
                        inputs[i],
                        int(labels[i]),
                        loader.derived_seed(inp.seed, inp.partition, g0 + s, j),
                    )
                    for j, i in enumerate(idx)
                ]

        yield from loader.decoded_batches(
            items(), decode, workers=self.loader_workers, cores=inp.threads
        )

    def train_batches(self, inp: TaskInput, first_step: int, tau: int, batch_size: int) -> Iterator:
        from sparknet.data.decode import TrainDecoder  # lazy: PIL

        labels, inputs = self._columns(inp.rows)
        if len(labels) == 0:
            raise SparknetError(
                "partition {partition} of {name} has no rows (its rows did not spread over every "
                "worker): give it more rows or pass fewer {@workers}",
                partition=inp.partition,
                name=self.name,
            )
        steps = (
            batch_positions(inp.seed, inp.partition, len(labels), first_step + s, batch_size)
            for s in range(tau)
        )
        decode = TrainDecoder(self.image_size) if self.kind == "image" else None
        yield from self._batches(steps, labels, inputs, decode, first_step, inp)

    def eval_batches(self, inp: TaskInput) -> Iterator:
        from sparknet.data.decode import EvalDecoder  # lazy: PIL

        labels, inputs = self._columns(inp.rows)
        steps = (
            np.arange(s, min(s + EVAL_BATCH, len(labels)))
            for s in range(0, len(labels), EVAL_BATCH)
        )
        decode = EvalDecoder(self.image_size) if self.kind == "image" else None
        yield from self._batches(steps, labels, inputs, decode, 0, inp)


@dataclass
class Frames:
    """The driver's handles on the persisted, K-way partitioned train (and eval) frames."""

    train: object  # pyspark.sql.DataFrame
    eval: object | None

    def by_rank(self, partitions: int):
        """An RDD of `partitions` partitions whose partition k holds frame partition k's rows of
        both frames, for a barrier stage whose rank k trains on what task k of a `spark`
        transport job would (`mapInArrow` over the persisted frame); unpack with `rank_rows`.

        A DataFrame cannot run a barrier stage over two frames at once, so each frame's
        partitions travel as Arrow IPC blobs, one per record batch, through one shuffle whose
        partitioner is the identity: exact, unlike a hash of the partition number. The shuffle
        runs once per stage (its output is reused when the stage runs again), not per round."""
        tagged = [
            _blobs(frame, split)
            for split, frame in enumerate((self.train, self.eval))
            if frame is not None
        ]
        blobs = tagged[0] if len(tagged) == 1 else tagged[0].unionByName(tagged[1])
        return (
            blobs.rdd.map(lambda r: (r[0], (r[1], r[2], r[3])))
            .partitionBy(partitions, lambda k: k)
            .values()
        )

    def release(self) -> None:
        """Drop the persisted blocks; a no-op once the session is gone (and its blocks with it)."""
        for df in (self.train, self.eval):
            if df is not None:
                # the session may be stopped already (Ctrl-C): then its blocks went with it
                with contextlib.suppress(Exception):
                    df.unpersist()


#: what a frame's partition travels as to its rank: one row per Arrow record batch
_BLOB_SCHEMA = "partition int, split int, seq int, payload binary"


def _blobs(frame, split: int):
    """`frame`'s record batches as Arrow IPC blobs, tagged with their partition and order."""

    def run(batches: Iterator) -> Iterator:
        import pyarrow as pa  # lazy: pyarrow
        from pyspark import TaskContext  # lazy: pyspark

        index = TaskContext.get().partitionId()
        schema = pa.schema(
            [("partition", pa.int32()), ("split", pa.int32()), ("seq", pa.int32()),
             ("payload", pa.binary())]
        )  # fmt: skip
        for seq, batch in enumerate(batches):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            row = {"partition": [index], "split": [split], "seq": [seq],
                   "payload": [sink.getvalue().to_pybytes()]}  # fmt: skip
            yield pa.RecordBatch.from_pydict(row, schema)

    return frame.mapInArrow(run, _BLOB_SCHEMA)


def rank_rows(items: Iterator) -> tuple[list, list]:
    """(train, eval) record batches of one `Frames.by_rank` partition, each in its frame's
    order (a shuffle read interleaves the blocks of different map tasks); eval is empty without
    an eval frame, and for a partition the eval frame left empty."""
    import pyarrow as pa  # lazy: pyarrow

    got: dict[int, list] = {0: [], 1: []}
    for split, seq, payload in items:
        got[split].append((seq, payload))

    def batches(blobs: list) -> list:
        return [pa.ipc.open_stream(payload).read_next_batch() for _, payload in sorted(blobs)]

    return batches(got[0]), batches(got[1])


def read_frame(spark, spec: str):
    """`parquet:PATH` or `table:NAME` as a DataFrame; a one-line error when it cannot be read."""
    kind, _, target = spec.partition(":")
    try:
        if kind == "parquet":
            return spark.read.parquet(target)
        return spark.table(target)
    except Exception as exc:
        raise SparknetError(f"cannot read {spec}: {first_line(exc)}") from exc


def _input_column(df, wanted: str | None, name: str) -> str:
    if wanted is not None:
        if wanted not in df.columns:
            raise SettingError(
                "{name} has no column {value!r} (it has: {columns}); set {@input_col}",
                setting="input_col",
                value=wanted,
                name=name,
                columns=", ".join(df.columns),
            )
        return wanted
    found = [c for c in INPUT_COLUMNS if c in df.columns]
    if not found:
        raise SparknetError(
            "{name} has no 'image' or 'features' column (it has: {columns}); set {@input_col} to "
            "the column of encoded images or feature arrays",
            name=name,
            columns=", ".join(df.columns),
        )
    return found[0]


def as_arrays(df, col: str):
    """`df` with a Spark ML vector column (what `VectorAssembler` makes) as float arrays, the
    form features travel in; any other column as it is."""
    from pyspark.ml.functions import vector_to_array  # lazy: pyspark
    from pyspark.ml.linalg import VectorUDT  # lazy: pyspark

    if col in df.columns and isinstance(df.schema[col].dataType, VectorUDT):
        return df.withColumn(col, vector_to_array(col, "float32"))
    return df


def _kind(df, col: str, name: str) -> Literal["image", "features"]:
    from pyspark.sql.types import ArrayType, BinaryType, NumericType  # lazy: pyspark

    dtype = df.schema[col].dataType
    if isinstance(dtype, BinaryType):
        return "image"
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, NumericType):
        return "features"
    raise SparknetError(
        f"{name}: column {col!r} is {dtype.simpleString()}; it must hold encoded images "
        "(binary), numeric arrays or Spark ML vectors"
    )


@dataclass(frozen=True)
class FrameStats:
    """What one pass over a frame on the executors found: rows, label range, feature length."""

    rows: int
    lo: int
    hi: int
    length: int | None  # feature arrays only


def _label_type(df, label_col: str, name: str) -> bool:
    """True for float labels (Spark ML's StringIndexer makes doubles): they must be integral."""
    from pyspark.sql.types import FractionalType, IntegralType  # lazy: pyspark

    dtype = df.schema[label_col].dataType
    if isinstance(dtype, IntegralType):
        return False
    if isinstance(dtype, FractionalType):
        return True
    raise SparknetError(
        f"{name}: label column {label_col!r} is {dtype.simpleString()}; it must hold class "
        "indices (integers, or integral floats as StringIndexer makes)"
    )


def _check_frame(df, name: str, label_col: str, col: str, kind: str) -> FrameStats:
    """Count `df` and check its labels and inputs in one aggregation on the executors."""
    from pyspark.sql import functions as F  # lazy: pyspark
    from pyspark.sql.types import FractionalType  # lazy: pyspark

    for c in (label_col, col):
        if c not in df.columns:
            setting = "label_col" if c == label_col else "input_col"
            raise SettingError(
                "{name} has no column {value!r} (it has: {columns}); set "
                + ("{@label_col}" if c == label_col else "{@input_col}"),
                setting=setting, value=c, name=name, columns=", ".join(df.columns),
            )  # fmt: skip
    floats = _label_type(df, label_col, name)
    if _kind(df, col, name) != kind:
        raise SparknetError(f"{name}: column {col!r} must hold {kind} like the training frame's")
    label, inputs = F.col(label_col), F.col(col)

    def count(cond):
        return F.sum(F.when(cond, 1).otherwise(0))

    aggs = [
        F.count(F.lit(1)).alias("n"),
        F.min(label_col).alias("lo"),
        F.max(label_col).alias("hi"),
        count(label.isNull() | inputs.isNull()).alias("nulls"),
        count((label != F.floor(label)) | F.isnan(label) if floats else F.lit(False)).alias("frac"),
    ]
    if kind == "features":
        element = df.schema[col].dataType.elementType
        bad = (lambda v: v.isNull() | F.isnan(v)) if isinstance(element, FractionalType) else (
            lambda v: v.isNull()
        )  # fmt: skip
        aggs += [
            F.min(F.size(col)).alias("min_len"),
            F.max(F.size(col)).alias("max_len"),
            count(F.exists(inputs, bad)).alias("bad_elements"),
        ]
    stats = df.agg(*aggs).first().asDict()  # one row of numbers, computed on the executors
    if stats["n"] == 0:
        raise SparknetError(f"{name} has no rows")
    if stats["nulls"]:
        raise SparknetError(
            f"{name} has {stats['nulls']} rows with a null label or input; drop them"
        )
    if stats["frac"]:
        raise SparknetError(
            f"{name}: {stats['frac']} labels in {label_col!r} are not whole numbers; labels are "
            "class indices"
        )
    if stats["lo"] < 0:
        raise SparknetError(f"{name}: labels must be class indices >= 0, found {stats['lo']:g}")
    length = None
    if kind == "features":
        if stats["bad_elements"]:
            raise SparknetError(
                f"{name}: {stats['bad_elements']} feature arrays in {col!r} hold null or NaN "
                "elements; fill or drop them"
            )
        if stats["min_len"] != stats["max_len"]:
            raise SparknetError(
                f"{name}: feature arrays in {col!r} differ in length "
                f"({stats['min_len']} to {stats['max_len']}); they must all be the same"
            )
        length = stats["max_len"]
    return FrameStats(stats["n"], int(stats["lo"]), int(stats["hi"]), length)


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
    eval_name: str = "the eval frame",
) -> tuple[FrameSource, Frames]:
    """Check both frames (columns, labels, inputs) on the executors before any training job,
    and persist them in K partitions."""
    from pyspark import StorageLevel  # lazy: pyspark
    from pyspark.sql import functions as F  # lazy: pyspark

    col = _input_column(train_df, input_col, name)
    train_df = as_arrays(train_df, col)
    if eval_df is not None:
        eval_df = as_arrays(eval_df, col)
    kind = _kind(train_df, col, name)
    stats = _check_frame(train_df, name, label_col, col, kind)
    classes = num_classes or stats.hi + 1
    if stats.hi >= classes:
        raise SettingError(
            "{name}: label {label} is out of range for {@num_classes=value}",
            setting="num_classes",
            value=classes,
            name=name,
            label=stats.hi,
        )
    if kind == "features":
        shape = feature_shape or (stats.length,)
        if int(np.prod(shape)) != stats.length:
            raise SparknetError(
                f"{name}: feature shape {shape} does not hold {stats.length} values"
            )
    else:
        shape = (3, image_size, image_size)
    if stats.rows < workers:
        raise SettingError(
            "{name} has {rows} rows, fewer than {@workers=value}",
            setting="workers",
            value=workers,
            name=name,
            rows=stats.rows,
        )
    if eval_df is not None:
        held = _check_frame(eval_df, eval_name, label_col, col, kind)
        if held.hi >= classes:
            raise SparknetError(
                f"{eval_name}: label {held.hi} is out of range for the {classes} classes of {name}"
            )
        if held.length != stats.length:
            raise SparknetError(
                f"{eval_name}: feature arrays in {col!r} hold {held.length} values, the training "
                f"frame's {stats.length}"
            )
    source = FrameSource(
        label_col, col, kind, tuple(shape), classes, stats.rows, image_size, loader_workers, name
    )

    def place(df):
        # float labels (checked integral) travel as integers, like the rest. A shuffle read
        # takes its blocks in whatever order they arrive (on a cluster, from several
        # executors): each partition is sorted back into the frame's own row order, or the same
        # frame would train a different model each time it is placed (a resume, a second fit)
        columns = [F.col(label_col).cast("long").alias(label_col), col]
        order = F.monotonically_increasing_id().alias("_sparknet_row")
        return (
            df.select(*columns, order)
            .repartition(workers)
            .sortWithinPartitions("_sparknet_row")
            .drop("_sparknet_row")
            .persist(StorageLevel.MEMORY_AND_DISK)
        )

    train = place(train_df)
    return source, Frames(train, place(eval_df) if eval_df is not None else None)
