"""The Spark session a training run uses: an embedded local one by default, or `--master`."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

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
    try:
        session = builder.getOrCreate()
    except PySparkException as exc:
        raise SparknetError(
            f"could not start Spark (master {master}): {str(exc).splitlines()[0]}; check that "
            "Java 17+ is installed (java on PATH or JAVA_HOME) and that the master is reachable"
        ) from exc
    session.sparkContext.setLogLevel("FATAL")  # failures reach the user as SparknetError
    return session
