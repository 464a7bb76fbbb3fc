"""The driver's executor watchdog against the real SparkContext: a job that waits for executors
that are gone (the status store's list stood in for as empty: the local master's one executor
cannot go) is cancelled once the time is up, and the run ends with one line naming why."""

from __future__ import annotations

import time

import pytest

from sparknet.training import watchdog
from sparknet.training.watchdog import ExecutorWatchdog, NoExecutors


class _AsCluster:
    """The real SparkContext, as a cluster master's: the watchdog watches only those."""

    master = "spark://10.0.0.5:7077"

    def __init__(self, sc) -> None:
        self._sc = sc

    def __getattr__(self, name: str):
        return getattr(self._sc, name)


def _waiting_job(sc) -> None:
    """A job whose tasks take longer than any test waits (as a job without executors does)."""
    sc.parallelize(range(2), 2).map(lambda x: time.sleep(15) or x).collect()


def test_a_run_without_executors_stops_with_one_line(sc, monkeypatch) -> None:
    monkeypatch.setattr(watchdog, "executor_hosts", lambda _sc: {})  # every executor is gone
    started = time.monotonic()
    dog = ExecutorWatchdog(_AsCluster(sc), 0.5, poll_s=0.1)
    with pytest.raises(NoExecutors) as err, dog:
        _waiting_job(sc)
    took = time.monotonic() - started
    assert dog.fired
    assert 0.5 <= took < 12, took  # cancelled, not waited out
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("no Spark executor for 0.5 s: the cluster lost every executor of ")
    assert "no_executor_timeout_s" in line
    assert "cancelled" in str(err.value.__cause__)  # it was the cancel that ended the job


def test_while_executors_are_there_it_never_fires(sc, monkeypatch) -> None:
    monkeypatch.setattr(watchdog, "executor_hosts", lambda _sc: {"0": "10.0.0.6"})
    with ExecutorWatchdog(_AsCluster(sc), 0.2, poll_s=0.05) as dog:
        assert sc.parallelize(range(2), 2).map(lambda x: time.sleep(0.4) or x).sum() == 1
    assert not dog.fired
    # a failure of its own passes as it is
    with pytest.raises(ZeroDivisionError), ExecutorWatchdog(_AsCluster(sc), 0.5, poll_s=0.1):
        raise ZeroDivisionError


def test_off_at_zero_and_on_a_local_master(sc, monkeypatch) -> None:
    monkeypatch.setattr(watchdog, "executor_hosts", lambda _sc: {})
    for dog in (ExecutorWatchdog(_AsCluster(sc), 0), ExecutorWatchdog(sc, 0.1, poll_s=0.05)):
        with dog:
            time.sleep(0.3)
        assert dog._thread is None and not dog.fired
    with pytest.raises(ValueError, match="timeout_s must be >= 0"):
        ExecutorWatchdog(sc, -1)


def test_a_stopped_context_ends_the_watch_quietly(monkeypatch) -> None:
    """The round loop stops its own session on a failure before the block ends: the watch then
    ends without a traceback of its own."""
    import threading
    from types import SimpleNamespace

    errors: list = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    stopped = SimpleNamespace(master="spark://10.0.0.5:7077", _jsc=None)  # as `sc.stop()` leaves
    with ExecutorWatchdog(stopped, 5, poll_s=0.05) as dog:
        time.sleep(0.3)
        assert dog._thread is not None and not dog._thread.is_alive()
    assert errors == []


def test_time_without_a_job_is_not_counted(sc, monkeypatch) -> None:
    """No executor while no job runs (the start-up before the first job, a checkpoint, dynamic
    allocation's idle release) is not a job waiting for executors: the next job runs."""
    monkeypatch.setattr(watchdog, "executor_hosts", lambda _sc: {})
    with ExecutorWatchdog(_AsCluster(sc), 0.3, poll_s=0.05) as dog:
        time.sleep(0.8)
        assert sc.parallelize(range(2), 2).sum() == 1
    assert not dog.fired


@pytest.mark.parametrize("value", [True, False])
def test_the_timeout_is_a_number_not_a_switch(value) -> None:
    """`no_executor_timeout_s: on` (YAML's true) read as 1 s stopped runs at start-up."""
    from pydantic import ValidationError

    from sparknet.config import TrainConfig

    with pytest.raises(ValidationError, match="a number of seconds"):
        TrainConfig(no_executor_timeout_s=value)
    assert TrainConfig(no_executor_timeout_s="0").no_executor_timeout_s == 0
