"""`data shard` on threads against processes: the figures behind its default (PROCESS_MIN_IMAGES).

Writes the same tree of ImageNet-like photos (500x375, ~110 KB, see `photos`) into a fresh
DEST with one thread per core, one process per core, and serially, interleaved, and times the
check phase (decoding every image) and the write phase apart. Two tree sizes separate what a
pool costs to start from what it does per image: rate = extra images / extra seconds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from sparknet.bench.common import machine_note, write_results
from sparknet.bench.photos import photo_jpegs, write_tree
from sparknet.data.shards import write_dataset

NAME = "shard_workers"


def timed(src: Path, dest: Path, processes: int | None) -> tuple[float, float]:
    """(check seconds, write seconds) of one `write_dataset` into an empty `dest`."""
    shutil.rmtree(dest, ignore_errors=True)
    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    write_dataset(
        src, dest, shard_bytes=8 << 20, processes=processes,
        on_progress=lambda phase, done, total: marks.setdefault(phase, time.perf_counter()),
    )  # fmt: skip
    return marks["write"] - t0, time.perf_counter() - marks["write"]


def run(*, small: int, big: int, reps: int, out: Path) -> dict[str, Any]:
    """`sparknet bench shard-workers`: prints its figures, writes `<out>/shard_workers.json`."""
    cores = os.cpu_count() or 1
    modes = {f"{cores} threads": None, f"{cores} processes": cores, "serial": 1}
    tmp = Path(tempfile.mkdtemp(prefix="sparknet-bench-"))
    seconds: dict[str, dict[int, list[tuple[float, float]]]] = {m: {} for m in modes}
    try:
        jpegs, _ = photo_jpegs(big)
        for n in (small, big):
            write_tree(tmp / f"tree-{n}", jpegs[:n])
            for rep in range(reps):
                order = list(modes.items())[:: 1 if rep % 2 == 0 else -1]
                for name, processes in order:
                    # `None` picks threads for these sizes (under PROCESS_MIN_IMAGES)
                    got = timed(tmp / f"tree-{n}", tmp / "ds", processes)
                    seconds[name].setdefault(n, []).append(got)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results: dict[str, Any] = {"machine": machine_note(), "cores": cores, "modes": {}}
    extra = big - small
    print(f"data shard, {small} and {big} photos of ~110 KB, median of {reps}:")
    for name, by_n in seconds.items():
        med = {n: sorted(v, key=sum)[len(v) // 2] for n, v in by_n.items()}
        check_rate = extra / max(1e-9, med[big][0] - med[small][0])
        write_rate = extra / max(1e-9, med[big][1] - med[small][1])
        start = med[small][0] - small / check_rate
        print(
            f"  {name:14s} check {check_rate:6.0f} images/s, write {write_rate:6.0f} images/s "
            f"once started; start-up of the check phase {max(0.0, start):.1f} s"
        )
        results["modes"][name] = {
            "check_images_per_s": check_rate,
            "write_images_per_s": write_rate,
            "check_startup_s": start,
            "seconds": {str(n): v for n, v in by_n.items()},
        }
    print(f"\nwrote {write_results(NAME, results, out)}")
    return results
