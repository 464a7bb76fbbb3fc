"""The workers each phase of `data shard` (the decode check, then the writing) runs on.

Threads or spawned processes, chosen by the size of the source, and a process pool that leaves
Ctrl-C to the parent.

Kept apart because both phases use it (`shard_checks`, `shards`), and neither imports the other.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.pool
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker

#: how on_progress names its phases; both count images
CHECK, WRITE = "check", "write"


#: a phase over fewer images runs on threads by default: a spawned process costs ~1 s of CPU to
#: start (Python and the imports), which threads do not pay; over more, processes win, because
#: threads share one GIL for what is not decoding (measured on 2 cores, 108 KB photos: checking
#: ran at 830 images/s on 2 threads and 1,090 on 2 processes once started, each pool ~2 s to
#: start; break-even near 7,600 images)
PROCESS_MIN_IMAGES = 10_000
#: the most processes the default starts (each holds ~100 MB of imports)
MAX_DEFAULT_PROCESSES = 32


def phase_workers(processes: int | None, images: int, jobs: int) -> tuple[str, int]:
    """("processes" | "threads", how many) for a phase over `images` images in `jobs` jobs:
    `--processes N` as given (1: serially, here), else processes on every core for a big
    source and threads for a small one; never more workers than jobs."""
    if processes is not None:
        n = min(processes, jobs)
        return ("processes" if n > 1 else "threads"), max(1, n)
    cores = os.cpu_count() or 1
    if cores > 1 and images >= PROCESS_MIN_IMAGES and jobs > 1:
        return "processes", min(cores, MAX_DEFAULT_PROCESSES, jobs)
    return "threads", max(1, min(cores, jobs))


@contextlib.contextmanager
def pool_ignoring_sigint(workers: int) -> Iterator[multiprocessing.pool.Pool]:
    """A spawned pool whose processes leave Ctrl-C (sent to the whole foreground group) to the
    parent, which stops the pool and prints one line; each worker would otherwise print its own
    KeyboardInterrupt traceback.

    The processes are started while this thread blocks SIGINT: a blocked signal stays blocked
    across exec, so they never see it, imports included. A Ctrl-C in the meantime is not lost
    (as it would be with SIGINT ignored): another thread may take it, so a handler notes it, and
    it is raised once the pool is up and in the `with`, so the pool is terminated."""
    # spawn, not fork: the caller may hold threads (Spark, torch) that fork would break
    ctx = multiprocessing.get_context("spawn")
    if threading.current_thread() is not threading.main_thread():  # cannot touch handlers
        with ctx.Pool(workers) as pool:
            yield pool
        return

    resource_tracker.ensure_running()  # it unblocks SIGINT when it starts itself
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = ctx.Pool(workers)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, previous)
        raise
    with pool:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending Ctrl-C: noted now
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt
        yield pool
