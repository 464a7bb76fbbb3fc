"""Small helpers shared by the benchmarks: where figures go, and how busy the machine was.

Figures from a 2-core box are only worth comparing when nothing else was running; every
benchmark records the load average it started under so a reader can discard a skewed run.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: CPU time used by anything while the benchmark waits 1 s before it starts; above it, warn
BUSY_FRACTION = 0.15


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _cpu_fields() -> list[int] | None:
    """The aggregate `cpu` line of /proc/stat, in jiffies; None where there is none."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies over all CPUs."""
    fields = _cpu_fields()
    return None if fields is None else (fields[3] + fields[4], sum(fields))  # idle + iowait


def busy_fraction(seconds: float = 1.0) -> float | None:
    """Share of all CPUs busy over the next `seconds` (this process sleeps, so: everyone else)."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    if before is None or after is None or after[1] == before[1]:
        return None
    return 1.0 - (after[0] - before[0]) / (after[1] - before[1])


def machine_note() -> dict[str, Any]:
    """Cores, load average and how busy the CPUs are right now; warns if something else runs.

    The load average lags by minutes (it still counts the previous benchmark), so the warning
    goes by the CPUs' busy share over one second instead.
    """
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    busy = busy_fraction()
    shown = "unknown" if busy is None else f"{busy:.0%}"
    print(f"machine: {cores} cores, CPUs busy before start {shown}, 1-min load average {load:.2f}")
    if busy is not None and busy > BUSY_FRACTION:
        print("  warning: something else is using the CPUs; figures below are likely skewed")
    return {
        "cores": cores,
        "load_avg_1min": round(load, 2),
        "busy_before_start": busy,
        "cpu_jiffies_at_start": _cpu_fields(),
    }


def steal_note(machine: dict[str, Any]) -> float | None:
    """CPU seconds the hypervisor took from this VM since `machine_note`; prints them.

    Steal is invisible to `ps` and `top`'s process list, yet slows every process alike; a run
    with much of it is worth repeating.
    """
    start, now = machine.get("cpu_jiffies_at_start"), _cpu_fields()
    if not start or not now or len(now) < 8:
        return None
    steal_s = (now[7] - start[7]) / os.sysconf("SC_CLK_TCK")
    print(f"CPU time stolen by the hypervisor during the run: {steal_s:.1f} s")
    machine["steal_s"] = steal_s
    return steal_s


def _proc_stat(pid_dir: Path) -> tuple[int, int, bytes] | None:
    """(parent pid, minor page faults, command line) of one /proc entry."""
    try:
        stat = (pid_dir / "stat").read_text()
        cmdline = (pid_dir / "cmdline").read_bytes()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return int(fields[1]), int(fields[7]), cmdline


def descendant_faults(marker: str) -> dict[int, int]:
    """Minor page faults so far of each descendant of this process whose command line holds
    `marker` (Linux; empty elsewhere). Spark's Python workers are such descendants."""
    procs = {
        int(d.name): st for d in Path("/proc").glob("[0-9]*") if (st := _proc_stat(d)) is not None
    }
    me = os.getpid()

    def descends(pid: int) -> bool:
        for _ in range(64):
            pid = procs[pid][0] if pid in procs else 0
            if pid in (me, 0, 1):
                return pid == me
        return False

    return {
        pid: faults
        for pid, (_, faults, cmd) in procs.items()
        if marker.encode() in cmd and descends(pid)
    }


def write_results(name: str, results: dict[str, Any]) -> Path:
    """benchmarks/results/<name>.json, read back by `python -m benchmarks` for its summary."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def read_results(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None
