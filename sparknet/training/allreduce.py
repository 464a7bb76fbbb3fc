"""The `allreduce` transport: one Spark barrier stage runs every round, and the workers exchange
their updates among themselves with torch.distributed.

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
import hmac
import json
import queue
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from py4j.protocol import Py4JError
from pyspark import SparkContext
from pyspark.errors import PySparkException

from sparknet import interrupts
from sparknet.data.frames import Frames
from sparknet.errors import SparknetError
from sparknet.training.allreduce_rank import StagePlan, stage_task
from sparknet.training.session import stopped_from_outside
from sparknet.training.spark_settings import is_local_master
from sparknet.training.transport import (
    conf_int,
    describe_task_failure,
    dynamic_allocation,
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

    def ack(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):  # the stage is gone: its failure says why
                self._conn.sendall(b"ok\n")
            self._conn = None


class Diverged(SparknetError):
    """A worker's loss or weights went non-finite: the run ends (a restart would diverge again)."""


class StageFailed(Exception):
    """The stage failed; `permanent` when running it again cannot help."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


#: how long a connection to the channel has to say its hello (rank 0 says it at once), and
#: the most that hello may hold: what anyone else who reaches the port can hold up
_HELLO_S = 30.0
_HELLO_MAX = 4096


class _Channel:
    """The driver's end of rank 0's socket: a listener on the driver's host that takes
    connections carrying the stage's token and queues their messages. Anyone who reaches the
    port may connect: a connection whose first line is not a hello with the token (compared
    in constant time), within `_HELLO_S` and `_HELLO_MAX` bytes, is closed unheard, without a
    word on the driver's output."""

    def __init__(self, host: str, token: str, inbox: queue.Queue) -> None:
        self.token = token.encode()
        self.inbox = inbox
        self.server = socket.create_server((host, 0))
        self.address = (host, self.server.getsockname()[1])
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="sparknet-channel", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            self._conns.add(conn)
            try:
                threading.Thread(target=self._read, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread left (a flood of connections): this one goes
                self._conns.discard(conn)
                conn.close()

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            lines = conn.makefile("rb")
            start = self._hello(conn, lines)
            if start is None:
                self._conns.discard(conn)
                conn.close()
                return
            self.inbox.put(("message", {"start": start}, conn))
            for line in lines:
                message = json.loads(line)
                if not isinstance(message, dict):
                    break  # not rank 0's
                self.inbox.put(("message", message, conn))

    def _hello(self, conn: socket.socket, lines: Any) -> int | None:
        """The round a rank 0 starts after, from its first line; None for anything else."""
        late = threading.Timer(_HELLO_S, _shut, (conn,))  # one deadline, however it trickles
        try:
            late.start()
            line = lines.readline(_HELLO_MAX)
            hello = json.loads(line) if line.endswith(b"\n") else None
        except (OSError, ValueError, RuntimeError):  # RuntimeError: no thread for the deadline
            return None
        finally:
            late.cancel()
        token = hello.get("token") if isinstance(hello, dict) else None
        if not isinstance(token, str) or not hmac.compare_digest(
            token.encode(errors="replace"), self.token
        ):
            return None
        start = hello.get("start")
        if not isinstance(start, int) or isinstance(start, bool):
            return None
        return start

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.close()


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


class AllReduceTransport:
    """Runs a run's rounds as one barrier stage and hands the driver its rows as they come."""

    name = "allreduce"

    def __init__(self, sc: SparkContext, partitions: int, frames: Frames | None = None) -> None:
        """`frames`: a DataFrame run's persisted frames, whose partition k rank k trains on."""
        self.sc = sc
        self.partitions = partitions
        self.local = is_local_master(sc.master)
        self.frames = frames

    def executors(self) -> dict[str, str]:
        """{executor id: host} on a cluster master; empty on a local one."""
        return {} if self.local else executor_hosts(self.sc)

    def rebalance(self) -> None:
        """Nothing to spread: a stage places its tasks anew each time it runs."""

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
        )  # fmt: skip
        group = f"sparknet-allreduce-{uuid.uuid4().hex[:12]}"
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
        except BaseException as exc:
            inbox.put(("failed", exc, None))

    def _messages(self, inbox: queue.Queue) -> Iterator[int | Row]:
        last_word: float | None = None
        while True:
            try:
                with interrupts.deferred():  # never inside the queue's Condition.wait
                    kind, payload, conn = inbox.get(timeout=0.2)
            except queue.Empty:
                if last_word is not None and time.monotonic() > last_word:
                    raise StageFailed("the stage ended before its last round") from None
                continue
            if kind == "failed":
                if why := stopped_from_outside(self.sc, payload):  # no restart can help
                    raise SparknetError(why) from payload
                raise _failure(payload)
            if kind == "finished":
                last_word = time.monotonic() + _LAST_WORD_S
                continue
            if "start" in payload:
                yield int(payload["start"])
            elif "row" in payload:
                yield Row(payload["row"], conn if payload.get("ack") else None)
            elif "fault" in payload:
                raise SparknetError(payload["fault"])
            elif "diverged" in payload:
                raise Diverged(payload["diverged"])
            if payload.get("done"):  # sent once the last round's checkpoint is published
                return


#: what a failed stage's error text says when running it again may help, and in what words
_CAUSES = (
    ("Python worker exited unexpectedly", "a worker's Python process died"),
    ("ExecutorLostFailure", "an executor was lost"),
    ("Connection reset by peer", "a worker lost its connection to another (one died)"),
    ("Connection closed by peer", "a worker lost its connection to another (one died)"),
    ("TaskKilled", "a task was killed"),
)
#: exceptions a rank raises that no restart heals: bad data, settings, credentials
_PERMANENT = re.compile(r"\b(?:sparknet\.errors\.)?(PermanentTaskError|SparknetError): ")


def _failure(exc: BaseException) -> BaseException:
    """The stage's failure as `StageFailed`, saying why in a few words; permanent when a rank
    raised sparknet's own error (a permanent task fault, unreadable data, S3 refusing)."""
    if not isinstance(exc, Py4JError | PySparkException):
        return exc
    text = f"{exc}\n{getattr(exc, 'java_exception', '')}"
    if _PERMANENT.search(text):
        return StageFailed(describe_task_failure(exc), permanent=True)  # type: ignore[arg-type]
    cause = next((words for mark, words in _CAUSES if mark in text), None)
    return StageFailed(cause or describe_task_failure(exc))  # type: ignore[arg-type]
