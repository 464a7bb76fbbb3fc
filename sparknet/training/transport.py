"""How weights and updates travel between the driver and the workers.

`spark`: the weights go out as one broadcast per round (a single flat float32 array, destroyed as
soon as the round's job ends); every task returns its update and the updates are summed on the
executors in a tree whose fan-in bounds what any one task, and the driver, receives. PySpark's own
`treeReduce` merges in arrival order; float addition is not associative, so that would make the
weights depend on task timing. Here every merge is in partition order: the same run gives the same
bits, with or without retried tasks.

Sticky partitions: a worker keeps its inner optimizer state on its executor between rounds, so
partition k's task must run where partition k's task ran before. A plain `parallelize` job's
tasks have no preference and land on whichever executor is free. On a cluster master every job
here maps over one cached K-partition "anchor" RDD made once per run: block k sits on one
executor, the scheduler prefers that executor for task k (PROCESS_LOCAL), and the session waits
for it rather than giving up after 3 s (`session.STICKY_LOCALITY_WAIT`). A lost executor takes
its blocks with it: the task runs elsewhere (an inner-state miss, which the round loop replays
from the last checkpoint), recomputes block k there, and stays there until the partitions are
spread again (docs/how-it-works.md: "How it works").
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gc
import math
import pickle
import re
import sys
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from py4j.protocol import Py4JError, Py4JJavaError
from pyspark import SparkContext, SparkFiles, StorageLevel, TaskContext
from pyspark.errors import PySparkException

from sparknet.errors import PermanentTaskError, SparknetError, is_permanent
from sparknet.training import progress
from sparknet.training.spark_settings import is_local_master

# `# lazy: pyarrow`: only the function `mapInArrow` runs on the executors needs it; the driver and
# a run without a DataFrame never import it

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
    """A permanent fault (`errors.is_permanent`: a `PermanentTaskError`, a full disk, a
    permission) handed back as a task's result instead of raised: Spark retries a raised
    exception up to maxFailures times, and a retry cannot heal these."""

    partition: int
    message: str
    #: the fault itself where it is sparknet's own and pickles (as its template and values):
    #: raised on the driver as it is, so each front end spells its settings
    error: PermanentTaskError | None = None

    @staticmethod
    def of(partition: int, exc: BaseException) -> TaskFault:
        # a DataLoader worker re-raises it with its traceback in the message: keep the cause line
        # (raised by the task itself, it is one line and crosses whole)
        if isinstance(exc, PermanentTaskError) and "\n" not in str(exc) and _pickles(exc):
            return TaskFault(partition, str(exc), exc)
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        mark = "PermanentTaskError: "
        causes = [ln.split(mark, 1)[1] for ln in lines if mark in ln]
        if causes:
            return TaskFault(partition, causes[-1])
        return TaskFault(partition, lines[0] if lines else type(exc).__name__)

    def said(self) -> dict[str, str]:
        """The fault as a JSON message (the `allreduce` stage's channel to the driver): its text,
        and the error itself pickled where it crosses whole (`raised` reads both)."""
        message = {"fault": self.message}
        if self.error is not None:
            message["error"] = base64.b64encode(pickle.dumps(self.error)).decode()
        return message

    @staticmethod
    def raised(message: dict[str, str]) -> SparknetError:
        """The error a `said` message names, for the driver to raise: the task's own where it
        crossed whole (so each front end spells its settings), else one of its text."""
        if "error" in message:
            return pickle.loads(base64.b64decode(message["error"]))
        return PermanentTaskError(message["fault"])


def _pickles(exc: BaseException) -> bool:
    """Whether `exc` crosses to the driver whole (a value of its message may not pickle)."""
    try:
        pickle.dumps(exc)
    except Exception:  # any value that does not pickle: the fault travels as its text
        return False
    return True


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
        import pyarrow as pa  # lazy: pyarrow

        index = TaskContext.get().partitionId()
        payload = pickle.dumps(call(index, list(batches)), protocol=pickle.HIGHEST_PROTOCOL)
        schema = pa.schema([("partition", pa.int32()), ("payload", pa.binary())])
        yield pa.RecordBatch.from_pydict({"partition": [index], "payload": [payload]}, schema)

    return frame.mapInArrow(run, _FRAME_RESULT).rdd.map(lambda r: (r[0], pickle.loads(r[1])))


def describe_task_failure(exc: Exception) -> str:
    """The worker's own exception line out of a Py4J error, e.g. 'SparknetError: model ...'."""
    cause = python_cause(exc)
    if cause is not None:
        return cause
    text = f"{exc}\n{getattr(exc, 'java_exception', '')}"
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def python_cause(exc: BaseException) -> str | None:
    """The last exception line of a Python worker's traceback inside a Spark error (a
    sparknet error's message alone), or None where no Python code failed."""
    text = f"{exc}\n{getattr(exc, 'java_exception', '')}"
    found = [m for line in text.splitlines() if (m := _EXC_LINE.match(line.strip()))]
    python_side = [m for m in found if m.group(1) not in _WRAPPERS]
    if not python_side:
        return None
    name, msg = python_side[-1].groups()
    return msg if name in ("SparknetError", "SettingError") else f"{name}: {msg}"


def threads_per_task(cores: int, tasks_there: int, task_cpus: int = 1, gpus: int = 0) -> int:
    """Torch threads of each task on an executor of `cores` cores that holds `tasks_there` of the
    job's tasks: its cores split over the tasks it runs at once (at most cores // task_cpus, and
    one per GPU when it has `gpus`), at least 1."""
    at_once = min(tasks_there, max(1, cores // max(1, task_cpus)))
    if gpus:
        at_once = min(at_once, gpus)
    return max(1, cores // max(1, at_once))


def partition_threads(
    partitions: int,
    placement: Mapping[int, str],
    cores: Mapping[str, int],
    task_cpus: int = 1,
    gpus: int = 0,
) -> dict[int, int]:
    """{partition: torch threads} from where each partition's block is (`placement`: partition
    -> executor id) and each executor's cores. A partition whose place is unknown (not cached
    yet, its executor lost) gets what it would get with the partitions spread evenly over the
    executors, the smallest executor's share; none known at all: no entry (Spark's task cpus)."""
    per_executor = Counter(placement.values())
    out: dict[int, int] = {}
    if cores:
        even = math.ceil(partitions / len(cores))
        fallback = min(threads_per_task(c, even, task_cpus, gpus) for c in cores.values())
    for k in range(partitions):
        where = placement.get(k)
        if where in cores:
            out[k] = threads_per_task(cores[where], per_executor[where], task_cpus, gpus)
        elif cores:
            out[k] = fallback
    return out


#: len(sys.modules) when this Python worker last froze its objects (0: never)
_frozen_at = 0


def _freeze_imports() -> None:
    """After a task: put the objects alive in this Python worker (torch's and torch._dynamo's,
    about 340,000) out of the cyclic garbage collector's reach, again only once modules were
    imported since.

    pyspark's daemon runs a full `gc.collect()` after every task of a reused worker, and with
    torch loaded each took 0.17 s of CPU: more than a small model's whole round. What is frozen
    here lives as long as the worker anyway (modules, the cached model, the broadcast cache);
    it is still freed by reference counting, and only a reference cycle among it would stay."""
    global _frozen_at
    if len(sys.modules) != _frozen_at:
        gc.collect()
        gc.freeze()
        _frozen_at = len(sys.modules)


def _scala_list(seq) -> list:
    return [seq.apply(i) for i in range(seq.size())]


def executor_cores(sc: SparkContext) -> dict[str, int]:
    """{executor id: cores} of the live executors that run tasks (in local mode: "driver")."""
    listed = _scala_list(sc._jsc.sc().statusStore().executorList(True))
    return {e.id(): int(e.totalCores()) for e in listed if e.totalCores() > 0}


def executor_hosts(sc: SparkContext) -> dict[str, str]:
    """{executor id: host} of the live executors that run tasks."""
    listed = _scala_list(sc._jsc.sc().statusStore().executorList(True))
    return {e.id(): e.hostPort().rsplit(":", 1)[0] for e in listed if e.totalCores() > 0}


def block_placement(sc: SparkContext, rdd) -> dict[int, str]:
    """{partition: executor id} of a cached RDD's blocks, as Spark's status store has them
    (updated asynchronously: a block cached a moment ago may be missing)."""
    try:
        info = sc._jsc.sc().statusStore().rdd(rdd.id())
    except Py4JError:  # not cached (yet)
        return {}
    parts = info.partitions()
    out: dict[int, str] = {}
    for part in _scala_list(parts.get()) if parts.isDefined() else []:
        executors = _scala_list(part.executors())
        if executors:
            out[int(part.blockName().rsplit("_", 1)[1])] = executors[0]
    return out


def conf_int(sc: SparkContext, key: str, default: int) -> int:
    try:
        return int(float(sc.getConf().get(key, str(default))))
    except ValueError:
        return default


def _seconds(sc: SparkContext, key: str, default: str) -> float:
    """A Spark time setting ("30s", "2min", "500ms") in seconds, parsed as Spark parses it."""
    return sc._jsc.sc().conf().getTimeAsMs(key, default) / 1000


def dynamic_allocation(sc: SparkContext) -> bool:
    return sc.getConf().get("spark.dynamicAllocation.enabled", "false").strip().lower() == "true"


#: the registered executors unchanged this long (with a slot among them): no more are coming
SETTLED_S = 2.0

#: the SparkContexts whose executors were waited for already and gave a slot (once is enough)
_WAITED: weakref.WeakSet = weakref.WeakSet()


def task_slots(cores: Mapping[str, int], task_cpus: int, gpus: int) -> int:
    """Tasks the executors of `cores` run at once: cores // spark.task.cpus each, at most one
    per GPU when the executors have `gpus` each."""
    return sum(min(c // task_cpus, gpus) if gpus else c // task_cpus for c in cores.values())


def wait_for_executors(sc: SparkContext, tasks: int) -> dict[str, int]:
    """Executors' cores once they hold `tasks` task slots, or once the registered executors
    stop changing (`SETTLED_S`), or when Spark's own wait for executors
    (spark.scheduler.maxRegisteredResourcesWaitingTime, 30 s) is over: the anchor's blocks go
    where its tasks run, so caching it before the cluster's executors have registered would pile
    every partition onto the first ones for the whole run. Once per session. No slot at all
    after the wait is a SparknetError naming why: a job would wait forever. No wait on a local
    master, nor with dynamic allocation (executors come when tasks wait for them, not before)."""
    if is_local_master(sc.master) or dynamic_allocation(sc) or sc in _WAITED:
        return executor_cores(sc)
    task_cpus = conf_int(sc, "spark.task.cpus", 1)
    gpus = conf_int(sc, "spark.executor.resource.gpu.amount", 0)
    wait_s = _seconds(sc, "spark.scheduler.maxRegisteredResourcesWaitingTime", "30s")
    deadline = time.monotonic() + wait_s
    seen: dict[str, int] | None = None
    since = time.monotonic()
    while True:
        cores = executor_cores(sc)
        slots = task_slots(cores, task_cpus, gpus)
        now = time.monotonic()
        if cores != seen:
            seen, since = cores, now
        if slots >= tasks or now > deadline or (slots and now - since >= SETTLED_S):
            break
        time.sleep(0.2)
    if not slots:
        raise SparknetError(_no_slot(cores, task_cpus, gpus, wait_s))
    _WAITED.add(sc)
    return cores


def _no_slot(cores: Mapping[str, int], task_cpus: int, gpus: int, wait_s: float) -> str:
    """Why no task can run after `wait_s` seconds of waiting for executors, in one line."""
    if gpus and not cores:
        return (
            f"no executor with a GPU registered in {wait_s:.0f} s; the workers need "
            "spark.worker.resource.gpu.amount and a discovery script "
            "(spark.worker.resource.gpu.discoveryScript)"
        )
    if cores:
        return (
            f"no executor can run a task: the executors have at most {max(cores.values())} "
            f"core(s) and spark.task.cpus={task_cpus}; lower spark.task.cpus or give the "
            "executors more cores (spark.executor.cores)"
        )
    need = (
        f" with at least {task_cpus} cores (spark.task.cpus={task_cpus})" if task_cpus > 1 else ""
    )
    return (
        f"no executor registered in {wait_s:.0f} s: the cluster needs a worker{need} with free "
        "cores and memory (another application may hold them)"
    )


def _wait_until_listed(sc: SparkContext, rdd, partitions: int, limit_s: float = 5.0) -> None:
    """Give the status store (fed asynchronously) a moment to list every block just cached, so
    the first round's threads come from the real placement."""
    deadline = time.monotonic() + limit_s
    while len(block_placement(sc, rdd)) < partitions and time.monotonic() < deadline:
        time.sleep(0.05)


def _release(rdd) -> None:
    """Unpersist, quietly: the session may be gone already (and its blocks with it)."""
    with contextlib.suppress(Exception):  # the session (and the blocks) may be gone already
        rdd.unpersist()


def in_band(array: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    """`array` as builtins to broadcast (`array_of` turns it back into the array).

    With `spark.io.encryption.enabled` (every bootstrapped cluster) pyspark streams a broadcast
    through its `ChunkedStream`, whose `write` takes only objects with a length; at pickle
    protocol 5 a numpy array hands it a `PickleBuffer`, and the broadcast fails. Bytes pickle
    in band."""
    return array.dtype.str, array.shape, array.tobytes()


def array_of(value: tuple[str, tuple[int, ...], bytes]) -> np.ndarray:
    """The array `in_band` made builtins of; writable, as an unpickled array is."""
    dtype, shape, data = value
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


#: how long a round's job may have tasks waiting and none running, after an executor was lost
#: while it ran, before it is cancelled and run once more. Spark keeps a task that failed with
#: its executor pending for that executor's cached block (its task set's preferences are made
#: when it starts), and with STICKY_LOCALITY_WAIT it would wait a day for the dead executor; a
#: new job's tasks prefer only the blocks there are. A round run again is the same round: data
#: order and kept inner state are keyed by round.
STALL_S = 10.0
#: how many times one round's job is run again after such a stall
STALL_RETRIES = 3


#: the local property Spark shows as a job's description
_DESCRIPTION = "spark.job.description"


class _StallGuard:
    """Runs the calling thread's jobs in a job group of their own (one the progress guard
    watches) and, with `watch` (a cluster master), from a thread, cancels the group once an
    executor was lost since it began and a stage of it has pending tasks but none running for
    STALL_S. `stalled` says whether it did."""

    def __init__(self, sc: SparkContext, watch: bool = True) -> None:
        self.sc = sc
        self.group = f"{progress.GROUP_PREFIX}{uuid.uuid4().hex[:12]}"
        self.stalled = False
        self.watch = watch
        self._before = set(executor_hosts(sc)) if watch else set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sparknet-stall", daemon=True)
        self._previous: str | None = None

    def __enter__(self) -> _StallGuard:
        if not self.watch:
            # a local master: the caller's job group stays (a user's own `cancelJobGroup` must
            # still reach the run); the progress guard knows the round's jobs by description
            self._previous = self.sc.getLocalProperty(_DESCRIPTION)
            self.sc.setLocalProperty(_DESCRIPTION, progress.ROUND_JOBS)
            return self
        self._previous = self.sc.getLocalProperty("spark.jobGroup.id")
        self.sc.setJobGroup(self.group, progress.ROUND_JOBS, interruptOnCancel=False)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if not self.watch:
            self.sc.setLocalProperty(_DESCRIPTION, self._previous)  # type: ignore[arg-type]
            return
        self._thread.join()
        self.sc.setLocalProperty("spark.jobGroup.id", self._previous)  # type: ignore[arg-type]

    def _watch(self) -> None:
        since: float | None = None
        while not self._stop.wait(1.0):
            try:
                stuck = self._lost() and self._waiting()
            except (Py4JError, PySparkException):  # the session is going away
                return
            if not stuck:
                since = None
                continue
            since = since if since is not None else time.monotonic()
            if time.monotonic() - since >= STALL_S:
                self.stalled = True
                self.sc.cancelJobGroup(self.group)
                return

    def _lost(self) -> bool:
        return bool(self._before - set(executor_hosts(self.sc)))

    def _waiting(self) -> bool:
        """A running stage of the group's jobs has tasks left and none running."""
        tracker = self.sc.statusTracker()
        active = set(tracker.getActiveStageIds())
        for job_id in tracker.getJobIdsForGroup(self.group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id) if stage_id in active else None
                if (
                    stage is not None
                    and stage.numActiveTasks == 0
                    and stage.numCompletedTasks < stage.numTasks
                ):
                    return True
        return False


class SparkTransport:
    """Map a function over K partitions with the weights broadcast once, reduce in a tree."""

    name = "spark"

    def __init__(
        self,
        sc: SparkContext,
        partitions: int,
        fan_in: int | None = None,
        sticky: bool | None = None,
        beacon: progress.Beacon | None = None,
    ) -> None:
        """`sticky`: map over the cached anchor RDD; default: on a cluster master only (a local
        master has one executor, where every task finds its state, and skips its cost).
        `beacon`: where the tasks report their progress (the run's progress guard)."""
        self.sc = sc
        self.beacon = beacon
        self.partitions = partitions
        self.fan_in = fan_in or default_fan_in(partitions)
        self.local = is_local_master(sc.master)
        self.sticky = not self.local if sticky is None else sticky
        self._anchor = None
        self._release = None

    def anchor(self):
        """The run's cached K-partition anchor RDD, made and cached on first use: every job
        without a DataFrame maps over it, so task k runs where block k (and partition k's inner
        state) is. Unpersisted by `close`, or when the transport is dropped."""
        if self._anchor is None:
            wait_for_executors(self.sc, self.partitions)
            anchor = self.sc.parallelize(range(self.partitions), self.partitions)
            anchor.setName("sparknet-partitions").persist(StorageLevel.MEMORY_ONLY)
            anchor.count()
            if not self.local:
                _wait_until_listed(self.sc, anchor, self.partitions)
            self._anchor = anchor
            self._release = weakref.finalize(self, _release, anchor)
            self._release.atexit = False
        return self._anchor

    def executors(self) -> dict[str, str]:
        """{executor id: host} on a cluster master; empty on a local one (one executor, the
        driver's own, that cannot be lost without the run)."""
        return {} if self.local else executor_hosts(self.sc)

    def rebalance(self) -> None:
        """Spread the partitions again over the executors there are now: after a lost
        executor its tasks moved onto the others and stay there (sticky); an executor that
        joined since (a replaced worker) takes tasks only once the anchor is made anew. A
        partition that moves finds its inner state only in a checkpoint of the round before:
        call it right after one is published, or as a replay starts from one."""
        self.close()

    def close(self) -> None:
        """Drop the anchor's cached blocks (a no-op once done, or when the session is gone)."""
        if self._release is not None:
            self._release()
        self._anchor = None

    def task_threads(self, rdd=None) -> dict[int, int]:
        """{partition: torch threads} on a cluster master (its executor's cores over the tasks
        it runs at once); empty on a local master, where Spark's task cpus say it already."""
        if self.local:
            return {}
        placement = block_placement(self.sc, rdd) if rdd is not None else {}
        return partition_threads(
            self.partitions, placement, executor_cores(self.sc),
            conf_int(self.sc, "spark.task.cpus", 1),
            conf_int(self.sc, "spark.executor.resource.gpu.amount", 0),
        )  # fmt: skip

    def map_reduce(
        self,
        theta: np.ndarray,
        work: PartitionWork[R],
        combine: Callable[[R, R], R],
        frame=None,
    ) -> tuple[R, float]:
        """Run `work` on every partition against `theta`; returns (reduced result, broadcast s).

        Without `frame` the job maps over the anchor RDD (on a local master: K plain
        partitions) and the workers read their own data.
        With a DataFrame of K partitions, the job maps over it (`mapInArrow`) and task k gets
        partition k's rows as Arrow record batches; its persisted blocks keep task k in place.
        """
        for attempt in range(STALL_RETRIES + 1):
            guard = _StallGuard(self.sc, watch=not self.local)
            try:
                with guard:
                    return self._map_reduce_once(theta, work, combine, frame)
            except SparknetError:
                if not guard.stalled or attempt == STALL_RETRIES:
                    raise
        raise AssertionError("unreachable")

    def _map_reduce_once(
        self,
        theta: np.ndarray,
        work: PartitionWork[R],
        combine: Callable[[R, R], R],
        frame=None,
    ) -> tuple[R, float]:
        anchor = self.anchor() if frame is None and self.sticky else None
        threads_of = self.task_threads(anchor)
        t0 = time.perf_counter()
        bc = self.sc.broadcast(in_band(theta))
        broadcast_s = time.perf_counter() - t0
        beacon = self.beacon
        try:

            def call(index: int, rows: list | None) -> R:
                ctx = TaskContext.get()
                threads = threads_of.get(index) or (max(1, ctx.cpus()) if ctx else 1)
                attempt = ctx.attemptNumber() if ctx else 0
                local_dir = SparkFiles.getRootDirectory()
                try:
                    with progress.reporting(beacon, index):
                        return work(array_of(bc.value), index, attempt, threads, local_dir, rows)
                except Exception as exc:
                    if is_permanent(exc):  # no retry heals it: the run fails at once
                        return TaskFault.of(index, exc)
                    raise
                finally:
                    _freeze_imports()

            if frame is None:

                def run(index: int, anchor_rows: Iterator) -> Iterator[tuple[int, R]]:
                    # read the anchor's one row: a Python worker that leaves a cached input
                    # unread is not reused (Spark forks a new one for every later task)
                    for _ in anchor_rows:
                        pass
                    yield index, call(index, None)

                if anchor is None:
                    anchor = self.sc.parallelize(range(self.partitions), self.partitions)
                results = anchor.mapPartitionsWithIndex(run)
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
            raise result.error or PermanentTaskError(result.message)
        return result, broadcast_s
