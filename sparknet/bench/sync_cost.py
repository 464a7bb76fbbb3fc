"""What one synchronization round costs through Spark, against the collective it stands in for.

A sparknet round moves the weights out to every worker and the updates back. For a large model
that traffic, not the compute, bounds how small tau can be, so the `spark` transport is measured
on a ~100 MB model with no compute at all and set against a gloo all_reduce of the same bytes
between two plain processes, the floor a collective library reaches on the same machine. The goal
is to stay within 6x of it.

For reference the same round is also timed the naive way (broadcast, collect, sum on the driver)
and with PySpark's own `treeReduce`, and the transport's time is taken apart: the broadcast, an
empty job, a job that only reads the broadcast, and the return path of the updates split at the
points where PySpark hands data between processes (Python worker -> executor JVM -> driver JVM ->
driver Python). Those parts are what any optimisation of the transport has to shrink.

Every update passes through the driver JVM's heap several times over on its way back, so how
large that heap is decides whether a round of this size completes at all: at Spark's default
1 GiB two 100 MB task results can exhaust it, and the job then waits forever. `start_session`
sizes the heap (and the result limit) for that, and the benchmark takes the session exactly as
the product starts it, so the figures are the ones a user gets; the heap it chose is recorded.
"""

from __future__ import annotations

import operator
import os
import pickle
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from pyspark.rdd import _load_from_socket  # RDD.collect's second half

from sparknet.bench.common import machine_note, median, steal_note, timed, write_results
from sparknet.bench.gloo import gloo_all_reduce
from sparknet.training.session import start_session
from sparknet.training.transport import SparkTransport
from sparknet.training.worker import Contribution

NAME = "sync_cost"
WORKERS = 2
MASTER = "local[2,4]"
GOAL = 6.0


# ---- Spark rounds ---------------------------------------------------------------------------


def _half(
    theta: np.ndarray, partition: int, attempt: int, threads: int, local_dir: str, rows: list | None
) -> Contribution:
    """A round with no compute: the update is a fresh array of the weights' size.

    `reports` carries (partition, wall time the work began, wall time it ended) instead of
    WorkerReports, to split the round on the driver; `Contribution.combine` only concatenates it.
    """
    started = time.time()
    out = theta * np.float32(0.5)
    return Contribution(partition, out, 1, None, [(partition, started, time.time())])


def transport_rounds(
    transport: SparkTransport, theta: np.ndarray, warmup: int, reps: int
) -> dict[str, list[float]]:
    """Seconds per `map_reduce` round, and its parts from the tasks' own clocks."""
    parts: dict[str, list[float]] = {"total": [], "broadcast": [], "launch": [], "return": []}
    for i in range(warmup + reps):
        t0 = time.time()
        contrib, broadcast_s = transport.map_reduce(theta, _half, Contribution.combine)
        t_end = time.time()
        if i < warmup:
            continue
        started = min(s for _, s, _ in contrib.reports)
        finished = max(f for _, _, f in contrib.reports)
        parts["total"].append(t_end - t0)
        parts["broadcast"].append(broadcast_s)
        parts["launch"].append(started - t0 - broadcast_s)
        parts["return"].append(t_end - finished)
    return parts


def naive_round(sc: Any, theta: np.ndarray) -> np.ndarray:
    """Broadcast, every task returns its array, `collect()`, sum on the driver."""
    bc = sc.broadcast(theta)
    try:
        arrays = (
            sc.parallelize(range(WORKERS), WORKERS)
            .mapPartitions(lambda _: [bc.value * np.float32(0.5)])
            .collect()
        )
        return np.sum(arrays, axis=0)
    finally:
        bc.destroy()


def tree_reduce_round(sc: Any, theta: np.ndarray) -> np.ndarray:
    """Broadcast and PySpark's own `treeReduce` (merges in arrival order)."""
    bc = sc.broadcast(theta)
    try:
        rdd = sc.parallelize(range(WORKERS), WORKERS)
        return rdd.map(lambda _: bc.value * np.float32(0.5)).treeReduce(operator.add)
    finally:
        bc.destroy()


def jvm_gc_seconds(sc: Any) -> float:
    """Total GC time of the driver JVM (which is also the executor in local mode)."""
    beans = sc._jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
    return sum(max(0, b.getCollectionTime()) for b in beans) / 1000.0


def breakdown(sc: Any, theta: np.ndarray, warmup: int, reps: int) -> dict[str, float]:
    """Median seconds of the pieces a transport round is made of."""
    size = theta.size
    base = sc.parallelize(range(WORKERS), WORKERS)
    out: dict[str, float] = {}

    # The weights going out.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "theta.pkl")

        def dump() -> None:
            with open(path, "wb") as f:
                pickle.dump(theta, f, pickle.HIGHEST_PROTOCOL)

        out["pickle theta to a file, in-process"] = median(timed(dump, warmup, reps))
    created, destroyed = [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        bc = sc.broadcast(theta)
        t1 = time.perf_counter()
        bc.destroy()
        if i >= warmup:
            created.append(t1 - t0)
            destroyed.append(time.perf_counter() - t1)
    out["sc.broadcast(theta)"] = median(created)
    out["bc.destroy()"] = median(destroyed)

    out["empty job (2 tasks, return nothing)"] = median(
        timed(lambda: base.mapPartitions(lambda _: iter(())).collect(), warmup, reps)
    )

    def read_job() -> None:
        bc = sc.broadcast(theta)
        try:

            def read(_: Iterator) -> Iterator[float]:
                t0 = time.perf_counter()
                value = bc.value
                yield time.perf_counter() - t0 + 0.0 * float(value[0])

            in_task.append(max(base.mapPartitions(read).collect()))
        finally:
            bc.destroy()

    in_task: list[float] = []
    read_total = timed(read_job, warmup, reps)
    out["job reading bc.value, returning nothing (incl. broadcast)"] = median(read_total)
    out["  of which bc.value inside the task (slower task)"] = median(in_task[warmup:])

    # The updates coming back, cut where PySpark hands the data to the next process.
    make = base.mapPartitions(lambda _: [np.full(size, 0.5, dtype=np.float32)])
    out["job making the array, returning nothing"] = median(
        timed(
            lambda: base.mapPartitions(lambda _: [np.full(size, 0.5, np.float32).size]).count(),
            warmup,
            reps,
        )
    )
    out["job returning the array, to the executor JVM (_jrdd.count)"] = median(
        timed(lambda: make._jrdd.count(), warmup, reps)
    )
    # `RDD.collect` in its two halves: the job, whose results end in the driver JVM, then
    # serving them to the driver's Python over a local socket and unpickling them there.
    served, loaded = [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        sock_info = sc._jvm.PythonRDD.collectAndServe(make._jrdd.rdd())
        t1 = time.perf_counter()
        with _load_from_socket(sock_info, make._jrdd_deserializer) as stream:
            arrays = list(stream)
        if i >= warmup:
            served.append(t1 - t0)
            loaded.append(time.perf_counter() - t1)
        del arrays
    out["job returning the array, to the driver JVM (collectAndServe)"] = median(served)
    out["  then to driver Python: socket + unpickle (_load_from_socket)"] = median(loaded)

    # The same bytes handled in one process, for scale.
    blob = pickle.dumps(theta, pickle.HIGHEST_PROTOCOL)
    out["pickle.dumps(theta), in-process"] = median(
        timed(lambda: pickle.dumps(theta, pickle.HIGHEST_PROTOCOL), warmup, reps)
    )
    out["pickle.loads of it, in-process"] = median(timed(lambda: pickle.loads(blob), warmup, reps))
    a, b = theta.copy(), theta.copy()
    out["a += b on the driver (the combine)"] = median(
        timed(lambda: np.add(a, b, out=a), warmup, reps)
    )
    return out


def run(
    *, floats: int, warmup: int, reps: int, breakdown_reps: int, no_breakdown: bool, out: Path
) -> dict[str, Any]:
    """`sparknet bench sync-cost`: prints its figures and writes `<out>/sync_cost.json`."""
    machine = machine_note()
    theta = np.random.default_rng(0).standard_normal(floats, dtype=np.float32)
    mb = theta.nbytes / 1e6
    print(f"payload: {floats:,} float32 = {mb:.1f} MB, K={WORKERS}, master {MASTER}")

    gloo = gloo_all_reduce(floats, warmup + 1, reps + 2)
    print(f"gloo all_reduce, 2 plain processes: median {median(gloo):.3f} s", flush=True)

    t0 = time.perf_counter()
    spark = start_session(MASTER, WORKERS)
    sc = spark.sparkContext
    print(f"Spark session start: {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        driver_memory = sc.getConf().get("spark.driver.memory")
        heap_mb = sc._jvm.java.lang.Runtime.getRuntime().maxMemory() / 2**20
        transport = SparkTransport(sc, WORKERS)
        gc0 = jvm_gc_seconds(sc)
        parts = transport_rounds(transport, theta, warmup, reps)
        gc_per_round = (jvm_gc_seconds(sc) - gc0) / (warmup + reps)
        naive = timed(lambda: naive_round(sc, theta), warmup, reps)
        tree = timed(lambda: tree_reduce_round(sc, theta), warmup, reps)
        pieces = {} if no_breakdown else breakdown(sc, theta, 1, breakdown_reps)
    finally:
        spark.stop()

    floor = median(gloo)
    variants = {
        "gloo all_reduce (2 plain processes)": gloo,
        "spark transport map_reduce": parts["total"],
        "naive: broadcast + collect + sum on driver": naive,
        "PySpark treeReduce": tree,
    }
    print(
        f"\none round, {mb:.0f} MB, driver heap {driver_memory} "
        f"(JVM max {heap_mb:.0f} MiB), seconds "
        f"(median of {reps}; min; median / gloo):"
    )
    for name, ts in variants.items():
        print(f"  {name:45s} {median(ts):7.3f}  {min(ts):7.3f}  {median(ts) / floor:6.1f}x")

    print("\nspark transport round, median parts (driver and task wall clocks), seconds:")
    print(f"  sc.broadcast on the driver                      {median(parts['broadcast']):7.3f}")
    print(f"  job start -> work begins (schedule, bc.value)   {median(parts['launch']):7.3f}")
    print(f"  work ends -> driver has the sum (incl. destroy) {median(parts['return']):7.3f}")
    print(f"  driver JVM GC time per round                    {gc_per_round:7.3f}")
    if pieces:
        print(f"\nbreakdown, median of {breakdown_reps}, seconds:")
        for name, secs in pieces.items():
            print(f"  {name:62s} {secs:7.3f}")

    ratio = median(parts["total"]) / floor
    print(f"\nsync round spark transport: {median(parts['total']):.3f} s")
    print(f"sync round gloo all_reduce: {floor:.3f} s")
    print(f"ratio spark/gloo: {ratio:.1f}x  (goal <= {GOAL:g}x)")

    steal_note(machine)
    results = {
        "machine": machine,
        "payload_mb": mb,
        "workers": WORKERS,
        "driver_memory": driver_memory,
        "jvm_heap_max_mb": heap_mb,
        "variants_s": {name: median(ts) for name, ts in variants.items()},
        "variants_all_s": variants,
        "transport_parts_s": {name: median(ts) for name, ts in parts.items()},
        "jvm_gc_s_per_round": gc_per_round,
        "breakdown_s": pieces,
        "ratio": ratio,
        "headline": [
            {
                "metric": f"sync {mb:.0f} MB, K=2 (s): transport",
                "sparknet": median(parts["total"]),
                "reference": floor,
                "reference_name": "gloo all_reduce",
                "ratio": ratio,
                "goal": f"<= {GOAL:g}",
            },
            *(
                {
                    "metric": f"  {label}",
                    "sparknet": median(variants[name]),
                    "reference": floor,
                    "reference_name": "gloo all_reduce",
                    "ratio": median(variants[name]) / floor,
                    "goal": "",
                }
                for name, label in (
                    ("naive: broadcast + collect + sum on driver", "naive collect + sum"),
                    ("PySpark treeReduce", "PySpark treeReduce"),
                )
            ),
        ],
    }
    print(f"\nwrote {write_results(NAME, results, out)}")
    return results
