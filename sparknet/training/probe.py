"""Before round 1: Spark's Python workers can import what a run needs.

sparknet, and the user's `--model`/`--data` modules, checked with one small job rather than
learnt from every task's retries."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from py4j.protocol import Py4JError
from pyspark import InheritableThread
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from sparknet.errors import Placeholder, SparknetError
from sparknet.imports import is_reference
from sparknet.training.transport import describe_task_failure, wait_for_executors

#: how long the probe job may take: it starts every executor's Python workers, which import
#: torch first under the opt-in daemon (seconds); a job no executor can run would wait forever
PROBE_LIMIT_S = 120.0


def user_modules(*specs: str | None) -> tuple[str, ...]:
    """The modules of `package.module:factory` specs (`--model`, `--data`), which the Python
    workers import too; other names are sparknet's own. The caller leaves out a `--data` that
    names a DataFrame (`parquet:PATH`, `table:NAME`) or a `datasets:` entry."""
    return tuple(spec.partition(":")[0] for spec in specs if spec and is_reference(spec))


def check_python_workers(spark: SparkSession, tasks: int, modules: Sequence[str] = ()) -> None:
    """Fail before the first training job when Spark's Python workers cannot import sparknet
    (a user's session started without PYSPARK_PYTHON runs them on `python3` from PATH), or the
    user's `modules` (`user_modules`: on a cluster they resolve against the executor's
    directory, not the driver's), instead of after every task's retries."""
    sc = spark.sparkContext
    names = ("sparknet", *modules)

    def probe(_):
        # defined here, so pickled by value: unpickling it on the executors needs no sparknet;
        # its imports stay inside, as they run there: what the executor's Python finds
        import importlib.util
        import sys as worker_sys  # inside: the executor's sys, not the driver's

        def lost(name: str) -> bool:
            try:
                return importlib.util.find_spec(name) is None
            except (ImportError, ValueError):
                return True

        return worker_sys.executable, [name for name in names if lost(name)]

    fix = (
        "set PYSPARK_PYTHON (spark-submit: spark.pyspark.python) to a Python that has sparknet, "
        f"e.g. {sys.executable}, before the SparkSession starts"
    )
    # on a cluster: once its executors are there, so the probe starts every one's Python workers
    # before round 1, rather than during it
    wait_for_executors(sc, tasks)
    try:
        found = _collect_within(sc, sc.parallelize(range(tasks), tasks).map(probe), PROBE_LIMIT_S)
    except (Py4JError, PySparkException) as exc:
        cause = _worker_failure(exc)
        raise SparknetError(f"Spark's Python workers did not start ({cause}); {fix}") from exc
    if missing := sorted({exe for exe, lost in found if "sparknet" in lost}):
        raise SparknetError(
            f"Spark's Python workers ({', '.join(missing)}) cannot import sparknet: {fix}"
        )
    if lost := sorted({name for _, names_lost in found for name in names_lost}):
        raise SparknetError(
            "Spark's Python workers cannot import {lost} (your {@model}/{@data} module): ship it "
            "to every executor ({@conf=files} or a .zip, {@conf=path} on every worker, or "
            "install it in their Python)",
            lost=", ".join(lost), files=Placeholder("spark.submit.pyFiles=FILE.py"),
            path=Placeholder("spark.executorEnv.PYTHONPATH=DIR"),
        )  # fmt: skip


def _collect_within(sc, rdd, limit_s: float) -> list:
    """`rdd.collect()`, cancelled after `limit_s` seconds with a SparknetError: a job whose
    tasks no executor can take (no GPU, too few cores) waits in Spark forever."""
    group = f"sparknet-probe-{id(rdd)}"
    out: dict = {}

    def run() -> None:
        sc.setJobGroup(group, "sparknet: Python workers", interruptOnCancel=True)
        try:
            out["rows"] = rdd.collect()
        except BaseException as exc:  # handed to the caller's thread
            out["error"] = exc

    thread = InheritableThread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        sc.cancelJobGroup(group)
        thread.join(10)
        raise SparknetError(
            f"Spark's Python workers did not start in {limit_s:.0f} s: no executor took the "
            "probe's tasks (check the executors' cores, GPUs and memory against the tasks')"
        )
    if "error" in out:
        raise out["error"]
    return out["rows"]


def _worker_failure(exc: Exception) -> str:
    """Why Python workers failed: the worker's own exception line where there is one, else the
    JVM's (e.g. "EOFException occurred while reading the port number from pyspark.daemon's
    stdout" for a PYSPARK_PYTHON that is not a Python)."""
    cause = describe_task_failure(exc)
    if not cause.startswith("An error occurred while calling"):
        return cause
    for line in str(getattr(exc, "java_exception", "") or exc).splitlines():
        _, sep, message = line.partition("Exception: ")
        if sep and message.strip():
            return message.strip()
    return cause
