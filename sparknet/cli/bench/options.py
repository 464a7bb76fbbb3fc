"""What every `sparknet bench` subcommand shares.

`--out`, the checks of its options (one `error:` line, exit 2) and the run itself (Ctrl-C stops
it, its Spark with it, and exits 130)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from sparknet.bench.common import DEFAULT_OUT, show_report
from sparknet.cli.common import Caught, fail, interrupts, quiet_py4j, results, signal_exit
from sparknet.errors import SparknetError

OutOption = typer.Option(DEFAULT_OUT, "--out", help="dir for the JSON, CSV and plot")
JsonOutOption = typer.Option(DEFAULT_OUT, "--out", help="dir for the JSON of its figures")


def ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise SparknetError(f"{what} takes whole numbers, comma-separated, got {text!r}") from None
    if min(values) < 1:
        raise SparknetError(f"{what} takes numbers >= 1, got {text!r}")
    return once(values, what)


def floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise SparknetError(f"{what} takes numbers separated by commas, got {text!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise SparknetError(f"{what} takes numbers > 0, got {text!r}")
    return once(values, what)


def once(values: list, what: str) -> list:
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        said = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in twice)
        raise SparknetError(f"{what} lists {said} more than once")
    return values


def at_least(value: int, low: int, what: str) -> int:
    """A count option checked like the others (typer's own check prints a usage box)."""
    if value < low:
        raise SparknetError(f"{what} takes a whole number >= {low}, got {value}")
    return value


def within(value: int, low: int, high: int, what: str) -> int:
    if not low <= value <= high:
        raise SparknetError(f"{what} takes a whole number from {low} to {high}, got {value}")
    return value


def positive(value: float, what: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise SparknetError(f"{what} takes a number > 0, got {value:g}")
    return value


def out_dir(out: Path) -> Path:
    """The output dir, made now: a path that cannot be one fails before anything is measured."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".sparknet-bench-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise SparknetError(
            f"--out {out}: cannot write there ({reason}); pass a writable dir"
        ) from None
    return out


def names(text: str, what: str, allowed: tuple[str, ...]) -> list[str]:
    values = [v.strip() for v in text.split(",")]
    if [v for v in values if v not in allowed]:
        raise SparknetError(f"{what} takes any of {', '.join(allowed)}, got {text!r}") from None
    return once(values, what)


def distinct_links(found: list) -> list:
    said = [link.name for link in found]
    twice = sorted({n for n in said if said.count(n) > 1})
    if twice:
        raise SparknetError(f"--links lists {', '.join(twice)} more than once")
    return found


def one(text: str, what: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise SparknetError(f"{what} takes one of {', '.join(allowed)}, got {text!r}")
    return text


def run(make: Callable[[], Any], debug: bool, *, show: bool = True) -> None:
    """Run one benchmark: Ctrl-C stops it (its Spark with it) and exits 130, bad options exit 2
    with one line. With `show`, `make` returns a BenchReport whose table is printed; without,
    the benchmark prints its own figures."""
    caught = Caught()
    if not debug:
        quiet_py4j()
    try:
        with interrupts(caught):
            report = make()
        if show:
            # a log file or a pipe gets rich's 80 columns: too narrow for these tables
            show_report(report, results if results.is_terminal else Console(width=160))
    except (KeyboardInterrupt, Exception) as exc:
        # an interrupt can cut a JVM call short so that it surfaces as a py4j error from the
        # clean-up that follows: once a signal came, it is the cause
        if isinstance(exc, KeyboardInterrupt) or caught.signum is not None:
            code = signal_exit(caught) or 130
            fail(SparknetError("interrupted; Spark stopped, nothing more measured"), debug, code)
        if isinstance(exc, SparknetError):
            fail(exc, debug)
        raise
