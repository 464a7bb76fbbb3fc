"""`sparknet predict`: a run's model over a dataset, a Parquet row per input, on Spark.

Every source becomes a DataFrame that `SparknetModel.transform` scores on the executors: a
shard dataset's split is read shard by shard in Spark tasks (each shard checked against the
manifest, as training reads it), a built-in or `module:factory` dataset's test set is sent from
the driver, and a DataFrame is read as it is. A row keeps what names its input: a shard
sample's key and label, a dataset sample's index and label, a frame's other columns (or
`key_cols`). A local Parquet dataset appears whole or not at all: it is written beside its
destination and renamed into place once Spark has committed it. An `s3://` one is written by
the tasks themselves through boto3 (pyspark carries no S3 filesystem for Hadoop), an object per
partition, and is whole once its `_SUCCESS` is there (written last; a failure deletes the rest).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sparknet.config import DatasetEntry, load_train_config
from sparknet.data.frames import read_frame
from sparknet.data.s3 import S3Uri
from sparknet.data.sources import (
    ShardSource,
    TensorSource,
    check_frame_path,
    is_frame_spec,
    load_data,
    resolve_source,
    with_split,
)
from sparknet.data.store import SUCCESS, open_store, writable_store
from sparknet.errors import SparknetError, first_line
from sparknet.ml.model import SparknetModel
from sparknet.ml.predict import column_of
from sparknet.training.evaluation import check_fit
from sparknet.training.rundir import read_run_config
from sparknet.training.session import session_for
from sparknet.training.transport import python_cause

StatusCallback = Callable[[str], None]

#: the columns a prediction row adds
PREDICTED = ("prediction", "top_k", "probability")


@dataclass(frozen=True)
class Predicted:
    """What `predict` wrote: where, how many rows, and the inputs that could not be read."""

    out: str
    rows: int
    skipped: int


def predict(
    run: str | Path,
    data: str,
    out: str,
    *,
    split: str | None = None,
    top_k: int | None = None,
    key_cols: list[str] | None = None,
    workers: int | None = None,
    master: str | None = None,
    endpoint_url: str | None = None,
    input_col: str | None = None,
    batch_size: int = 64,
    replace_unfinished: bool = False,
    write_id: str | None = None,
    spark=None,
    datasets: dict[str, DatasetEntry] | None = None,
    on_status: StatusCallback | None = None,
) -> Predicted:
    """Write `out` (`parquet:PATH`, which must not exist) with a row per input of `data`:
    its key columns, `prediction` (the class index), `top_k` (the `top_k` likeliest, default
    5 or the classes if fewer) and `probability` (an array, one per class). With
    `replace_unfinished`, an `s3://` destination holding only an unfinished write (parts and
    no `_SUCCESS`: its writer was killed; with `write_id`, that write's own parts only) is
    deleted first: a restarted job's own leftovers. `write_id` names this write's parts
    (default: a random one)."""
    status = on_status or (lambda _text: None)
    target = _target(out)
    model = SparknetModel.from_run(str(run), endpoint_url)
    classes = model.info.num_classes
    k = min(5, classes) if top_k is None else top_k
    if not 1 <= k <= classes:
        raise SparknetError(
            "{@top_k=k}: the model has {classes} classes; pass 1 to {classes}", k=k,
            classes=classes,
        )  # fmt: skip
    base = read_run_config(run, endpoint_url)
    flags = {"data": data, "workers": workers, "master": master, "endpoint_url": endpoint_url}
    cfg = load_train_config(flags=flags, environ={}, base=base)
    frames = is_frame_spec(data)
    check_frame_path(data, cfg.endpoint_url)  # a parquet: path not there: now, not in Spark
    source = with_split(None if frames else resolve_source(cfg, datasets), data, split)
    if source is not None:
        check_fit(model.saved, source, data)
    on_s3 = target.startswith("s3://")
    if on_s3:  # before Spark: S3 is asked from here
        if write_id is not None and not WRITE_ID.fullmatch(write_id):
            raise SparknetError(
                "{@write_id} must be 1 to 64 letters, digits and - (it names the parts)"
            )
        _refuse_existing_s3(target, endpoint_url, replace_unfinished, write_id)
    with session_for(spark, cfg, status) as spark:
        if not on_s3:
            _refuse_existing(spark, target)
        if frames:
            df, keys, skipped = read_frame(spark, data), key_cols, None
        else:
            df, keys, skipped = _source_frame(spark, source)
        column = input_col or ("image" if model.info.input.kind == "image" else "features")
        keys = (
            list(dict.fromkeys(keys))
            if keys is not None
            else [c for c in df.columns if c != column]
        )
        missing = [c for c in keys if c not in df.columns]
        if missing:
            raise SparknetError(
                "{data} has no column {column!r} (it has: {columns}); pass {@key_col} with "
                "columns it has",
                data=data, column=missing[0], columns=", ".join(df.columns),
            )  # fmt: skip
        model = model.copy(
            {model.inputCol: column, model.topK: k, model.topKCol: "top_k",
             model.batchSize: batch_size}
        )  # fmt: skip
        clash = [c for c in keys if c in PREDICTED]
        if clash:
            raise SparknetError(
                "{data} has a column {column!r}, a name the prediction columns take: pass "
                "{@key_col} without it",
                data=data, column=clash[0],
            )  # fmt: skip
        named = df.select(*(column_of(c) for c in [*keys, column]))
        scored = _rows(model.transform(named), keys)
        status(f"predicting into {target}")
        if on_s3:
            tag = write_id or uuid.uuid4().hex[:8]
            with _deleted_unless_whole(target, endpoint_url, tag):
                rows = _write_s3(scored, target, endpoint_url, tag)
        else:
            rows = _write(spark, scored, target)
        dropped = skipped.value if skipped is not None else 0
    return Predicted(target, rows, dropped)


def _target(out: str) -> str:
    kind, _, path = out.partition(":")
    if kind != "parquet" or not path:
        raise SparknetError("{@out=out}: write predictions as parquet:PATH", out=out)
    return path


def _rows(scored, keys: list[str]):
    """The key columns and the prediction columns, as plain types a Parquet reader outside
    Spark takes (an integer class, an array of probabilities rather than Spark ML's vector)."""
    from pyspark.ml.functions import vector_to_array  # lazy: pyspark
    from pyspark.sql import functions as F  # lazy: pyspark

    return scored.select(
        *(column_of(c) for c in keys),
        F.col("prediction").cast("int").alias("prediction"),
        F.col("top_k"),
        vector_to_array("probability", "float32").alias("probability"),
    )


def _source_frame(spark, source):
    """A dataset as a DataFrame of (key, label, input): a shard split read in Spark tasks, a
    Dataset's test set from the driver; with the accumulator of samples that could not be
    read (None where none can be bad)."""
    if isinstance(source, TensorSource):
        test = load_data(source.spec).test
        rows = [
            (i, int(y), [float(v) for v in x.flatten().tolist()])
            for i, (x, y) in enumerate(test)
        ]  # fmt: skip
        df = spark.createDataFrame(rows, "index long, label long, features array<float>")
        return df, ["index", "label"], None
    assert isinstance(source, ShardSource)
    shards = source.manifest.shards(source.eval_split)
    skipped = spark.sparkContext.accumulator(0)

    def read(infos: Iterator) -> Iterator[tuple]:
        for info in infos:
            for s in source.samples(info):
                if s is None:
                    skipped.add(1)
                else:
                    yield (s.key, s.label, bytearray(s.data))

    rdd = spark.sparkContext.parallelize(shards, max(1, len(shards))).mapPartitions(read)
    df = spark.createDataFrame(rdd, "key string, label long, image binary")
    return df, ["key", "label"], skipped


def _hadoop_path(spark, path: str):
    jvm = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    return hpath, hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())


def _refuse_existing(spark, target: str) -> None:
    """`target` is not there, and a local one's parents are dirs (or can be)."""
    hpath, fs = _hadoop_path(spark, target)
    if fs.exists(hpath):
        raise SparknetError("{target} exists: choose another {@out}, or remove it", target=target)
    if "://" not in target or target.startswith("file:"):
        local = Path(target.removeprefix("file:"))
        for parent in local.parents:
            if parent.exists() and not parent.is_dir():
                raise SparknetError(
                    "{target}: {parent} is a file; choose another {@out}", target=target,
                    parent=parent,
                )  # fmt: skip


def _write(spark, scored, target: str) -> int:
    """Write beside `target`, then rename into place; nothing at `target` unless whole."""
    temp = f"{target.rstrip('/')}.sparknet-{uuid.uuid4().hex[:8]}.tmp"
    tpath, fs = _hadoop_path(spark, temp)
    try:
        scored.write.parquet(temp)
        rows = spark.read.parquet(temp).count()
        final, _ = _hadoop_path(spark, target)
        if fs.exists(final):  # another run wrote it meanwhile: a rename would move into it
            _refuse_existing(spark, target)
        if not fs.rename(tpath, final):
            raise SparknetError(f"could not move the predictions into {target}")
        return rows
    except Exception as exc:
        if isinstance(exc, SparknetError):
            raise
        raise SparknetError(f"writing {target} failed: {_reason(exc)}") from exc
    finally:
        if fs.exists(tpath):
            fs.delete(tpath, True)


#: what a write's id may be (a part's name holds it)
WRITE_ID = re.compile(r"[A-Za-z0-9-]{1,64}")
#: a part of an `s3://` prediction dataset: its partition and its write's id
_PART = re.compile(rf"part-[0-9]{{5}}-({WRITE_ID.pattern})\.parquet")
#: the id predict gives a write without one: what `--replace-unfinished` alone takes for its
#: own (Spark's parts, `part-NNNNN-<uuid>-c000.parquet`, never match it)
_OWN_ID = re.compile(r"[0-9a-f]{8}")


def _is_part(name: str, write_id: str | None) -> bool:
    """Whether `name` is a part of predict's: of the write `write_id`, else of any write whose
    id predict itself made."""
    m = _PART.fullmatch(name)
    if m is None:
        return False
    return m[1] == write_id if write_id is not None else bool(_OWN_ID.fullmatch(m[1]))


def _refuse_existing_s3(
    target: str, endpoint_url: str | None, replace_unfinished: bool, write_id: str | None
) -> None:
    """Nothing under `target` yet, and a probe object can be written there. With
    `replace_unfinished`, a write that never finished (parts of predictions and no
    `_SUCCESS`; with `write_id`, only that write's own parts: a restarted job's) is deleted
    first; anything else there is refused, never deleted."""
    try:
        store = writable_store(target, endpoint_url)
        there = set(store.walk())
        where = S3Uri.parse(target)
        if where.key and open_store(f"s3://{where.bucket}", endpoint_url).size(where.key):
            there.add(where.key)  # an object of that very name: readers would open it instead
        parts = {n for n in there if _is_part(n, write_id)}
        unfinished = bool(there) and there == parts
        if unfinished and replace_unfinished:
            store.delete(parts)
            there = set()
    except SparknetError as exc:
        raise SparknetError("{@out}: {cause:line}", cause=exc) from exc
    if there:
        hint = (
            " (a write that never finished: {@replace_unfinished} deletes it)" if unfinished else ""
        )
        raise SparknetError(
            "{target} exists: choose another {@out}, or remove it" + hint, target=target
        )


def _write_s3(scored, target: str, endpoint_url: str | None, write_id: str) -> int:
    """Each partition's rows as one Parquet object under `target`, put by its own task (a
    retried task puts the same name again), then `_SUCCESS` from the driver, naming the parts
    it vouches for; the rows. Another write's parts there by then (two runs given one
    destination at once) fail this one: no dataset is made of two writes."""
    import pyarrow as pa  # lazy: pyarrow
    from pyspark.sql.pandas.types import to_arrow_schema  # lazy: pyspark

    schema = to_arrow_schema(scored.schema)

    def put(batches: Iterator) -> Iterator:
        import pyarrow.parquet as pq  # lazy: on the executor
        from pyspark import TaskContext  # lazy: on the executor

        buffer, rows = io.BytesIO(), 0
        with pq.ParquetWriter(buffer, schema) as writer:
            for batch in batches:
                writer.write_table(pa.Table.from_batches([batch]).cast(schema))
                rows += batch.num_rows
        name = f"part-{TaskContext.get().partitionId():05d}-{write_id}.parquet"
        open_store(target, endpoint_url).write_bytes(name, buffer.getvalue())
        yield pa.RecordBatch.from_pylist([{"rows": rows}])

    try:
        rows = sum(r["rows"] for r in scored.mapInArrow(put, "rows long").collect())
    except SparknetError:
        raise
    except Exception as exc:
        raise SparknetError(f"writing {target} failed: {_reason(exc)}") from exc
    store = open_store(target, endpoint_url)
    there = set(store.walk())
    ours = {n for n in there if _is_part(n, write_id)}
    if there - ours:
        raise SparknetError(
            "another write into {target} came in while this one ran ({name}); this one is "
            "deleted: give each run its own {@out}",
            target=target, name=sorted(there - ours)[0],
        )  # fmt: skip
    store.write_bytes(SUCCESS, json.dumps({"rows": rows, "parts": sorted(ours)}).encode())
    return rows


@contextlib.contextmanager
def _deleted_unless_whole(target: str, endpoint_url: str | None, write_id: str) -> Iterator[None]:
    """What the block wrote under `target` (the parts of `write_id`, never another write's) is
    deleted where it raises (Ctrl-C included): then, and once more after Spark's jobs were
    cancelled, so a task that was still putting its part when the first delete ran leaves
    nothing either."""
    store = open_store(target, endpoint_url)

    def delete_ours() -> None:
        store.delete([n for n in store.walk() if _is_part(n, write_id)])

    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # what failed says more than a failed clean-up
            delete_ours()
            _cancel_spark_jobs()
            delete_ours()
        raise


def _cancel_spark_jobs() -> None:
    """Cancel what the active Spark session still runs (the tasks of a write that failed)."""
    from pyspark.sql import SparkSession  # lazy: pyspark

    spark = SparkSession.getActiveSession()
    if spark is not None:
        spark.sparkContext.cancelAllJobs()


def _reason(exc: BaseException) -> str:
    """A failed write's cause in one line: a task's own Python error where one failed it
    (Spark's first line only says that one did), else the Java one (py4j's first line only
    names the call)."""
    cause = python_cause(exc)
    if cause is not None:
        return cause
    java = getattr(exc, "java_exception", None)
    line = first_line(str(java.toString())) if java is not None else first_line(exc)
    raised = _RAISED.search(line)  # a row `checked_column` refused: its own words alone
    return raised[1] if raised else line


#: Spark's wrapping of a `raise_error` message (sparknet's own are prefixed `sparknet: `)
_RAISED = re.compile(r"\[USER_RAISED_EXCEPTION\]\s*(?:sparknet: )?(.*?)\s*(?:SQLSTATE: \w+)?$")
