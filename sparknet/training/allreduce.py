"""The `allreduce` transport: one Spark barrier stage runs every round.

The workers exchange their updates among themselves with torch.distributed.

Why: through Spark, every round's updates travel Python worker -> executor JVM -> driver JVM ->
driver Python and the weights back out as a broadcast; at 100 MB that is ~25x what a gloo
all_reduce of the same bytes costs on the same machine. Here the K tasks of one barrier stage
live for the whole run: each one sets up a process group once (rank 0 opens a `TCPStore`; its
port goes round in the stage's one `allGather`, a second's cost, never paid per round), then per
round trains tau steps, all-reduces its update (optionally as bf16/fp16), and applies the same
outer step as every other rank, so all ranks hold the same weights without any of them sent.
A task's inner optimizer state simply stays in memory: there are no misses.

The driver still owns what the run reports: rank 0 streams each round's metrics row over a
socket to the driver (authenticated by a token shipped inside the task), which writes
metrics.jsonl, shows progress and acknowledges; only then does rank 0 publish that round's
checkpoint, so a published checkpoint always has its row, as with the `spark` transport.

A failed stage (a dead rank, a lost executor) is run again from the last complete checkpoint, up
to `RESTARTS` times; the restarted stage reads its inner states from that checkpoint, exactly as
a `--resume` would. A worker's own permanent fault (unreadable data) and divergence end the run
without a restart.

This module is the driver's side; what each rank runs is `allreduce_rank`.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from py4j.protocol import Py4JError
from pyspark import SparkContext
from pyspark.errors import PySparkException

from sparknet import interrupts
from sparknet.data.frames import Frames
from sparknet.errors import SparknetError, is_permanent_text
from sparknet.training.allreduce_rank import StagePlan, stage_task
from sparknet.training.progress import GROUP_PREFIX, Listener
from sparknet.training.progress_guard import Guard
from sparknet.training.session import stopped_from_outside
from sparknet.training.spark_settings import is_local_master
from sparknet.training.transport import (
    TaskFault,
    conf_int,
    describe_task_failure,
    dynamic_allocation,
    executor_cores,
    executor_hosts,
    in_band,
    task_slots,
    wait_for_executors,
)
from sparknet.training.worker import RoundTask

#: how many times a failed stage is run again from the last checkpoint
RESTARTS = 3
#: how long the driver waits for rank 0's last message once the stage's job has ended
_LAST_WORD_S = 10.0


# ---- where a barrier stage can run ------------------------------------------------------------


def why_not(sc: SparkContext, partitions: int) -> str | None:
    """Why a barrier stage of `partitions` tasks cannot run on this session, or None when it
    can: every task needs a slot at once, and Spark refuses barrier stages under dynamic
    allocation. (Rank 0, on some executor, writes the checkpoints: that every executor sees a
    local run dir is proved by the driver before the first round, `rundir_reach`.) Waits for a
    cluster's executors first (as the spark transport does)."""
    if dynamic_allocation(sc):
        return "Spark's dynamic allocation is on (barrier stages need a fixed set of executors)"
    cores = wait_for_executors(sc, partitions)
    task_cpus = conf_int(sc, "spark.task.cpus", 1)
    gpus = conf_int(sc, "spark.executor.resource.gpu.amount", 0)
    slots = task_slots(cores, task_cpus, gpus)
    if slots < partitions:
        return (
            f"its tasks must all run at once and the executors have {slots} task slot(s) for "
            f"{partitions} workers"
        )
    return None


# ---- the stage, as the driver sees it -------------------------------------------------------


@dataclass
class Row:
    """One round's metrics row from rank 0; `ack` lets rank 0 publish the round's checkpoint
    (call it once the row is recorded)."""

    row: dict[str, Any]
    _conn: socket.socket | None

    @property
    def acks(self) -> bool:
        """Whether rank 0 waits for this row's acknowledgement (to publish its checkpoint)."""
        return self._conn is not None

    def ack(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):  # the stage is gone: its failure says why
                self._conn.sendall(b"ok\n")
            self._conn = None


class Diverged(SparknetError):
    """A worker's loss or weights went non-finite: the run ends (a restart would diverge again)."""

    @classmethod
    def at(cls, done: int, worker: int, why: str) -> Diverged:
        """Worker `worker`'s divergence in round `done`, `why` saying what went non-finite."""
        return cls(
            "training diverged at round {done}, worker {worker}: {why}; lower {@lr} or check "
            "the data",
            done=done, worker=worker, why=why,
        )  # fmt: skip


class StageFailed(Exception):
    """The stage failed; `permanent` when running it again cannot help; `why` the driver's own
    check's words where that check failed it (why the executors left cannot run it)."""

    def __init__(self, message: str, permanent: bool = False, why: str | None = None) -> None:
        super().__init__(message)
        self.permanent, self.why = permanent, why


class _Channel(Listener):
    """The driver's end of rank 0's socket (`progress.Listener`): its hello carries the token
    and the round the stage starts after. A row's acknowledgement goes back on it."""

    close_at_end = False

    def accept(self, hello: dict[str, Any]) -> dict[str, Any] | None:
        start = hello.get("start")
        if not isinstance(start, int) or isinstance(start, bool):
            return None
        return {"start": start}


class AllReduceTransport:
    """Runs a run's rounds as one barrier stage and hands the driver its rows as they come."""

    name = "allreduce"

    def __init__(
        self,
        sc: SparkContext,
        partitions: int,
        frames: Frames | None = None,
        guard: Guard | None = None,
        pack: bool = True,
    ) -> None:
        """`frames`: a DataFrame run's persisted frames, whose partition k rank k trains on;
        `guard`: the run's progress guard, which the ranks report to; `pack`: whether the
        stage may run again on fewer executors than the run began with (`shortfall`)."""
        self.sc = sc
        self.partitions = partitions
        self.local = is_local_master(sc.master)
        self.frames = frames
        self.guard = guard
        self.pack = pack
        #: every executor seen since the run began ({id: host}), to name the ones lost
        self.seen: dict[str, str] = {}
        #: how many executors the run began with: with `pack` off, the fewest it runs on
        self.began = len(self.executors())

    def executors(self) -> dict[str, str]:
        """{executor id: host} on a cluster master; empty on a local one."""
        now = {} if self.local else executor_hosts(self.sc)
        self.seen.update(now)
        return now

    def rebalance(self) -> None:
        """Nothing to spread: a stage places its tasks anew each time it runs."""

    def cannot_run(self) -> str | None:
        """Why the live executors cannot run the stage (again), or None when they can (and
        always on a local master): `shortfall`."""
        if self.local:
            return None
        return shortfall(
            executor_cores(self.sc), self.began, self.partitions,
            conf_int(self.sc, "spark.task.cpus", 1),
            conf_int(self.sc, "spark.executor.resource.gpu.amount", 0), self.pack,
        )  # fmt: skip

    def lost(self) -> list[str]:
        """The executors seen since the run began that are gone, as "id@host"."""
        now = self.executors()
        return [f"{i}@{host}" for i, host in sorted(self.seen.items()) if i not in now]

    def wait_until_runnable(self, timeout_s: float, poll_s: float = 1.0) -> str | None:
        """Wait for executors that can run the stage (lost ones come back, or others are
        started in their place), at most `timeout_s` (0: without end). None once they can,
        else why they still cannot."""
        deadline = time.monotonic() + timeout_s
        while (why := self.cannot_run()) is not None:
            if timeout_s and time.monotonic() >= deadline:
                return why
            time.sleep(poll_s)
        return None

    def _cores_by_address(self) -> dict[str, int]:
        if self.local:
            return {}
        listed = self.sc._jsc.sc().statusStore().executorList(True)
        return {
            e.hostPort(): int(e.totalCores())
            for e in (listed.apply(i) for i in range(listed.size()))
            if e.totalCores() > 0
        }

    def stage(
        self,
        base: RoundTask,
        theta: np.ndarray,
        momentum: np.ndarray | None,
        elapsed_s: float,
        restart: int,
        tau_state: dict[str, Any] | None = None,
    ) -> Iterator[int | Row]:
        """Run rounds base.round+1 .. cfg.rounds as one barrier stage. Yields the round the
        stage starts after (again, if Spark itself runs the stage anew), then a `Row` per
        round; returns once the last round's row is in. Raises `StageFailed`, or SparknetError
        when the run must end (divergence, a worker's permanent fault)."""
        inbox: queue.Queue = queue.Queue()
        token = secrets.token_hex(16)
        host = self.sc.getConf().get("spark.driver.host", "127.0.0.1")
        channel = _Channel(host, token, inbox)
        weights = self.sc.broadcast(
            (in_band(theta), None if momentum is None else in_band(momentum))
        )
        plan = StagePlan(
            base, weights, elapsed_s, channel.address, token, restart,
            self._cores_by_address(), conf_int(self.sc, "spark.task.cpus", 1),
            conf_int(self.sc, "spark.executor.resource.gpu.amount", 0),
            evaluates=self.frames is None or self.frames.eval is not None,
            beacon=self.guard.beacon if self.guard is not None else None,
            collective_timeout_s=self.guard.collective_timeout_s() if self.guard else None,
            tau_state=tau_state,
        )  # fmt: skip
        group = f"{GROUP_PREFIX}allreduce-{uuid.uuid4().hex[:12]}"
        job = threading.Thread(
            target=self._run_job, args=(plan, group, inbox), name="sparknet-stage", daemon=True
        )
        job.start()
        try:
            yield from self._messages(inbox)
        finally:
            if job.is_alive():
                with contextlib.suppress(Py4JError, PySparkException):
                    self.sc.cancelJobGroup(group)
                job.join(60)
            channel.close()
            with contextlib.suppress(Py4JError, PySparkException):
                weights.destroy()

    def _run_job(self, plan: StagePlan, group: str, inbox: queue.Queue) -> None:
        try:
            self.sc.setJobGroup(group, "sparknet allreduce stage", interruptOnCancel=True)
            if self.frames is None:
                tasks = self.sc.parallelize(range(self.partitions), self.partitions)
            else:
                tasks = self.frames.by_rank(self.partitions)
            tasks.barrier().mapPartitions(stage_task(plan, self.frames is not None)).collect()
            inbox.put(("finished", None, None))
        except BaseException as exc:  # handed to the driver's thread, which raises it
            inbox.put(("failed", exc, None))

    def _messages(self, inbox: queue.Queue) -> Iterator[int | Row]:
        last_word: float | None = None
        look = time.monotonic() + _LOOK_S
        while True:
            try:
                with interrupts.deferred():  # never inside the queue's Condition.wait
                    kind, payload, conn = inbox.get(timeout=0.2)
            except queue.Empty:
                interrupts.check()  # a signal whose KeyboardInterrupt a JVM callback swallowed
                if last_word is not None and time.monotonic() > last_word:
                    raise StageFailed("the stage ended before its last round") from None
                if time.monotonic() > look:
                    look = time.monotonic() + _LOOK_S
                    if why := self._short_now():
                        raise StageFailed(f"an executor was lost: {why}", why=why) from None
                continue
            if kind == "failed":
                if stopped := stopped_from_outside(self.sc, payload):  # no restart can help
                    raise stopped from payload
                raise _failure(payload)
            if kind == "finished":
                last_word = time.monotonic() + _LAST_WORD_S
                continue
            if "start" in payload:
                yield int(payload["start"])
            elif "row" in payload:
                yield Row(payload["row"], conn if payload.get("ack") else None)
            elif "fault" in payload:
                raise TaskFault.raised(payload)
            elif "diverged" in payload:
                raise Diverged.at(**payload["diverged"])
            if payload.get("done"):  # sent once the last round's checkpoint is published
                return

    def _short_now(self) -> str | None:
        """`cannot_run` while the stage runs: executors lost so that it cannot go on. Spark
        itself would run the barrier stage anew in the same job and hold it, without end,
        until slots enough for all its tasks at once come back."""
        try:
            return self.cannot_run()
        except (Py4JError, PySparkException):  # the session is stopping: its failure says why
            return None


#: how often a running stage's executors are looked at (`AllReduceTransport._short_now`)
_LOOK_S = 1.0


def shortfall(
    cores: Mapping[str, int], began: int, partitions: int, task_cpus: int, gpus: int, pack: bool
) -> str | None:
    """Why executors of `cores` ({id: cores}) cannot run a barrier stage of `partitions` tasks,
    or None when they can: every task needs a task slot at once; and with `pack` off, the
    workers are not packed onto fewer executors than the `began` the run began with (more
    tasks on each, each with fewer threads), so a lost one must come back or be replaced."""
    if not cores:
        return "no executor is left (the workers are gone, or a restarted master had them killed)"
    slots = task_slots(cores, task_cpus, gpus)
    if slots < partitions:
        return f"the executors left hold {slots} task slot(s) for {partitions} workers"
    if not pack and len(cores) < began:
        return (
            f"{len(cores)} of the {began} executors the run began with are left and "
            "pack_workers is off"
        )
    return None


#: what a failed stage's error text says when running it again may help, and in what words
_CAUSES = (
    ("Python worker exited unexpectedly", "a worker's Python process died"),
    ("ExecutorLostFailure", "an executor was lost"),
    ("Connection reset by peer", "a worker lost its connection to another (one died)"),
    ("Connection closed by peer", "a worker lost its connection to another (one died)"),
    ("TaskKilled", "a task was killed"),
)


def _failure(exc: BaseException) -> BaseException:
    """The stage's failure as `StageFailed`, saying why in a few words; permanent when what a
    rank raised is (`errors.is_permanent_text`: sparknet's own error, such as unreadable data
    or S3 refusing; a full disk, a read-only one, a permission), so no restart is tried."""
    if not isinstance(exc, Py4JError | PySparkException):
        return exc
    text = f"{exc}\n{getattr(exc, 'java_exception', '')}"
    if is_permanent_text(text):
        return StageFailed(describe_task_failure(exc), permanent=True)  # type: ignore[arg-type]
    cause = next((words for mark, words in _CAUSES if mark in text), None)
    return StageFailed(cause or describe_task_failure(exc))  # type: ignore[arg-type]
