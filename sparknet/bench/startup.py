"""Where a run's first round goes, and round 1 against the steady state.

`sparknet train --data digits --workers 2 --rounds 5` as a user runs it (a subprocess, output to
a file, not a terminal), timed from the lines it prints on stderr and its metrics.jsonl:

- driver: process start to "starting Spark" (CLI and torch imports, data and model checks);
- spark: "starting Spark" to "starting Python workers" (the JVM and the SparkContext);
- python workers: from there to round 1's start (the probe job: Spark starts each executor's
  Python daemon, which forks the workers);
- round 1, and the steady state (median of the later rounds' seconds); their ratio.

Two variants, alternated so both see the same machine: `sparknet` as it runs by default (Python
workers reused for the whole run, each importing torch and sparknet when it unpickles its first
task) and `torch daemon` (`--conf spark.python.daemon.module=sparknet.training.daemon`: the
executor's worker daemon imports them once, before it forks the workers).

Measured on the quiet 2-core VM (2026-12-01, median of 2 runs, seconds):

| phase | before the change | sparknet | torch daemon |
|---|---|---|---|
| driver | 3.95-4.25 | 3.78 | 3.79 |
| spark | 4.49-4.58 | 4.39 | 4.41 |
| python workers | 1.31-1.44 | 1.36 | 3.42 |
| round 1 | 3.85-3.97 | 3.61 | 3.10 |
| steady round | 0.32-0.36 | 0.30 | 0.32 |
| start to end of round 1 | 13.72-14.11 | 13.13 | 14.71 |

In a worker, round 1 pays for importing torch (1.3 s), sparknet (0.2 s) and, for digits,
scikit-learn (1.1 s). The daemon moves the first two out of round 1 but into the workers' start,
serially, so with as many cores as workers the run reaches the end of round 1 later: it is not
the default.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sparknet.bench.common import machine_note, median, steal_note, write_results

NAME = "startup"
SPARKNET = Path(sys.executable).with_name("sparknet")
TORCH_DAEMON = ("--conf", "spark.python.daemon.module=sparknet.training.daemon")
VARIANTS = {"sparknet": (), "torch daemon": TORCH_DAEMON}


def _timed_lines(cmd: list[str]) -> tuple[list[tuple[float, str]], int]:
    """(seconds since start, line) for every stderr line of `cmd`, and its exit code."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    assert proc.stderr is not None
    lines = [(time.monotonic() - t0, line.rstrip()) for line in proc.stderr]
    lines.append((time.monotonic() - t0, "exit"))
    return lines, proc.wait()


def _at(lines: list[tuple[float, str]], text: str) -> float:
    return next(t for t, line in lines if text in line)


def one_run(rounds: int, extra: tuple[str, ...]) -> dict[str, float]:
    """The phases of one `sparknet train` run, in seconds."""
    with tempfile.TemporaryDirectory(prefix="sparknet-startup-") as tmp:
        out = Path(tmp) / "run"
        cmd = [
            str(SPARKNET), "train", "--data", "digits", "--workers", "2", "--rounds",
            str(rounds), "--eval-every", "0", "--out", str(out), *extra,
        ]  # fmt: skip
        lines, rc = _timed_lines(cmd)
        if rc != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {rc}: {lines[-5:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    round1 = rows[0]["seconds"]
    round1_end = _at(lines, f"round 1/{rounds}")
    workers_start = _at(lines, "starting Python workers")
    spark_start = _at(lines, "starting Spark")
    return {
        "driver_s": spark_start,
        "spark_s": workers_start - spark_start,
        "python_workers_s": round1_end - round1["total"] - workers_start,
        "round1_s": round1["total"],
        "round1_load_s": round1["broadcast"],
        "round1_compute_s": round1["compute"],
        "round1_rest_s": round1["aggregate"],
        "steady_round_s": median([r["seconds"]["total"] for r in rows[1:]]),
        "to_round1_end_s": round1_end,
        "wall_s": lines[-1][0],
    }


def run(*, rounds: int, repeats: int, out: Path) -> dict[str, Any]:
    """`sparknet bench startup`: prints its figures and writes `<out>/startup.json`."""
    machine = machine_note()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):
        for name, extra in VARIANTS.items():
            runs[name].append(one_run(rounds, extra))
    steal_note(machine)
    figures = {
        name: {key: median([r[key] for r in found]) for key in found[0]}
        for name, found in runs.items()
    }
    header = f"seconds (median of {repeats})"
    print(f"{header:<26}" + "".join(f"{name:>14}" for name in VARIANTS))
    for key in figures["sparknet"]:
        print(f"{key:<26}" + "".join(f"{figures[name][key]:>14.2f}" for name in VARIANTS))
    ours, daemon = figures["sparknet"], figures["torch daemon"]
    ratio = ours["round1_s"] / ours["steady_round_s"]
    daemon_ratio = daemon["round1_s"] / daemon["steady_round_s"]
    print(f"round 1 / steady round: {ratio:.1f} (torch daemon {daemon_ratio:.1f})")
    results = {
        "machine": machine,
        "settings": {"rounds": rounds, "repeats": repeats, "data": "digits"},
        "figures": figures,
        "runs": runs,
        "headline": [
            {
                "metric": "round 1 / steady-state round",
                "sparknet": ours["round1_s"],
                "reference": ours["steady_round_s"],
                "reference_name": "steady round s",
                "ratio": ratio,
                "goal": "",
            },
            {
                "metric": "  start to end of round 1, s",
                "sparknet": ours["to_round1_end_s"],
                "reference": daemon["to_round1_end_s"],
                "reference_name": "torch daemon",
                "ratio": ours["to_round1_end_s"] / daemon["to_round1_end_s"],
                "goal": "",
            },
        ],
    }
    print(f"\nwrote {write_results(NAME, results, out)}")
    return results
