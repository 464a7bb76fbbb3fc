"""The Spark session a training run uses: an embedded local one by default, or `--master`."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from sparknet.errors import SparknetError

#: Local mode retries nothing unless told to; a demanding user expects a flaky task to be retried.
LOCAL_MAX_TASK_FAILURES = 4


#: glibc hands large tensors back to the kernel after every step and faults them in again on the
#: next (~12k page faults a step, ~10% of a small CNN's step time); a worker allocates the same
#: sizes every step, so Spark's Python workers keep them (set for the executors only).
MALLOC_THRESHOLD = 1 << 30


def embedded_master(cores: int | None = None) -> str:
    return f"local[{cores or os.cpu_count() or 1},{LOCAL_MAX_TASK_FAILURES}]"


def task_cpus(master: str, workers: int) -> int:
    """Cores per task on the embedded master: all cores shared evenly, never oversubscribed."""
    if not master.startswith("local["):
        return 1
    cores = int(master[len("local[") :].split(",")[0].rstrip("]").replace("*", "0") or 0)
    cores = cores or os.cpu_count() or 1
    return max(1, cores // min(workers, cores))


def driver_memory_gb(total_bytes: int | None = None) -> int:
    """A quarter of the machine's memory, 2 to 16 GiB.

    Every update passes through the driver JVM's heap on its way back, and Spark's default 1 GiB
    does not hold two 100 MB results: the task-result thread dies of OutOfMemoryError and, in
    local mode, the job then waits forever instead of failing.
    """
    if total_bytes is None:
        total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(2, min(16, total_bytes // 4 // 2**30))


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


def start_session(master: str | None, workers: int) -> SparkSession:
    """A new SparkSession whose Python workers use this interpreter (and so see torch)."""
    master = master or embedded_master()
    find_java()
    # PySpark's driver picks the executors' Python from this variable, not from the conf.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    log4j = Path(__file__).with_name("log4j2.properties")
    memory_gb = driver_memory_gb()
    builder = (
        SparkSession.builder.master(master)
        .appName("sparknet")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.pyspark.driver.python", sys.executable)
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.broadcast.compress", "false")  # float weights do not compress
        .config("spark.driver.memory", f"{memory_gb}g")
        .config("spark.executorEnv.MALLOC_MMAP_THRESHOLD_", str(MALLOC_THRESHOLD))
        .config("spark.executorEnv.MALLOC_TRIM_THRESHOLD_", str(MALLOC_THRESHOLD))
        .config("spark.driver.maxResultSize", f"{memory_gb // 2}g")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={log4j.as_uri()}")
    )
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # everything stays on loopback
        builder = builder.config("spark.task.cpus", str(task_cpus(master, workers)))
    with _gateway_killed_on_failure():
        try:
            with _keep_sigint_handler():
                session = builder.getOrCreate()
        except PySparkException as exc:
            raise SparknetError(
                f"could not start Spark (master {master}): {str(exc).splitlines()[0]}; check "
                "that Java 17+ is installed (java on PATH or JAVA_HOME) and that the master is "
                "reachable"
            ) from exc
        session.sparkContext.setLogLevel("FATAL")  # failures reach the user as SparknetError
    return session


@contextlib.contextmanager
def _gateway_killed_on_failure():
    """Kill the JVM PySpark launches when the session does not come up (Ctrl-C or SIGTERM while
    Spark starts): PySpark only waits for it, so it would live on as an orphan holding its
    multi-GiB heap, and later print pages of NoSuchFileException for the connection file PySpark
    removed. The launch is seen by wrapping the `Popen` PySpark's gateway module calls."""
    from pyspark import java_gateway

    started: list = []
    real = java_gateway.Popen

    def popen(*args, **kwargs):
        kwargs.setdefault("stderr", subprocess.PIPE)
        proc = real(*args, **kwargs)
        started.append(proc)
        if proc.stderr is not None:
            threading.Thread(target=_forward_jvm_stderr, args=(proc.stderr,), daemon=True).start()
        return proc

    java_gateway.Popen = popen
    try:
        yield
    except BaseException:
        for proc in started:
            with contextlib.suppress(Exception):
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


def _forward_jvm_stderr(pipe) -> None:
    """Copy the gateway JVM's stderr to ours, less `_JVM_NOISE`. It keeps reading to the end
    whatever happens to our stderr: a JVM blocked on a full pipe would hang the run."""
    for line in iter(pipe.readline, b""):
        if line.startswith(_JVM_NOISE):
            continue
        with contextlib.suppress(OSError):
            os.write(2, line)


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


def stop_quietly(session: SparkSession) -> None:
    """Stop a session sparknet started, in one piece after an interrupt too: cancel what still
    runs, then mute the JVM's stderr, where stopping in the middle of a job prints stack traces
    (RejectedExecutionException from futures that complete after their pool shut down). The
    JVM may be gone already (SIGTERM to the process group): its py4j error must not replace
    the interrupt the user sees."""
    with contextlib.suppress(Exception):
        session.sparkContext.cancelAllJobs()
        jvm = session.sparkContext._jvm
        jvm.System.setErr(jvm.java.io.PrintStream(jvm.java.io.OutputStream.nullOutputStream()))
    with contextlib.suppress(Exception):
        session.stop()


def check_python_workers(spark: SparkSession, tasks: int) -> None:
    """Fail before the first training job when Spark's Python workers cannot import sparknet
    (a user's session started without PYSPARK_PYTHON runs them on `python3` from PATH), instead
    of after every task's retries."""
    sc = spark.sparkContext
    # a lambda is pickled by value: unpickling it on the executors needs no sparknet
    probe = lambda _: (  # noqa: E731
        __import__("sys").executable,
        __import__("importlib.util").util.find_spec("sparknet") is not None,
    )
    fix = (
        "set PYSPARK_PYTHON (spark-submit: spark.pyspark.python) to a Python that has sparknet, "
        f"e.g. {sys.executable}, before the SparkSession starts"
    )
    try:
        found = sc.parallelize(range(tasks), tasks).map(probe).collect()
    except (Py4JError, PySparkException) as exc:
        cause = _worker_failure(exc)
        raise SparknetError(f"Spark's Python workers did not start ({cause}); {fix}") from exc
    missing = sorted({exe for exe, ok in found if not ok})
    if missing:
        raise SparknetError(
            f"Spark's Python workers ({', '.join(missing)}) cannot import sparknet: {fix}"
        )


def _worker_failure(exc: Exception) -> str:
    """Why Python workers failed: the worker's own exception line where there is one, else the
    JVM's (e.g. "EOFException occurred while reading the port number from pyspark.daemon's
    stdout" for a PYSPARK_PYTHON that is not a Python)."""
    from sparknet.training.transport import describe_task_failure

    cause = describe_task_failure(exc)
    if not cause.startswith("An error occurred while calling"):
        return cause
    for line in str(getattr(exc, "java_exception", "") or exc).splitlines():
        _, sep, message = line.partition("Exception: ")
        if sep and message.strip():
            return message.strip()
    return cause
