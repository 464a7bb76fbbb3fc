import pytest

from sparknet.training.session import driver_memory_gb, embedded_master, task_cpus


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
