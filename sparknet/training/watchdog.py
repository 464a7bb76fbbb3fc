"""The driver's executor watchdog: a run with no executor for too long ends in one line.

A run on a cluster master that has had no Spark executor for a set time
(`TrainConfig.no_executor_timeout_s`, 5 minutes by default) ends with one line saying so,
instead of waiting forever.

Spark itself waits without end for executors: a standalone master that died and was started
again has the workers kill the executors of every application it does not know, and the
driver's job then waits for resources that never come, while the job's supervisor keeps the
cluster's autostop timer from ever firing. The watchdog asks the driver's status store once a
second (the live executors that run tasks, as `transport.executor_hosts`), and once a job has
waited with none there for the whole time, cancels every job of the context (again each
second, so a job a retry starts ends as well); the round loop's failure then leaves
`ExecutorWatchdog`'s block as `NoExecutors`, whose one line names why. The time the driver
works alone (start-up before the first job, a checkpoint) is not counted. A local master has
no executors to lose: no watchdog there.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException

from sparknet.errors import SparknetError
from sparknet.training.spark_settings import is_local_master
from sparknet.training.transport import executor_hosts

#: how often the status store is asked
POLL_S = 1.0


class NoExecutors(SparknetError):
    """The run had no executor for the watchdog's whole time, and was stopped."""


class ExecutorWatchdog:
    """For the block: cancel the context's jobs once it has had no executor for `timeout_s`
    seconds (0: never), and turn the failure that follows into `NoExecutors`.

    Args:
        sc: the run's SparkContext.
        timeout_s: seconds without any executor before the run is stopped; 0 turns it off.
        poll_s: how often to look (default `POLL_S`).

    Example::

        with ExecutorWatchdog(spark.sparkContext, cfg.no_executor_timeout_s):
            rounds()
    """

    def __init__(self, sc, timeout_s: float, poll_s: float = POLL_S) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (0: off), got {timeout_s}")
        self.sc, self.timeout_s, self.poll_s = sc, timeout_s, poll_s
        #: whether it stopped the run
        self.fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def error(self) -> NoExecutors:
        return NoExecutors(
            "no Spark executor for {wait} s: the cluster lost every executor of this run (its "
            "workers are gone, or a restarted master had them killed), so the run stops; "
            "{@resume=True} continues it from its last checkpoint once the cluster is whole "
            "(no_executor_timeout_s sets the wait)",
            wait=f"{self.timeout_s:g}",
        )

    def __enter__(self) -> ExecutorWatchdog:
        if self.timeout_s > 0 and not is_local_master(self.sc.master):
            self._thread = threading.Thread(
                target=self._watch, name="sparknet-executor-watchdog", daemon=True
            )
            self._thread.start()
        return self

    def _watch(self) -> None:
        since = time.monotonic()
        while not self._stop.wait(self.poll_s):
            try:
                # only a job waits for executors: the time the driver works alone (the start-up
                # before the first job, a checkpoint, dynamic allocation's idle release) is not
                # counted, so it never cancels the next job of a cluster that is whole
                waiting = bool(self.sc.statusTracker().getActiveJobsIds())
                if (not waiting or executor_hosts(self.sc)) and not self.fired:
                    since = time.monotonic()
                    continue
                if self.fired or time.monotonic() - since >= self.timeout_s:
                    self.fired = True
                    self.sc.cancelAllJobs()
            except (Py4JError, PySparkException, AttributeError):  # the session is stopped
                return

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.fired and isinstance(exc, Exception):
            raise self.error from exc
