"""Workers' progress during a round, as the tasks report it to the driver.

Why: a frozen worker (its Python process stopped, a GPU hang, a stuck read, a VM paused by its
host) fails nothing Spark can see. Each task therefore reports (partition, round, steps done,
its Spark task attempt id, and whether it waits on the others rather than computes) from a
thread of its own, about once a second, to a socket on the driver, where the progress guard
(`progress_guard`) reads it. A stopped process's thread is stopped too: its silence says so.

The reports never cost training anything: the task only sets attributes; its thread connects
with a short timeout, and a driver that cannot be reached is tried again now and then, never
waited for. The socket is a `Listener` (a token in the first line, as the allreduce transport's
channel from rank 0, which is one too).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext

#: the job groups whose tasks the guard watches all start with this (both transports' groups)
GROUP_PREFIX = "sparknet-"
#: the description of a `spark` transport round's jobs (on a local master, in the caller's job
#: group: the progress guard watches these and the jobs of GROUP_PREFIX's groups)
ROUND_JOBS = "sparknet round"
#: how often a task reports
REPORT_S = 1.0
#: a task's connection to the driver: how long it may take, and the pause before another try
CONNECT_S = 2.0
RETRY_S = 5.0

#: how long a connection to a listener has to say its hello (a task says it at once), and
#: the most that hello may hold: what anyone else who reaches the port can hold up
_HELLO_S = 30.0
_HELLO_MAX = 4096


# ---- the driver's socket ----------------------------------------------------------------------


class Listener:
    """A listener on the driver's host that takes connections carrying a token and queues their
    messages as ("message", dict, connection) in `inbox`. Anyone who reaches the port may
    connect: a connection whose first line is not a hello with the token (compared in constant
    time), within `_HELLO_S` and `_HELLO_MAX` bytes, or that `accept` refuses, is closed
    unheard, without a word on the driver's output. Used by the progress guard and by the
    allreduce transport's channel from rank 0."""

    #: close a connection once its sender has closed its end (False: a message queued from it
    #: may still be answered on it)
    close_at_end = True

    def __init__(self, host: str, token: str, inbox: queue.Queue) -> None:
        self.token = token.encode()
        self.inbox = inbox
        self.server = socket.create_server((host, 0))
        self.address = (host, self.server.getsockname()[1])
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="sparknet-listener", daemon=True)
        self._thread.start()

    def accept(self, hello: dict[str, Any]) -> dict[str, Any] | None:
        """The first message a hello with the right token makes (queued unless empty), or None
        to refuse it. Here: any such hello, no message."""
        return {}

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                if self.server.fileno() == -1:
                    return  # closed
                # out of file descriptors (EMFILE: a flood of connections) or a connection
                # reset before it was taken: the listener must outlive it, or every task's
                # report would go unheard and healthy workers be failed
                time.sleep(0.1)
                continue
            self._conns.add(conn)
            try:
                threading.Thread(target=self._read, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread left (a flood of connections): this one goes
                self._conns.discard(conn)
                conn.close()

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            lines = conn.makefile("rb")
            first = self._hello(conn, lines)
            if first is None:
                self._conns.discard(conn)
                conn.close()
                return
            if first:
                self.inbox.put(("message", first, conn))
            for line in lines:
                message = json.loads(line)
                if not isinstance(message, dict):
                    break  # not a sender of ours
                self.inbox.put(("message", message, conn))
        if self.close_at_end:
            self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _hello(self, conn: socket.socket, lines: Any) -> dict[str, Any] | None:
        """`accept`'s answer to the first line; None for anything but a hello with the token."""
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
        return self.accept(hello)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.close()


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


# ---- a task's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Beacon:
    """Where a task reports to: the guard's listener and its token; shipped inside tasks."""

    address: tuple[str, int]
    token: str


class Reporter:
    """One task's progress, and the thread that sends it to the driver about once a second.
    The task only sets attributes; the thread does every network call, so a slow or dead
    driver never slows a step."""

    def __init__(self, beacon: Beacon, partition: int, task: int) -> None:
        self.beacon = beacon
        self.partition, self.task = partition, task
        self.round, self.steps, self.waiting = 0, 0, False
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="sparknet-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread (it is not waited for: it may sit in a connect)."""
        self._stop.set()

    def state(self) -> dict[str, Any]:
        return {
            "task": self.task, "partition": self.partition, "round": self.round,
            "steps": self.steps, "waiting": self.waiting,
        }  # fmt: skip

    def _run(self) -> None:
        next_try = 0.0
        while not self._stop.is_set():
            if self._sock is None and time.monotonic() >= next_try:
                self._sock = self._connect()
                next_try = time.monotonic() + RETRY_S
            if self._sock is not None:
                try:
                    self._sock.sendall(json.dumps(self.state()).encode() + b"\n")
                except OSError:  # the driver is gone or busy: try again later
                    self._close()
            self._stop.wait(REPORT_S)
        self._close()

    def _connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(self.beacon.address, timeout=CONNECT_S)
            sock.sendall(json.dumps({"token": self.beacon.token}).encode() + b"\n")
            return sock
        except OSError:
            return None

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


#: the reporter of the task this Python worker runs now (a Python worker runs one at a time)
_current: Reporter | None = None


@contextlib.contextmanager
def reporting(beacon: Beacon | None, partition: int) -> Iterator[None]:
    """Report this task's progress while the block runs (nothing without a beacon)."""
    global _current
    if beacon is None:
        yield
        return
    ctx = TaskContext.get()
    reporter = Reporter(beacon, partition, ctx.taskAttemptId() if ctx is not None else -1)
    with contextlib.suppress(RuntimeError):  # no thread to be had: the task runs unwatched
        reporter.start()
    _current = reporter
    try:
        yield
    finally:
        _current = None
        reporter.stop()


def begin_round(number: int) -> None:
    """The task is at round `number` (1-based), no step done yet."""
    if _current is not None:
        _current.round, _current.steps = number, 0


def step() -> None:
    """One more step (or evaluation batch) done."""
    if _current is not None:
        _current.steps += 1


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """The task waits on the other ranks (or the driver) in the block, rather than computes."""
    if _current is None:
        yield
        return
    reporter = _current
    reporter.waiting = True
    try:
        yield
    finally:
        reporter.waiting = False
