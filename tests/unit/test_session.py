import pytest

from sparknet.errors import SparknetError
from sparknet.training.session import (
    STICKY_LOCALITY_WAIT,
    driver_memory_gb,
    embedded_master,
    spark_settings,
    task_cpus,
)
from sparknet.training.transport import partition_threads, threads_per_task


@pytest.mark.parametrize(
    ("master", "workers", "cpus"),
    [
        ("local[2,4]", 2, 1),
        ("local[2,4]", 1, 2),
        ("local[8]", 3, 2),
        ("local[4]", 9, 1),
        ("local", 2, 1),
        ("spark://10.0.0.1:7077", 2, 1),
    ],
)
def test_tasks_share_the_cores_without_oversubscribing(master, workers, cpus):
    assert task_cpus(master, workers) == cpus


def test_embedded_master_retries_failed_tasks():
    assert embedded_master(3) == "local[3,4]"


def test_driver_heap_is_a_quarter_of_memory_within_bounds():
    assert driver_memory_gb(24 * 2**30) == 6
    assert driver_memory_gb(4 * 2**30) == 2
    assert driver_memory_gb(256 * 2**30) == 16


@pytest.mark.parametrize(
    ("cores", "tasks_there", "task_cpus", "gpus", "threads"),
    [
        (8, 2, 1, 0, 4),  # an 8-core executor running 2 tasks
        (8, 1, 1, 0, 8),
        (8, 3, 1, 0, 2),
        (1, 2, 1, 0, 1),  # the test cluster's 1-core workers
        (8, 16, 1, 0, 1),  # more tasks than cores: one thread each, never 0
        (8, 4, 4, 0, 4),  # spark.task.cpus=4: two run at once
        (32, 8, 1, 4, 8),  # 4 GPUs: four tasks at once (cores // gpus)
        (32, 2, 1, 4, 16),  # fewer tasks than GPUs
    ],
)
def test_threads_are_the_executors_cores_over_the_tasks_it_runs_at_once(
    cores, tasks_there, task_cpus, gpus, threads
):
    assert threads_per_task(cores, tasks_there, task_cpus, gpus) == threads


def test_each_partition_gets_the_share_of_the_executor_holding_it():
    placement = {0: "1", 1: "1", 2: "2", 3: "1"}
    cores = {"1": 6, "2": 4}
    assert partition_threads(4, placement, cores) == {0: 2, 1: 2, 2: 4, 3: 2}
    # partition 3 unplaced (its executor lost): an even spread's share of the smallest executor
    assert partition_threads(4, {0: "1", 1: "1", 2: "2"}, cores)[3] == 2
    assert partition_threads(4, {}, {}) == {}  # nothing known: Spark's task cpus decide


def test_user_settings_win_over_sparknets_defaults():
    settings = spark_settings("local[2]", 2, {"spark.task.cpus": "2", "spark.ui.enabled": "false"})
    assert settings["spark.task.cpus"] == "2"
    assert settings["spark.ui.enabled"] == "false"
    assert settings["spark.python.worker.reuse"] == "true"
    assert settings["spark.locality.wait.process"] == STICKY_LOCALITY_WAIT
    assert "spark.executor.resource.gpu.amount" not in settings
    # a user's spark.locality.wait covers the process level too, as it does in Spark
    settings = spark_settings("yarn", 2, {"spark.locality.wait": "1s"})
    assert "spark.locality.wait.process" not in settings


def test_gpus_per_worker_sets_one_gpu_per_task_on_a_cluster_master():
    settings = spark_settings("spark://10.0.0.1:7077", 8, gpus_per_worker=4)
    assert settings["spark.executor.resource.gpu.amount"] == "4"
    assert settings["spark.task.resource.gpu.amount"] == "1"
    assert "spark.task.cpus" not in settings  # threads come from the executors' cores


@pytest.mark.parametrize(
    ("master", "conf", "gpus", "message"),
    [
        ("local[2]", {"spark.master": "yarn"}, 0, "choose the master with --master"),
        ("yarn", {"spark.speculation": "True"}, 0, "without its partition's optimizer state"),
        ("local[4]", {}, 2, "--gpus-per-worker needs a cluster master"),
        ("yarn", {"spark.task.resource.gpu.amount": "0.5"}, 2, "drop one of the two"),
    ],
)
def test_settings_that_would_break_a_run_are_refused_in_one_line(master, conf, gpus, message):
    with pytest.raises(SparknetError, match=message) as exc:
        spark_settings(master, 2, conf, gpus)
    assert "\n" not in str(exc.value)
