"""Spark's Python worker daemon with torch and sparknet imported once, before it forks workers.

Opt in with `--conf spark.python.daemon.module=sparknet.training.daemon`.

pyspark.daemon forks one Python worker per task slot from a single daemon process per executor;
every worker then imports what its first task unpickles: torch and sparknet, seconds each on a
busy machine, per worker. Imported here, in the daemon, the workers start with them already in
memory (shared copy-on-write). Importing is fork-safe: it starts no thread and no CUDA context
(those begin at the first parallel op or CUDA call, in the worker); numpy's OpenBLAS starts its
thread pool at import but shuts it down around fork() itself (pthread_atfork). pyspark's own
daemon refuses to import anything before forking for modules that do start threads (pandas,
pyarrow): this module imports neither.

Not sparknet's default: the import then happens once, serially, when Spark starts the executor's
first Python worker, instead of in every worker in parallel during round 1. With 2 workers on 2
cores that made the time to the end of round 1 1.6 s longer (`sparknet bench startup`); it pays
where workers outnumber free cores, or are forked again later (Spark stops a Python worker idle
for a minute), and it lets the workers share torch's memory.
"""

from __future__ import annotations


def preimport() -> None:
    """What every sparknet task unpickles first: torch and the worker side of sparknet."""
    # lazy on purpose: importing them, once, before the daemon forks is this function's job
    import torch  # noqa: F401

    import sparknet.training.worker  # lazy: torch, boto3, as above  # noqa: F401


if __name__ == "__main__":
    from pyspark.daemon import manager

    preimport()
    manager()
