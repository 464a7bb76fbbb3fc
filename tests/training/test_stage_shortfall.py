"""Where a failed allreduce stage can run again after executors were lost (`shortfall`): a task
slot for every worker at once, and with `pack_workers` off as many executors as the run began
with. The cluster case itself, a worker host killed for good, is test_lost_worker.py's."""

from __future__ import annotations

from sparknet.config import TrainConfig
from sparknet.training.allreduce import shortfall


def test_the_executors_left_run_the_stage_when_they_hold_a_slot_per_worker():
    # two 2-core executors began; one is left, with 2 slots for 2 workers: packed onto it
    assert shortfall({"0": 2}, began=2, partitions=2, task_cpus=1, gpus=0, pack=True) is None
    # 1 slot for 2 workers: no
    why = shortfall({"0": 1}, began=2, partitions=2, task_cpus=1, gpus=0, pack=True)
    assert why == "the executors left hold 1 task slot(s) for 2 workers"
    # slots are cores over spark.task.cpus, and at most one a GPU
    assert shortfall({"0": 4}, began=2, partitions=3, task_cpus=2, gpus=0, pack=True)
    assert shortfall({"0": 8}, began=2, partitions=2, task_cpus=1, gpus=1, pack=True)
    assert shortfall({"0": 8, "2": 8}, 2, 2, 1, 1, pack=True) is None  # a replacement came
    assert shortfall({}, 2, 2, 1, 0, pack=True).startswith("no executor is left")


def test_without_packing_the_stage_waits_for_as_many_executors_as_it_began_with():
    assert TrainConfig().pack_workers  # the default: go on with what is left
    why = shortfall({"0": 2}, began=2, partitions=2, task_cpus=1, gpus=0, pack=False)
    assert why == "1 of the 2 executors the run began with are left and pack_workers is off"
    # a replacement (a new id) counts as one of them
    assert (
        shortfall({"0": 1, "5": 1}, began=2, partitions=2, task_cpus=1, gpus=0, pack=False) is None
    )
