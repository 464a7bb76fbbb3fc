"""The driver's guard that fails a worker which stopped making progress.

Why: a frozen worker (its Python process stopped, a GPU hang, a stuck read, a VM paused by its
host) fails nothing: Spark waits for its task without end, and under the `allreduce` transport
every other rank waits for it in the exchange. The guard reads the tasks' reports (`progress`)
and looks at its context's running sparknet tasks once a second: a task whose steps have not
moved for the deadline, or that has said nothing at all for it (a stopped process's reporting
thread is stopped too), is named in one warning and failed: on a cluster master its executor is
stopped (Spark starts no other in its place for this application, so its work runs again on the
executors left, as after a lost executor), on a local master or under dynamic allocation its
task attempt is killed (Spark's Python runner then kills the Python worker, a stopped one too,
and runs the task again). A rank that waits in the exchange while its thread still reports is
alive: only the worker that stopped is named. A worker that is slow but moves is never failed.

The deadline (`TrainConfig.progress_timeout_s`): a number of seconds, 0 for no guard, or by
default `auto`: `ROUND_MULTIPLE` times the slowest round of the run so far, at least
`MIN_DEADLINE_S`. Until a round has been measured it is at least `STARTUP_S` either way: a
healthy first round starts Python workers and reads data for the first time.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from py4j.protocol import Py4JError
from pyspark import SparkContext
from pyspark.errors import PySparkException

from sparknet.errors import SparknetError
from sparknet.training.progress import GROUP_PREFIX, REPORT_S, ROUND_JOBS, Beacon, Listener
from sparknet.training.transport import executor_hosts

#: the deadline before any round of the run has been measured (start-up: Python workers,
#: imports, a first read of the data)
STARTUP_S = 300.0
#: the automatic deadline is this many times the slowest round measured so far ...
ROUND_MULTIPLE = 5.0
#: ... and never under this
MIN_DEADLINE_S = 60.0
#: how many times one worker's work is failed and run again before the run ends
MAX_STRIKES = 3


@dataclass(frozen=True)
class Running:
    """A running task attempt, as the driver's status store has it."""

    task: int
    index: int
    executor: str
    host: str
    #: when it started (seconds since the epoch)
    launched: float


@dataclass
class Seen:
    """What a task attempt last said, and when."""

    partition: int
    round: int
    steps: int
    waiting: bool
    #: when it last said anything, and when what it says last changed
    heard: float
    moved: float

    def hear(self, message: dict[str, Any], now: float) -> None:
        state = (message["round"], message["steps"], message["waiting"])
        if state != (self.round, self.steps, self.waiting):
            self.round, self.steps, self.waiting = state
            self.moved = now
        self.heard = now


def idle_s(task: Running, seen: Seen | None, now: float) -> float:
    """How long `task` has shown no sign of progress: since its last step (or its start) while
    it computes; since it last said anything while it waits on the others (a waiting rank
    whose thread reports is alive; one that says nothing is stopped)."""
    if seen is None:
        return now - task.launched
    since = seen.heard if seen.waiting else seen.moved
    return now - max(task.launched, since)


def auto_deadline(slowest_round_s: float | None) -> float:
    """The automatic deadline: `STARTUP_S` before any round was measured, then
    `ROUND_MULTIPLE` x the slowest round, at least `MIN_DEADLINE_S`."""
    if slowest_round_s is None:
        return STARTUP_S
    return max(MIN_DEADLINE_S, ROUND_MULTIPLE * slowest_round_s)


def collective_timeout_s(deadline_s: float) -> float:
    """The process group's timeout for a deadline: well past it, so that the driver names a
    frozen rank before gloo gives up on it (and never gloo's 30 minutes before a deadline of
    an hour)."""
    return 2 * deadline_s + 60


class Guard:
    """For the block: watch the context's running sparknet tasks and fail one that made no
    progress for the deadline (see the module's docstring).

    Args:
        sc: the run's SparkContext.
        timeout_s: the deadline in seconds; None: automatic; 0: no guard.
        warn: how the one line naming a frozen worker is told.
        poll_s: how often to look (default `progress.REPORT_S`, as often as tasks report).

    Example::

        with Guard(spark.sparkContext, cfg.progress_timeout_s, warn) as guard:
            SparkTransport(sc, workers, guard.beacon)  # its tasks report
    """

    def __init__(
        self,
        sc: SparkContext,
        timeout_s: float | None,
        warn: Callable[[str], None],
        poll_s: float = REPORT_S,
    ) -> None:
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (0: off), got {timeout_s}")
        self.sc, self.timeout_s, self.warn, self.poll_s = sc, timeout_s, warn, poll_s
        #: where tasks report; None while the guard is off or not entered
        self.beacon: Beacon | None = None
        self._slowest: float | None = None
        self._round = 1  # the round the driver waits for
        self._seen: dict[int, Seen] = {}
        self._failed: set[int] = set()
        #: how many times each partition's work was failed
        self._strikes: dict[int, int] = {}
        #: executors it stopped ({id: host}): Spark starts none in their place for this run
        self.stopped: dict[str, str] = {}
        #: why the run ends: a frozen worker whose work no other executor can take
        self.ended: SparknetError | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._listener: Listener | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def deadline(self) -> float:
        """The deadline now: the setting, or the automatic one; until a round has been measured
        (the first starts Python workers, imports torch, reads data for the first time: minutes
        on a cold or busy cluster) at least `STARTUP_S` either way."""
        if not self.timeout_s:
            return auto_deadline(self._slowest)
        return self.timeout_s if self._slowest is not None else max(self.timeout_s, STARTUP_S)

    def collective_timeout_s(self) -> float | None:
        """The allreduce process group's timeout now; None (gloo's own) without a guard."""
        return collective_timeout_s(self.deadline()) if self.beacon is not None else None

    def round_done(self, row: dict[str, Any]) -> None:
        """A round's row: its time feeds the automatic deadline."""
        total = row.get("seconds", {}).get("total")
        if isinstance(total, int | float):
            self._slowest = max(total, self._slowest or 0.0)
        self._round = int(row.get("round", self._round - 1)) + 1

    def following(self, on_round: Callable[[dict[str, Any]], None]) -> Callable:
        """`on_round`, after each row's time is taken in (`round_done`)."""

        def on_row(row: dict[str, Any]) -> None:
            self.round_done(row)
            on_round(row)

        return on_row

    def __enter__(self) -> Guard:
        if self.timeout_s != 0:
            host = self.sc.getConf().get("spark.driver.host", "127.0.0.1")
            self._listener = Listener(host, secrets.token_hex(16), self._inbox)
            self.beacon = Beacon(self._listener.address, self._listener.token.decode())
            self._thread = threading.Thread(
                target=self._watch, name="sparknet-progress-guard", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._listener is not None:
            self._listener.close()
        self.beacon = None
        if self.ended is not None and isinstance(exc, Exception):
            raise self.ended from exc

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.look(time.time())
            except (Py4JError, PySparkException, AttributeError):
                if self._gone():
                    return
                # else a race with Spark's own bookkeeping (a stage that ended as it was
                # asked about): the next look sees it settled

    def _gone(self) -> bool:
        """Whether the session is stopped (nothing left to watch)."""
        try:
            return self.sc._jsc is None or bool(self.sc._jsc.sc().isStopped())
        except (Py4JError, PySparkException, AttributeError):
            return True

    def look(self, now: float) -> None:
        """One look: take in the reports, and fail every running task idle past the deadline."""
        self._hear(now)
        deadline = self.deadline()
        running = self._running()
        for task in running:
            if task.task in self._failed:
                continue
            seen = self._seen.get(task.task)
            idle = idle_s(task, seen, now)
            if idle >= deadline:
                self._failed.add(task.task)
                self._fail(task, seen, idle)
        live = {t.task for t in running}
        for task_id in [t for t, s in self._seen.items() if t not in live and now - s.heard > 10]:
            del self._seen[task_id]

    def _hear(self, now: float) -> None:
        while True:
            try:
                _kind, message, _conn = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                task = int(message["task"])
                seen = self._seen.get(task)
                if seen is None:
                    seen = Seen(int(message["partition"]), -1, -1, False, now, now)
                    self._seen[task] = seen
                seen.hear(message, now)
            except (KeyError, TypeError, ValueError):
                continue  # not a report

    def _running(self) -> list[Running]:
        """The running attempts of the active jobs of sparknet's job groups, and of round jobs
        run in a caller's group (a local master)."""
        store = self.sc._jsc.sc().statusStore()
        stages: set[int] = set()
        for job_id in self.sc.statusTracker().getActiveJobsIds():
            try:
                job = store.job(job_id)
            except Py4JError:  # gone since
                continue
            group, description = job.jobGroup(), job.description()
            if (group.isDefined() and str(group.get()).startswith(GROUP_PREFIX)) or (
                description.isDefined() and str(description.get()) == ROUND_JOBS
            ):
                ids = job.stageIds()
                stages.update(int(ids.apply(i)) for i in range(ids.size()))
        if not stages:
            return []
        out = []
        active = store.activeStages()
        for i in range(active.size()):
            stage = active.apply(i)
            if stage.stageId() not in stages:
                continue
            try:
                tasks = store.taskList(stage.stageId(), stage.attemptId(), stage.numTasks())
            except Py4JError:  # the stage ended since
                continue
            for k in range(tasks.size()):
                t = tasks.apply(k)
                if t.status() == "RUNNING":
                    launched = t.launchTime().getTime() / 1000
                    out.append(
                        Running(int(t.taskId()), int(t.index()), t.executorId(), t.host(), launched)
                    )
        return out

    def _fail(self, task: Running, seen: Seen | None, idle: float) -> None:
        """One line naming the worker, then its executor stopped or its task killed."""
        partition = seen.partition if seen is not None else task.index
        # a report is up to REPORT_S old, and a round may be shorter: the round the driver
        # waits for, unless the worker said a later one
        rnd = max(seen.round if seen is not None else 0, self._round)
        said = (
            f"worker {partition} on {task.host} made no progress in round {rnd} for "
            f"{idle:.0f} s (progress_timeout_s {self.deadline():g})"
        )
        self._strikes[partition] = self._strikes.get(partition, 0) + 1
        if self._strikes[partition] > MAX_STRIKES:
            # its work froze on every try: the data or the model, not one machine
            self.ended = SparknetError(
                "{said}, for the {strikes}th time: its work freezes wherever it runs; check its "
                "data and the model (or raise progress_timeout_s if a step really takes that "
                "long)",
                said=said, strikes=self._strikes[partition],
            )  # fmt: skip
            self.sc.cancelAllJobs()
            return
        if task.executor != "driver" and not self._others(task.executor):
            # no executor is left to take its work: the run ends now, not after the wait for
            # executors (no_executor_timeout_s), as none is started in place of a stopped one
            self.ended = SparknetError(
                "{said} and no other executor can take its work: check that host (a hung GPU, a "
                "stuck file system), then {@resume=True} from the last checkpoint",
                said=said,
            )
            self._stop_executor(task)
            self.sc.cancelAllJobs()
            return
        how = self._stop_executor(task) or self._kill_task(task)
        self.warn(f"{said}: {how}")

    def _others(self, executor: str) -> set[str]:
        """The live executors other than `executor` and those the guard stopped."""
        return set(executor_hosts(self.sc)) - {executor} - set(self.stopped)

    def _stop_executor(self, task: Running) -> str | None:
        """Stop the task's executor (a cluster master without dynamic allocation); what was
        done, or None where Spark refuses."""
        if task.executor == "driver":  # a local master: no executor to stop
            return None
        try:
            stopped = bool(self.sc._jsc.sc().killExecutor(task.executor))
        except Py4JError:  # dynamic allocation refuses it
            return None
        if not stopped:
            return None
        self.stopped[task.executor] = task.host
        return f"its executor {task.executor} is stopped and its work runs again without it"

    def _kill_task(self, task: Running) -> str:
        reason = f"no progress for the deadline ({self.deadline():g} s)"
        self.sc._jsc.sc().killTaskAttempt(task.task, True, reason)
        return f"its task {task.task} is killed and runs again"
