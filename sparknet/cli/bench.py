"""`sparknet bench sync|scaling|convergence|peers`: the paper's analysis as measurements on
this machine, and sparknet against TorchDistributor and plain PyTorch. Each prints its table,
writes `<name>.json`, `<name>.csv` and a plot into `--out`, and asserts nothing: a goal missed
is a line in the report."""

from __future__ import annotations

import math
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sparknet.cli.common import (
    Caught,
    DebugOption,
    console,
    fail,
    interrupts,
    quiet_py4j,
    results,
    signal_exit,
)
from sparknet.errors import SparknetError

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

OutOption = typer.Option(Path("bench"), "--out", help="dir for the JSON, CSV and plot")


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise SparknetError(f"{what} takes whole numbers, comma-separated, got {text!r}") from None
    if min(values) < 1:
        raise SparknetError(f"{what} takes numbers >= 1, got {text!r}")
    return _once(values, what)


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise SparknetError(f"{what} takes numbers separated by commas, got {text!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise SparknetError(f"{what} takes numbers > 0, got {text!r}")
    return _once(values, what)


def _once(values: list, what: str) -> list:
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        said = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in twice)
        raise SparknetError(f"{what} lists {said} more than once")
    return values


def _at_least(value: int, low: int, what: str) -> int:
    """A count option checked like the others (typer's own check prints a usage box)."""
    if value < low:
        raise SparknetError(f"{what} takes a whole number >= {low}, got {value}")
    return value


def _within(value: int, low: int, high: int, what: str) -> int:
    if not low <= value <= high:
        raise SparknetError(f"{what} takes a whole number from {low} to {high}, got {value}")
    return value


def _out_dir(out: Path) -> Path:
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


def _names(text: str, what: str, allowed: tuple[str, ...]) -> list[str]:
    values = [v.strip() for v in text.split(",")]
    if [v for v in values if v not in allowed]:
        raise SparknetError(f"{what} takes any of {', '.join(allowed)}, got {text!r}") from None
    return _once(values, what)


def _links(links: list) -> list:
    names = [link.name for link in links]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SparknetError(f"--links lists {', '.join(twice)} more than once")
    return links


def _one(text: str, what: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise SparknetError(f"{what} takes one of {', '.join(allowed)}, got {text!r}")
    return text


def _show(report) -> None:
    table = Table(title=report.title)
    for col in report.columns:
        table.add_column(col, justify="left" if col == report.columns[0] else "right")
    for row in report.rows:
        table.add_row(*(_cell(row.get(c)) for c in report.columns))
    # a log file or a pipe gets rich's 80 columns: too narrow for these tables
    out = results if results.is_terminal else Console(width=160)
    out.print(table)
    for line in [*report.notes, *(f"wrote {path}" for path in report.files)]:
        out.print(line, markup=False, highlight=False, soft_wrap=True)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _run(make, debug: bool) -> None:
    """Run one benchmark: Ctrl-C stops it (its Spark with it) and exits 130, bad options exit 2
    with one line."""
    caught = Caught()
    if not debug:
        quiet_py4j()
    try:
        with interrupts(caught):
            report = make()
        _show(report)
    except (KeyboardInterrupt, Exception) as exc:
        # an interrupt can cut a JVM call short so that it surfaces as a py4j error from the
        # clean-up that follows: once a signal came, it is the cause
        if isinstance(exc, KeyboardInterrupt) or caught.signum is not None:
            code = signal_exit(caught) or 130
            fail(SparknetError("interrupted; Spark stopped, nothing more measured"), debug, code)
        if isinstance(exc, SparknetError):
            fail(exc, debug)
        raise


@bench_app.command("sync")
def sync(
    sizes_mb: str = typer.Option("1,10,100", help="model sizes in MB, comma-separated"),
    workers: int = typer.Option(2, help="K: workers synchronizing (>= 2)"),
    rounds: int = typer.Option(5, help="rounds timed per size and transport"),
    transports: str = typer.Option("spark,allreduce", help="spark, allreduce or both"),
    out: Path = OutOption,
    debug: bool = DebugOption,
) -> None:
    """Seconds per synchronization round of each transport, against a raw gloo all_reduce of
    the same bytes between two plain processes, measured in the same run."""
    from sparknet.bench import sync as bench

    def make():
        return bench.run(
            sizes_mb=_floats(sizes_mb, "--sizes-mb"),
            workers=_at_least(workers, 2, "--workers"),
            rounds=_at_least(rounds, 1, "--rounds"),
            transports=_names(transports, "--transports", ("spark", "allreduce")),
            out=_out_dir(out),
            on_status=console.print,
        )

    _run(make, debug)


@bench_app.command("scaling")
def scaling(
    tau: str = typer.Option("1,5,20,50", help="tau values to predict for, comma-separated"),
    max_workers: int = typer.Option(32, help="predict for K = 1 .. this"),
    rounds: int = typer.Option(10, help="rounds of each measured run"),
    transport: str = typer.Option(
        "allreduce", help="the transport whose S is measured: spark or allreduce"
    ),
    out: Path = OutOption,
    debug: bool = DebugOption,
) -> None:
    """Measure compute per step (C) and sync per round (S) here, predict wall time with the
    paper's model for K workers and tau, and check the prediction against measured runs."""
    from sparknet.bench import scaling as bench

    def make():
        return bench.run(
            taus=_ints(tau, "--tau"),
            max_workers=_at_least(max_workers, 1, "--max-workers"),
            rounds=_at_least(rounds, 1, "--rounds"),
            transport=_one(transport, "--transport", ("spark", "allreduce")),
            out=_out_dir(out),
            on_status=console.print,
        )

    _run(make, debug)


@bench_app.command("convergence")
def convergence(
    data: str = typer.Option("digits,imagenet-like", help="digits, imagenet-like, or both"),
    workers: str = typer.Option("1,2,4,8", help="K values (simulated workers on local Spark)"),
    tau: str = typer.Option("1,5,20,50", help="tau values"),
    outer: str = typer.Option("average,nesterov", help="outer optimizers to compare"),
    max_rounds: int = typer.Option(60, help="give up on a setting after this many"),
    out: Path = OutOption,
    debug: bool = DebugOption,
) -> None:
    """Rounds and samples to reach a target test accuracy, over K, tau and the outer
    optimizer (`average`: SparkNet; `nesterov`: DiLoCo)."""
    from sparknet.bench import convergence as bench

    def make():
        return bench.run(
            datasets=_names(data, "--data", bench.DATASETS),
            workers=_ints(workers, "--workers"),
            taus=_ints(tau, "--tau"),
            outers=_names(outer, "--outer", ("average", "nesterov")),
            max_rounds=_at_least(max_rounds, 1, "--max-rounds"),
            out=_out_dir(out),
            on_status=console.print,
        )

    _run(make, debug)


@bench_app.command("peers")
def peers(
    data: str = typer.Option("digits,imagenet-like", help="digits, imagenet-like, or both"),
    links: str = typer.Option(
        "unshaped,10gbit:0.5ms,10gbit:10ms,1gbit:0.5ms,1gbit:10ms,100mbit:0.5ms,100mbit:10ms",
        help="emulated links (RATE:DELAY, or unshaped), comma-separated",
    ),
    contenders: str = typer.Option(
        "allreduce,spark,distributor,plain",
        help="allreduce and spark (sparknet's transports), distributor (TorchDistributor on the "
        "cluster), distributor-local (its local_mode), plain (one PyTorch process)",
    ),
    tau: str = typer.Option("1,10,50", help="sparknet's tau values"),
    outer: str = typer.Option("average,nesterov", help="sparknet's outer optimizers (allreduce)"),
    workers: int = typer.Option(2, help="K: Spark workers, each in its own namespace"),
    threads: int = typer.Option(1, help="torch threads (and Spark cores) per worker"),
    batch_size: int = typer.Option(32, help="samples per step per worker"),
    budget_s: float = typer.Option(30.0, help="seconds of training each contender gets"),
    reps: int = typer.Option(1, help="runs of each contender, in rotated order"),
    seed: int = typer.Option(0, help="the seed every contender starts from"),
    out: Path = OutOption,
    debug: bool = DebugOption,
) -> None:
    """sparknet (both transports, each tau and outer optimizer) against TorchDistributor (DDP)
    and plain PyTorch: samples/s, bytes on the wire per sample, seconds to a target accuracy
    and the accuracy reached in a fixed time, on emulated links (network namespaces and tc)."""
    from sparknet.bench import links as lab
    from sparknet.bench import peers as bench

    def make():
        outers = _names(outer, "--outer", ("average", "nesterov"))
        kinds = _names(contenders, "--contenders", bench.KINDS)
        if not math.isfinite(budget_s) or budget_s <= 0:
            raise SparknetError(f"--budget-s takes a number of seconds > 0, got {budget_s:g}")
        plan = bench.Plan(
            datasets=_names(data, "--data", bench.DATASETS),
            links=_links(lab.parse_links(links)),
            contenders=bench.contenders_of(kinds, _ints(tau, "--tau"), outers),
            workers=_within(workers, 2, lab.MAX_WORKERS, "--workers"),
            threads=_at_least(threads, 1, "--threads"),
            batch_size=_at_least(batch_size, 1, "--batch-size"),
            budget_s=budget_s,
            reps=_at_least(reps, 1, "--reps"),
            seed=_at_least(seed, 0, "--seed"),
            out=_out_dir(out),
        )
        return bench.run(plan, on_status=console.print)

    _run(make, debug)
