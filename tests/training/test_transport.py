"""The `spark` transport on a real local Spark: ordered tree sums, cleanup, task errors."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from sparknet.errors import PermanentTaskError, SparknetError
from sparknet.training.probe import _collect_within, check_python_workers, user_modules
from sparknet.training.transport import (
    SparkTransport,
    TaskFault,
    block_placement,
    executor_cores,
    partition_threads,
    tree_reduce,
)
from tests.helpers import failed_tasks

pytestmark = pytest.mark.integration


def test_tree_reduce_merges_in_partition_order_at_every_level(sc):
    rdd = sc.parallelize(range(11), 11).mapPartitionsWithIndex(lambda i, _: [(i, [i])])
    assert tree_reduce(rdd, lambda a, b: a + b, fan_in=2) == list(range(11))  # 4 levels
    assert tree_reduce(rdd, lambda a, b: a + b, fan_in=3) == list(range(11))


def _echo(theta, partition, attempt, threads, local_dir, rows):
    return (partition + 1) * theta


def test_map_reduce_sums_what_every_partition_returns(sc):
    theta = np.arange(6, dtype=np.float32)
    total, _ = SparkTransport(sc, 5).map_reduce(theta, _echo, lambda a, b: a + b)
    np.testing.assert_array_equal(total, 15 * theta)


def _storage_used(sc) -> int:
    """Bytes held by the block managers (max - remaining), as the block manager master sees it.

    (The REST API's `memoryUsed` never counts a destroyed broadcast's blocks back down.)"""
    used, values = 0, sc._jsc.sc().getExecutorMemoryStatus().valuesIterator()
    while values.hasNext():
        max_and_remaining = values.next()
        used += max_and_remaining._1() - max_and_remaining._2()
    return used


def _zeros(theta, partition, attempt, threads, local_dir, rows):
    return np.zeros(1, np.float32)


def test_broadcasts_are_destroyed_so_memory_stays_flat(sc):
    theta = np.ones(2_000_000, np.float32)  # 8 MB
    transport = SparkTransport(sc, 2)
    for _ in range(3):
        transport.map_reduce(theta, _zeros, lambda a, b: a + b)
    time.sleep(0.5)
    before = _storage_used(sc)
    for _ in range(12):
        transport.map_reduce(theta, _zeros, lambda a, b: a + b)
    time.sleep(0.5)  # destroy() is asynchronous
    grown = _storage_used(sc) - before
    assert grown < theta.nbytes, f"block manager grew by {grown} bytes over 12 rounds"


def _fail(theta, partition, attempt, threads, local_dir, rows):
    raise SparknetError("data 'x:y': cannot import module 'x'")


def test_a_failing_task_becomes_one_sparknet_error(sc):
    with pytest.raises(SparknetError) as exc:
        SparkTransport(sc, 2).map_reduce(np.zeros(2, np.float32), _fail, lambda a, b: a)
    assert str(exc.value) == (
        "a Spark task failed after all retries: data 'x:y': cannot import module 'x'"
    )


def _threads(theta, partition, attempt, threads, local_dir, rows):
    return [threads]


def test_each_task_is_told_its_share_of_cores(sc):
    got, _ = SparkTransport(sc, 2).map_reduce(np.zeros(1, np.float32), _threads, list.__add__)
    assert got == [int(sc.getConf().get("spark.task.cpus"))] * 2


def _unhealable(theta, partition, attempt, threads, local_dir, rows):
    if partition == 1:
        raise PermanentTaskError(f"shard of partition {partition}: sha256 differs")
    return theta


def test_a_permanent_fault_comes_back_in_band_and_is_never_retried(sc):
    """local[2,2] retries a raised exception once; this one must reach the driver unretried."""
    sc.setJobGroup("permanent", "a task that cannot heal")
    try:
        with pytest.raises(PermanentTaskError) as exc:
            SparkTransport(sc, 3).map_reduce(np.zeros(2, np.float32), _unhealable, np.add)
    finally:
        sc.setJobGroup("after", "")
    assert str(exc.value) == "shard of partition 1: sha256 differs"
    assert failed_tasks(sc, "permanent") == 0


def test_a_fault_re_raised_by_a_dataloader_keeps_its_cause_line():
    wrapped = PermanentTaskError(
        "Caught PermanentTaskError in DataLoader worker process 0.\nOriginal Traceback (most "
        'recent call last):\n  File "x.py", line 1\nsparknet.errors.PermanentTaskError: bad shard'
    )
    assert TaskFault.of(0, wrapped).message == "bad shard"


def _persisted(sc) -> set[int]:
    return {int(k) for k in sc._jsc.getPersistentRDDs()}


def test_every_job_maps_over_one_cached_anchor_that_close_releases(sc):
    transport = SparkTransport(sc, 3, sticky=True)  # the default on a cluster master
    before = _persisted(sc)
    total, _ = transport.map_reduce(np.ones(2, np.float32), _echo, lambda a, b: a + b)
    anchor = transport.anchor()
    np.testing.assert_array_equal(total, [6, 6])
    transport.map_reduce(np.ones(2, np.float32), _echo, lambda a, b: a + b)
    assert transport.anchor() is anchor  # made once per run
    assert _persisted(sc) - before == {anchor.id()}
    deadline = time.monotonic() + 5  # the status store hears of blocks asynchronously
    while len(block_placement(sc, anchor)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert block_placement(sc, anchor) == {0: "driver", 1: "driver", 2: "driver"}
    transport.close()
    assert _persisted(sc) == before
    transport.close()  # twice is fine


def test_a_dropped_transport_releases_its_anchor(sc):
    before = _persisted(sc)
    transport = SparkTransport(sc, 2, sticky=True)
    transport.map_reduce(np.ones(1, np.float32), _echo, lambda a, b: a + b)
    assert len(_persisted(sc) - before) == 1
    del transport
    assert _persisted(sc) == before


def test_threads_come_from_the_executors_cores_the_jvm_reports(sc):
    cores = executor_cores(sc)
    assert cores == {"driver": 2}  # local[2,2]: one executor, two cores
    assert partition_threads(2, {0: "driver", 1: "driver"}, cores) == {0: 1, 1: 1}
    assert partition_threads(1, {0: "driver"}, cores) == {0: 2}
    assert SparkTransport(sc, 2).task_threads() == {}  # local master: Spark's task cpus


def _pid(theta, partition, attempt, threads, local_dir, rows):
    return [os.getpid()]


def test_python_workers_are_reused_round_after_round(sc):
    """A worker keeps its imports, model and data between rounds only if Spark reuses it."""
    transport = SparkTransport(sc, 2, sticky=True)
    seen = set()
    for _ in range(5):
        pids, _ = transport.map_reduce(np.zeros(1, np.float32), _pid, list.__add__)
        seen.update(pids)
    transport.close()
    assert len(seen) <= 2, f"{len(seen)} Python workers over 5 rounds of 2 tasks"


def _gc_counts(theta, partition, attempt, threads, local_dir, rows):
    import gc

    import torch  # noqa: F401 (what every training task imports)

    return [(os.getpid(), gc.get_freeze_count(), len(gc.get_objects()))]


def test_a_worker_freezes_its_imports_so_the_daemons_collections_skip_them(sc):
    """pyspark's daemon runs a full gc.collect() after every task of a reused worker: a worker
    that has run a task has torch's objects frozen, and the collector tracks only a few left."""
    transport = SparkTransport(sc, 2)
    ran, checked = set(), 0
    for _ in range(3):
        counts, _ = transport.map_reduce(np.zeros(1, np.float32), _gc_counts, list.__add__)
        for pid, frozen, tracked in counts:
            if pid in ran:  # its earlier task ended with a freeze
                assert frozen > 100_000 and tracked < frozen / 5, (frozen, tracked)
                checked += 1
            ran.add(pid)
    assert checked >= 2


def test_a_local_master_caches_nothing(sc):
    """One executor: every task finds its state there, so no anchor (and no job to cache it)."""
    before = _persisted(sc)
    transport = SparkTransport(sc, 2)
    transport.map_reduce(np.ones(1, np.float32), _echo, lambda a, b: a + b)
    assert not transport.sticky and _persisted(sc) == before


def test_the_workers_check_imports_the_users_modules_too(spark):
    check_python_workers(spark, 2, user_modules("json:loads"))
    lost = r"cannot import no_such_mod_x \(your --model/--data"
    with pytest.raises(SparknetError, match=lost) as exc:
        check_python_workers(spark, 2, user_modules("no_such_mod_x:net", "mlp"))
    assert "\n" not in str(exc.value)


def test_a_probe_no_executor_can_finish_is_cancelled_in_one_line(sc):
    t0 = time.monotonic()
    with pytest.raises(SparknetError, match="did not start in 1 s") as exc:
        _collect_within(sc, sc.parallelize(range(2), 2).map(lambda x: time.sleep(60)), 1.0)
    assert time.monotonic() - t0 < 20
    assert "\n" not in str(exc.value)
    assert sc.parallelize(range(3), 3).map(lambda x: x + 1).collect() == [1, 2, 3]
