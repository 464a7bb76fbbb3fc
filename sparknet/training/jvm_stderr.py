"""The gateway JVM's stderr under a session sparknet starts.

Held while Spark starts, then passed through with Java stack traces left out, and muted once the
session stops.

Kept apart from `session`: a line filter with its own lock and reader thread, fed line by line
(and tested so); the session only decides when it is shown, held or muted.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading

# `# lazy: pyspark`: the line filter is imported (and tested) without Spark; pyspark only where
# the gateway's launch is wrapped

#: the first line of a Java stack trace printed outside log4j (`printStackTrace`, Scala's
#: default reporter, the JVM's uncaught-exception handler): a fully qualified exception class
_JAVA_TRACE = re.compile(
    rb'^(?:Exception in thread "[^"]*" )?'
    rb"(?:[a-z_][\w$]*\.)+[A-Z][\w$]*(?:Exception|Error)(?::|\s*$)"
)
#: the lines that go on a Java stack trace
_JAVA_TRACE_BODY = (b"\tat ", b"\t... ", b"Caused by: ", b"\tSuppressed: ", b"\t\t")


class HeldStderr:
    """The gateway JVM's stderr, held while the session starts: a setting Spark refuses prints a
    Java stack trace there that the one-line error says already. Shown once the session is up,
    or when a failure is not explained by it. Once shown, Java stack traces are left out: with
    log4j at fatal, the only ones printed are races of a context stopping (a callback rejected
    by a pool that just ended, when the master kills the application); what failed reaches the
    user as sparknet's one line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[bytes] | None = []
        self._show = True
        self._in_trace = False
        self._after_frame = False
        self.closed = threading.Event()  # the JVM closed its stderr (it exited)

    def write(self, line: bytes) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append(line)
                return
            # a Python traceback's last line (`torch.OutOfMemoryError: ...`) reads like a Java
            # trace's first: it follows the traceback's frames, indented by spaces
            header = not self._after_frame and bool(_JAVA_TRACE.match(line))
            self._after_frame = line.startswith(b"  ")
            self._in_trace = header or (self._in_trace and line.startswith(_JAVA_TRACE_BODY))
            if self._in_trace:
                return
        if self._show:
            with contextlib.suppress(OSError):
                os.write(2, line)

    def exception_message(self) -> str | None:
        """`message` of an `Exception in thread "main" x.y.SomeException: message` line (a
        JVM that exited has a moment to have its last lines read)."""
        self.closed.wait(1.0)
        with self._lock:
            lines = list(self._held or [])
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if line.startswith("Exception in thread"):
                _, sep, message = line.partition("Exception: ")
                if sep and message.strip():
                    return message.strip()
        return None

    def release(self, show: bool) -> None:
        """Write what is held (if `show`), and from now on pass lines through (or drop them)."""
        with self._lock:
            held, self._held, self._show = self._held or [], None, show
        if show:
            for line in held:
                with contextlib.suppress(OSError):
                    os.write(2, line)


@contextlib.contextmanager
def gateway_killed_on_failure(jvm_stderr: HeldStderr):
    """Kill the JVM PySpark launches when the session does not come up (Ctrl-C or SIGTERM while
    Spark starts): PySpark only waits for it, so it would live on as an orphan holding its
    multi-GiB heap, and later print pages of NoSuchFileException for the connection file PySpark
    removed. The launch is seen by wrapping the `Popen` PySpark's gateway module calls."""
    from pyspark import java_gateway  # lazy: pyspark

    started: list = []
    real = java_gateway.Popen

    def popen(*args, **kwargs):
        kwargs.setdefault("stderr", subprocess.PIPE)
        proc = real(*args, **kwargs)
        started.append(proc)
        if proc.stderr is not None:
            threading.Thread(
                target=_forward_jvm_stderr, args=(proc.stderr, jvm_stderr), daemon=True
            ).start()
        return proc

    java_gateway.Popen = popen
    try:
        yield
    except BaseException:
        for proc in started:
            with contextlib.suppress(Exception):  # gone already; what is raised says why
                proc.kill()
                proc.wait(timeout=10)
        raise
    finally:
        java_gateway.Popen = real


#: what the JVM prints on every start that says nothing to a sparknet user: the module warning
#: (Spark adds the module) and Spark's note for shells, which it prints whatever log4j says
_JVM_NOISE = (
    b"WARNING: Using incubator modules: ",
    b'Setting default log level to "',
    b"To adjust logging level use sc.setLogLevel(",
)


def _forward_jvm_stderr(pipe, out: HeldStderr) -> None:
    """Copy the gateway JVM's stderr to `out`, less `_JVM_NOISE`. It keeps reading to the end
    whatever happens to our stderr: a JVM blocked on a full pipe would hang the run."""
    for line in iter(pipe.readline, b""):
        if not line.startswith(_JVM_NOISE):
            out.write(line)
    out.closed.set()
