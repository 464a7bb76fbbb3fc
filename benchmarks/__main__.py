"""`make bench`: every benchmark in its own process, then one table of the headline figures.

Each benchmark starts its own Spark JVM, and a JVM's heap and options are fixed when it starts;
a fresh interpreter per benchmark keeps one run's JVM, threads and memory from skewing the next.
The benchmarks print and record figures and assert nothing: a missed goal shows in the table, it
does not fail the build.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from benchmarks._common import BUSY_FRACTION, RESULTS_DIR, busy_fraction, read_results

BENCHMARKS = (
    "throughput",
    "sync_cost",
    "data_stream",
    "images_per_core",
    "shard_workers",
    "precision",
    "startup",
)


def _fmt(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"any of {', '.join(BENCHMARKS)}; default: all"
    )
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.names) - set(BENCHMARKS)):
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    names = args.names or list(BENCHMARKS)

    # Wide enough for the table when the output goes to a log rather than a terminal.
    console = Console(width=None if sys.stdout.isatty() else 120)
    outcome: dict[str, tuple[int, float]] = {}
    for name in names:
        (RESULTS_DIR / f"{name}.json").unlink(missing_ok=True)
        wait_for_quiet(console)
        console.rule(f"benchmarks.{name}")
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-u", "-m", f"benchmarks.{name}"])
        outcome[name] = (rc, time.perf_counter() - t0)

    table = Table(title="sparknet benchmarks")
    for col in ("benchmark", "metric", "sparknet", "reference", "ratio", "goal", "wall s"):
        table.add_column(col, justify="left" if col in ("benchmark", "metric") else "right")
    for name in names:
        rc, wall = outcome[name]
        results = read_results(name)
        if rc != 0 or results is None:
            table.add_row(name, f"[red]failed (exit {rc})[/red]", "", "", "", "", f"{wall:.0f}")
            continue
        for i, row in enumerate(results["headline"]):
            table.add_row(
                name if i == 0 else "",
                row["metric"],
                _fmt(row["sparknet"]),
                f"{_fmt(row['reference'])} ({row['reference_name']})",
                f"{row['ratio']:.2f}",
                row["goal"],
                f"{wall:.0f}" if i == 0 else "",
            )
    console.print()
    console.print(table)
    for name in names:
        if (r := read_results(name)) is not None:
            m = r["machine"]
            busy = m.get("busy_before_start")
            steal = m.get("steal_s")
            console.print(
                f"{name}: CPUs busy just before start "
                f"{'?' if busy is None else f'{busy:.0%}'}, stolen by the hypervisor during it "
                f"{'?' if steal is None else f'{steal:.1f} s'}"
            )
    console.print(f"figures in {RESULTS_DIR}")
    return max((rc for rc, _ in outcome.values()), default=0)


if __name__ == "__main__":
    sys.exit(main())
