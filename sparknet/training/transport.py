"""How weights and updates travel between the driver and the workers.

`spark`: the weights go out as one broadcast per round (a single flat float32 array, destroyed as
soon as the round's job ends); every task returns its update and the updates are summed on the
executors in a tree whose fan-in bounds what any one task, and the driver, receives. PySpark's own
`treeReduce` merges in arrival order; float addition is not associative, so that would make the
weights depend on task timing. Here every merge is in partition order: the same run gives the same
bits, with or without retried tasks.
"""

from __future__ import annotations

import functools
import math
import pickle
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from py4j.protocol import Py4JJavaError
from pyspark import SparkContext, SparkFiles, TaskContext
from pyspark.errors import PySparkException

from sparknet.errors import PermanentTaskError, SparknetError

R = TypeVar("R")

#: work(theta, partition, attempt, threads, local_dir, rows) -> one partition's result; `rows` is
#: the partition's Arrow record batches when the job maps over a DataFrame, else None
PartitionWork = Callable[[np.ndarray, int, int, int, str, list | None], R]

#: what a task of a DataFrame job returns: its partition and its pickled result
_FRAME_RESULT = "partition int, payload binary"

_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Failure)): (.+)$")


_WRAPPERS = {"Py4JJavaError", "PythonException", "SparkException", "PySparkRuntimeError"}


@dataclass(frozen=True)
class TaskFault:
    """A `PermanentTaskError` handed back as a task's result instead of raised: Spark retries a
    raised exception up to maxFailures times, and a retry cannot heal these."""

    partition: int
    message: str

    @staticmethod
    def of(partition: int, exc: PermanentTaskError) -> TaskFault:
        # a DataLoader worker re-raises it with its traceback in the message: keep the cause line
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        mark = "PermanentTaskError: "
        causes = [ln.split(mark, 1)[1] for ln in lines if mark in ln]
        if causes:
            return TaskFault(partition, causes[-1])
        return TaskFault(partition, lines[0] if lines else type(exc).__name__)


def _fault_first(combine: Callable[[R, R], R]) -> Callable:
    """`combine`, except that a fault wins (the lowest partition's, as merges are ordered)."""

    def merge(a, b):
        if isinstance(a, TaskFault):
            return a
        if isinstance(b, TaskFault):
            return b
        return combine(a, b)

    return merge


def default_fan_in(partitions: int) -> int:
    """sqrt(K), at least 2: a two-level tree like Spark's `treeReduce(depth=2)`."""
    return max(2, math.ceil(math.sqrt(partitions)))


def _merge_sorted(combine: Callable[[R, R], R]) -> Callable[[Iterator], Iterator]:
    def merge(items: Iterator[tuple[int, tuple[int, R]]]) -> Iterator[tuple[int, R]]:
        ordered = sorted(items, key=lambda kv: kv[1][0])
        if ordered:
            yield ordered[0][0], functools.reduce(combine, (v for _, (_, v) in ordered))

    return merge


def tree_reduce(rdd, combine: Callable[[R, R], R], fan_in: int) -> R:
    """Reduce an RDD of (index, value) pairs, merging in index order at every level of the tree."""
    if fan_in < 2:
        raise ValueError(f"fan_in must be >= 2, got {fan_in}")
    n = rdd.getNumPartitions()
    while n > fan_in:
        n = math.ceil(n / fan_in)
        rdd = (
            rdd.map(lambda kv, f=fan_in: (kv[0] // f, kv))
            .partitionBy(n, lambda group: group)
            .mapPartitions(_merge_sorted(combine))
        )
    parts = sorted(rdd.collect(), key=lambda kv: kv[0])
    if not parts:
        raise ValueError("tree_reduce of an empty RDD")
    return functools.reduce(combine, (v for _, v in parts))


def _map_frame(frame, call: Callable[[int, list], R]):
    """(partition, result) pairs of `call` over each partition's Arrow batches of `frame`."""

    def run(batches: Iterator) -> Iterator:
        import pyarrow as pa

        index = TaskContext.get().partitionId()
        payload = pickle.dumps(call(index, list(batches)), protocol=pickle.HIGHEST_PROTOCOL)
        schema = pa.schema([("partition", pa.int32()), ("payload", pa.binary())])
        yield pa.RecordBatch.from_pydict({"partition": [index], "payload": [payload]}, schema)

    return frame.mapInArrow(run, _FRAME_RESULT).rdd.map(lambda r: (r[0], pickle.loads(r[1])))


def describe_task_failure(exc: Exception) -> str:
    """The worker's own exception line out of a Py4J error, e.g. 'SparknetError: model ...'."""
    text = f"{exc}\n{getattr(exc, 'java_exception', '')}"
    found = [m for line in text.splitlines() if (m := _EXC_LINE.match(line.strip()))]
    python_side = [m for m in found if m.group(1) not in _WRAPPERS]
    if python_side:
        name, msg = python_side[-1].groups()
        return msg if name == "SparknetError" else f"{name}: {msg}"
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class SparkTransport:
    """Map a function over K partitions with the weights broadcast once, reduce in a tree."""

    name = "spark"

    def __init__(self, sc: SparkContext, partitions: int, fan_in: int | None = None) -> None:
        self.sc = sc
        self.partitions = partitions
        self.fan_in = fan_in or default_fan_in(partitions)

    def map_reduce(
        self,
        theta: np.ndarray,
        work: PartitionWork[R],
        combine: Callable[[R, R], R],
        frame=None,
    ) -> tuple[R, float]:
        """Run `work` on every partition against `theta`; returns (reduced result, broadcast s).

        Without `frame` the job has K empty partitions and the workers read their own data. With
        a DataFrame of K partitions, the job maps over it (`mapInArrow`) and task k gets
        partition k's rows as Arrow record batches.
        """
        t0 = time.perf_counter()
        bc = self.sc.broadcast(theta)
        broadcast_s = time.perf_counter() - t0
        try:

            def call(index: int, rows: list | None) -> R:
                ctx = TaskContext.get()
                threads = max(1, ctx.cpus()) if ctx else 1
                attempt = ctx.attemptNumber() if ctx else 0
                local_dir = SparkFiles.getRootDirectory()
                try:
                    return work(bc.value, index, attempt, threads, local_dir, rows)
                except PermanentTaskError as exc:
                    return TaskFault.of(index, exc)

            if frame is None:

                def run(index: int, _rows: Iterator) -> Iterator[tuple[int, R]]:
                    yield index, call(index, None)

                rdd = self.sc.parallelize(range(self.partitions), self.partitions)
                results = rdd.mapPartitionsWithIndex(run)
            else:
                results = _map_frame(frame, call)
            result = tree_reduce(results, _fault_first(combine), self.fan_in)
        except (Py4JJavaError, PySparkException) as exc:
            raise SparknetError(
                f"a Spark task failed after all retries: {describe_task_failure(exc)}"
            ) from exc
        finally:
            bc.destroy()
        if isinstance(result, TaskFault):
            raise PermanentTaskError(result.message)
        return result, broadcast_s
