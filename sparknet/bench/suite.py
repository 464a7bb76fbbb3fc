"""`sparknet bench all`: every engine benchmark in its own process, then one headline table.

Each benchmark starts its own Spark JVM, and a JVM's heap and options are fixed when it starts;
a fresh interpreter per benchmark keeps one run's JVM, threads and memory from skewing the next.
The benchmarks print and record figures and assert nothing: a missed goal shows in the table, it
does not fail the build.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from sparknet.bench.common import BUSY_FRACTION, busy_fraction, headline_table, read_results

#: subcommand -> the name of the JSON it writes (`<out>/<name>.json`), in the order `all` runs
BENCHMARKS = {
    "throughput": "throughput",
    "sync-cost": "sync_cost",
    "data-stream": "data_stream",
    "images-per-core": "images_per_core",
    "shard-workers": "shard_workers",
    "precision": "precision",
    "startup": "startup",
}


def command_of(name: str) -> str | None:
    """The subcommand a name given to `all` means (`sync-cost` or `sync_cost`); None if none."""
    command = name.replace("_", "-")
    return command if command in BENCHMARKS else None


def wait_for_quiet(console: Console, limit_s: float = 30.0) -> None:
    """Let the previous benchmark's JVM finish exiting (it outlives its Python by seconds)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        busy = busy_fraction()
        if busy is None or busy <= BUSY_FRACTION:
            break
    waited = time.monotonic() - t0
    if waited > 1.5:
        console.print(f"(waited {waited:.0f} s for the CPUs to go quiet)")


def run_all(commands: list[str], out: Path) -> int:
    """Run `commands` (keys of BENCHMARKS) one process each, writing into `out`; print the
    headline table. The exit code: the highest of the benchmarks'."""
    # Wide enough for the table when the output goes to a log rather than a terminal.
    console = Console(width=None if sys.stdout.isatty() else 120)
    outcome: dict[str, tuple[int, float]] = {}
    for command in commands:
        name = BENCHMARKS[command]
        (out / f"{name}.json").unlink(missing_ok=True)
        wait_for_quiet(console)
        console.rule(f"sparknet bench {command}")
        t0 = time.perf_counter()
        rc = subprocess.call(
            [sys.executable, "-u", "-m", "sparknet.cli.bench", command, "--out", str(out)]
        )
        outcome[name] = (rc, time.perf_counter() - t0)

    console.print()
    console.print(headline_table(outcome, out))
    for name in outcome:
        if (r := read_results(name, out)) is not None:
            m = r["machine"]
            busy = m.get("busy_before_start")
            steal = m.get("steal_s")
            console.print(
                f"{name}: CPUs busy just before start "
                f"{'?' if busy is None else f'{busy:.0%}'}, stolen by the hypervisor during it "
                f"{'?' if steal is None else f'{steal:.1f} s'}"
            )
    console.print(f"figures in {out}")
    return max((rc for rc, _ in outcome.values()), default=0)
