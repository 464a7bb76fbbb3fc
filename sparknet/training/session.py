"""The Spark session a training run uses: an embedded local one by default, or `--master`."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from py4j.protocol import Py4JError
from pyspark import SparkContext
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from sparknet.errors import SparknetError, first_line
from sparknet.spark_security import UI_HOST
from sparknet.training.jvm_stderr import HeldStderr, gateway_killed_on_failure
from sparknet.training.spark_settings import (
    embedded_master,
    is_local_master,
    spark_settings,
    spark_warnings,
)


def find_java() -> str:
    """The java binary Spark's launcher will use (JAVA_HOME first, as spark-class does)."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        where = f"JAVA_HOME={home} has no bin/java" if home else "no java on PATH"
        raise SparknetError(
            f"Spark needs Java 17+ and found {where}: install it (e.g. apt-get install -y "
            "openjdk-17-jre-headless) or point JAVA_HOME at it"
        )
    return java


def start_session(
    master: str | None,
    workers: int,
    conf: Mapping[str, str] | None = None,
    gpus_per_worker: int = 0,
) -> SparkSession:
    """A new SparkSession whose Python workers use this interpreter (and so see torch), with
    `spark_settings`: sparknet's defaults and the user's `conf` on top."""
    master = master or embedded_master()
    settings = spark_settings(master, workers, conf, gpus_per_worker)
    find_java()
    for line in spark_warnings(conf or {}):
        print(f"warning: {line}", file=sys.stderr, flush=True)
    # PySpark's driver picks the executors' Python from this variable, not from the conf.
    os.environ.setdefault("PYSPARK_PYTHON", settings["spark.pyspark.python"])
    builder = SparkSession.builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    if is_local_master(master) or master.startswith("local-cluster"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # everything stays on loopback
    if private := private_local_dir(settings):
        builder = builder.config("spark.local.dir", private)
    jvm_stderr = HeldStderr()
    try:
        with gateway_killed_on_failure(jvm_stderr):
            try:
                with _keep_sigint_handler(), _ui_on_loopback(master):
                    session = builder.getOrCreate()
            except (PySparkException, Py4JError) as exc:
                raise SparknetError(_start_failure(master, conf or {}, exc, jvm_stderr)) from exc
            session.sparkContext.setLogLevel("FATAL")  # failures reach the user as SparknetError
    except BaseException:
        if private:
            shutil.rmtree(private, ignore_errors=True)
        raise
    if private:
        _LOCAL_DIRS[session] = private
        atexit.register(shutil.rmtree, private, True)  # a session stopped without stop_quietly
    _quiet_accumulator_server(session.sparkContext)
    jvm_stderr.release(show=True)
    _JVM_STDERR[session] = jvm_stderr
    return session


#: the private local dir of each session sparknet started (`private_local_dir`), removed at stop
_LOCAL_DIRS: weakref.WeakKeyDictionary[SparkSession, str] = weakref.WeakKeyDictionary()


def private_local_dir(settings: Mapping[str, str]) -> str | None:
    """A new dir only this user may enter (0700) for the driver's Spark local dir, unless the
    user chose one (`spark.local.dir`, SPARK_LOCAL_DIRS): Spark makes its `blockmgr-*` (cached
    and spilled blocks: training data, weights) and `spark-*` (the files a job ships) with the
    umask's modes, 0755, right in /tmp, where another user of the host could read them.
    Executors of a cluster keep their worker's own dirs (SPARK_EXECUTOR_DIRS wins)."""
    if "spark.local.dir" in settings or os.environ.get("SPARK_LOCAL_DIRS", "").strip():
        return None
    return tempfile.mkdtemp(prefix="sparknet-spark-")


@contextlib.contextmanager
def _ui_on_loopback(master: str):
    """The driver's JVM of a standalone master starts with SPARK_LOCAL_IP=127.0.0.1: Spark's
    web UI binds that variable's address, else every interface (RPC and block manager bind
    `spark.driver.bindAddress`, set by `spark_settings`). This process's own variable is put
    back: it is where `driver_address` finds the node's address next time. The UI has no
    authentication: `sparknet cluster tunnel` is the way in."""
    if not master.startswith("spark://"):
        yield
        return
    before = os.environ.get("SPARK_LOCAL_IP")
    os.environ["SPARK_LOCAL_IP"] = UI_HOST
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPARK_LOCAL_IP", None)
        else:
            os.environ["SPARK_LOCAL_IP"] = before


def _quiet_accumulator_server(sc) -> None:
    """PySpark's accumulator server prints a traceback (socketserver's `handle_error`) when the
    JVM's connection ends in the middle of an update: a JVM killed with the CLI, by a signal to
    the whole process group (a CI job's timeout, a service manager's stop). The user gets the
    one `error: interrupted` line; any other error in the server still prints."""
    server = getattr(sc, "_accumulatorServer", None)
    if server is None:
        return
    loud = server.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], EOFError | ConnectionError):
            loud(request, client_address)

    server.handle_error = handle_error


def _start_failure(
    master: str, conf: Mapping[str, str], exc: Exception, jvm_stderr: HeldStderr
) -> str:
    """One line for a session that did not start: the JVM's own exception message where it gave
    one (a bad setting: Spark's launcher refuses it and exits), with the user's settings named;
    otherwise PySpark's, with the usual causes, and the JVM's held stderr shown after all."""
    java = jvm_stderr.exception_message() or _java_message(exc)
    if java is not None and "stopped SparkContext" in java:
        java = None  # the master dropped the application: see below
    yours = ", ".join(f"{k}={v}" for k, v in conf.items())
    jvm_stderr.release(show=java is None)
    if java is not None:
        settings = f" (your Spark settings: {yours})" if yours else ""
        return f"could not start Spark (master {master}): {java}{settings}"
    if isinstance(exc, Py4JError):  # the JVM started, then gave up (stopped, or gone)
        return (
            f"could not start Spark (master {master}): the session stopped while starting; "
            "check that the master is reachable from here and has a worker with free cores"
        )
    return (
        f"could not start Spark (master {master}): {first_line(exc)}; check "
        "that Java 17+ is installed (java on PATH or JAVA_HOME) and that the master is "
        "reachable"
    )


def _java_message(exc: Exception) -> str | None:
    """The message of the Java exception behind a Py4J error (e.g. SparkContext's own checks)."""
    java = getattr(exc, "java_exception", None)
    text = first_line(java) if java is not None else ""
    first = text if text != type(java).__name__ else ""
    _, sep, message = first.partition(": ")
    return message.strip() or None if sep else None


#: the stderr forwarder of each session start_session launched (what stop_quietly mutes)
_JVM_STDERR: weakref.WeakKeyDictionary[SparkSession, HeldStderr] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _keep_sigint_handler():
    """PySpark's SparkContext installs a SIGINT handler that calls into the JVM (cancelAllJobs)
    from inside whatever JVM call Ctrl-C interrupted: py4j then logs pages of reentrancy
    tracebacks. A session sparknet owns is stopped on any interrupt anyway, so the handler in
    place before (Python's KeyboardInterrupt, or the CLI's) stays."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if main and before is not None:
            signal.signal(signal.SIGINT, before)


#: contexts sparknet stopped itself (`stop_quietly`) while they still ran
_STOPPED_HERE: weakref.WeakSet[SparkContext] = weakref.WeakSet()

#: what Spark's standalone scheduler says when the master drops the application (killed on
#: the master's UI, or failed there), in the job failures it causes
_REMOVED = re.compile(r"Master removed our application: (\w+)")


def stopped_from_outside(sc: SparkContext, exc: BaseException) -> SparknetError | None:
    """The one-line error of a run whose Spark application was ended under it, by the master (killed
    there, or failed) or by anything else that stopped its context, not by sparknet; None
    when it still runs, or sparknet stopped it. `exc` is what the run raised (a job's
    failure, or a call into the stopped context): its text may name the master's reason.
    From then on the JVM's stderr is muted: its threads print stack traces as it stops."""
    removed = _REMOVED.search(_chain_text(exc))
    if not removed:
        if sc in _STOPPED_HERE:
            return None
        try:
            if not sc._jsc.sc().isStopped():
                return None
        except Exception:  # the JVM is gone: stopped all the same
            pass
    for session, held in list(_JVM_STDERR.items()):
        if session.sparkContext is sc:
            held.release(show=False)
    why = f"the master removed it: {removed.group(1)}" if removed else "its context stopped"
    return SparknetError(
        "Spark stopped the application while it ran ({why}): it was killed on the master or "
        "given up there; to go on from the last checkpoint, run again with {@resume=True}",
        why=why,
    )


def _chain_text(exc: BaseException) -> str:
    """The messages of `exc` and the exceptions behind it (a Py4J error's str asks the JVM,
    which may be gone: skipped then)."""
    parts, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        with contextlib.suppress(Exception):  # the JVM may be gone: its text is skipped
            parts.append(str(current))
        with contextlib.suppress(Exception):  # the same
            parts.append(str(getattr(current, "java_exception", "") or ""))
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


@contextlib.contextmanager
def session_for(
    spark: SparkSession | None, cfg, status: Callable[[str], None]
) -> Iterator[SparkSession]:
    """`spark`, or a session of `cfg`'s own (master, workers, Spark settings) started here and
    stopped when the block ends: what a command that runs jobs for one result needs (`sparknet
    evaluate`, `predict`), where the caller may pass the session it has."""
    if spark is not None:
        yield spark
        return
    status("starting Spark")
    own = start_session(cfg.master, cfg.workers, cfg.spark_conf, cfg.gpus_per_worker)
    try:
        yield own
    finally:
        stop_quietly(own)


def stop_quietly(session: SparkSession) -> None:
    """Stop a session sparknet started, in one piece after an interrupt too: cancel what still
    runs, then mute the JVM's stderr, where stopping in the middle of a job prints stack traces
    (RejectedExecutionException from futures that complete after their pool shut down). The
    JVM may be gone already (SIGTERM to the process group): its py4j error must not replace
    the interrupt the user sees. The JVM's Python workers write to the same pipe: a worker whose
    task is cancelled while it sends its result prints a BrokenPipeError traceback there."""
    with contextlib.suppress(Exception):  # the JVM may be gone (see above): nothing to mark
        if not session.sparkContext._jsc.sc().isStopped():
            _STOPPED_HERE.add(session.sparkContext)
    held = _JVM_STDERR.get(session)
    if held is not None:
        held.release(show=False)
    with contextlib.suppress(Exception):  # a gone JVM runs no jobs and prints nothing
        session.sparkContext.cancelAllJobs()
        jvm = session.sparkContext._jvm
        jvm.System.setErr(jvm.java.io.PrintStream(jvm.java.io.OutputStream.nullOutputStream()))
    with contextlib.suppress(Exception):  # a gone JVM's error must not replace the interrupt
        session.stop()
    if (private := _LOCAL_DIRS.pop(session, None)) is not None:
        shutil.rmtree(private, ignore_errors=True)
