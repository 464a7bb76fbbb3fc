"""What every benchmark shares.

Where its figures go, timing and medians, how busy the machine was, its report (a table, notes,
files), the tables printed and the plots saved.

Figures from a 2-core box are only worth comparing when nothing else was running; every
benchmark records the load it started under so a reader can discard a skewed run.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

# `# lazy: X` below: every benchmark and `sparknet bench --help` import this module; torch and
# matplotlib only where the machine is described or a figure drawn

#: where every `sparknet bench` subcommand writes its figures unless given `--out`
DEFAULT_OUT = Path("bench")

#: CPU time used by anything while the benchmark waits 1 s before it starts; above it, warn
BUSY_FRACTION = 0.15


# ---- timing and medians -----------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def timed(fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn`, after `warmup` unmeasured ones."""
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


#: (images, encoded bytes) handled by one run of a path
Counted = tuple[int, int]

#: one path's unit of work: batch `k` of pass `rep`, returning (images, encoded bytes)
Step = Callable[[int, int], Counted]


@dataclass
class Pass:
    """Per path: seconds (wall and CPU) of each measured repetition, and what one repetition
    handled (images, encoded bytes)."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    counted: dict[str, tuple[int, int]]

    def rate(self, name: str) -> float:
        return self.counted[name][0] / median(self.wall[name])


def interleaved(paths: dict[str, Step], *, reps: int, units: int, first_rep: int = 0) -> Pass:
    """One warm-up pass over all units, then `reps` measured ones. Every path does unit k before
    any does unit k+1, in an order reversed every other unit: a drift of the shared VM's speed,
    which is large here, then falls on all paths alike."""
    wall = {name: [0.0] * reps for name in paths}
    cpu = {name: [0.0] * reps for name in paths}
    counted = dict.fromkeys(paths, (0, 0))
    for rep in range(reps + 1):
        for k in range(units):
            for name, run in list(paths.items())[:: 1 if k % 2 == 0 else -1]:
                c0, t0 = time.process_time(), time.perf_counter()
                n, nbytes = run(first_rep + rep, k)
                t1, c1 = time.perf_counter(), time.process_time()
                if rep == 0:
                    counted[name] = (counted[name][0] + n, counted[name][1] + nbytes)
                else:
                    wall[name][rep - 1] += t1 - t0
                    cpu[name][rep - 1] += c1 - c0
    return Pass(wall, cpu, counted)


# ---- the machine ------------------------------------------------------------------------------


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


def machine() -> dict[str, Any]:
    """Where the figures were measured: they mean little without it."""
    import torch  # lazy: torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


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


# ---- what a benchmark writes ------------------------------------------------------------------


def write_results(name: str, results: dict[str, Any], out: Path) -> Path:
    """`<out>/<name>.json`, read back by `sparknet bench all` for its summary."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    _write_text(path, json.dumps(results, indent=2) + "\n")
    return path


def read_results(name: str, out: Path) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass
class BenchReport:
    """One benchmark's outcome: `rows` share the keys of `columns`; `notes` are the lines a
    reader needs to judge the figures (goals met or missed, what was measured how)."""

    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def write(self, out: Path) -> None:
        """`<name>.json` (every figure, with the machine it ran on) and `<name>.csv` (the
        table) into `out`, each written whole under a temp name first."""
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "name": self.name,
            "title": self.title,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(),
            "columns": self.columns,
            "rows": self.rows,
            "notes": self.notes,
            **self.extra,
        }
        _write_text(out / f"{self.name}.json", json.dumps(doc, indent=2) + "\n")
        csv_path = out / f"{self.name}.csv"
        tmp = csv_path.with_name(f".{csv_path.name}.tmp")
        with tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, csv_path)
        self.files[:0] = [out / f"{self.name}.json", csv_path]


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- tables and plots -------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def show_report(report: BenchReport, console: Any) -> None:
    """A report's table on a rich console, then its notes and the files it wrote."""
    table = Table(title=report.title, min_width=len(report.title) + 4)  # the title unwrapped
    for col in report.columns:
        table.add_column(col, justify="left" if col == report.columns[0] else "right")
    for row in report.rows:
        table.add_row(*(_cell(row.get(c)) for c in report.columns))
    console.print(table)
    for line in [*report.notes, *(f"wrote {path}" for path in report.files)]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _headline_figure(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def headline_table(outcome: dict[str, tuple[int, float]], out: Path) -> Any:
    """The rich table of every benchmark's `headline` rows: `outcome` maps a benchmark's name to
    (exit code, wall seconds); its figures are read back from `<out>/<name>.json`."""
    table = Table(title="sparknet benchmarks", min_width=len("sparknet benchmarks") + 4)
    for col in ("benchmark", "metric", "sparknet", "reference", "ratio", "goal", "wall s"):
        table.add_column(col, justify="left" if col in ("benchmark", "metric") else "right")
    for name, (rc, wall) in outcome.items():
        results = read_results(name, out)
        if rc != 0 or results is None:
            table.add_row(name, f"[red]failed (exit {rc})[/red]", "", "", "", "", f"{wall:.0f}")
            continue
        if not results.get("headline"):  # shard_workers: figures only, no reference to beat
            table.add_row(name, f"(no headline: see {name}.json)", "", "", "", "", f"{wall:.0f}")
        for i, row in enumerate(results.get("headline", [])):
            table.add_row(
                name if i == 0 else "",
                row["metric"],
                _headline_figure(row["sparknet"]),
                f"{_headline_figure(row['reference'])} ({row['reference_name']})",
                f"{row['ratio']:.2f}",
                row["goal"],
                f"{wall:.0f}" if i == 0 else "",
            )
    return table


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display here, nor on a cluster)."""
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    return plt


def save_figure(fig, path: Path) -> Path:
    """A matplotlib figure to `path` (written whole under a temp name first), then closed."""
    plt = pyplot()

    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
    return path
