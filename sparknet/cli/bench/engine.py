"""The engine's own figures, each against the reference it stands in for.

`sparknet bench throughput|sync-cost|data-stream|images-per-core|shard-workers|precision|
startup|all`. Each prints its figures and writes `<name>.json` (with its headline rows) into
`--out`; `all` runs them one process each, then prints one table of the headlines. None asserts:
a goal missed shows in the figures, it does not fail."""

from __future__ import annotations

from pathlib import Path

import typer

from sparknet.bench import startup as startup_bench
from sparknet.bench import suite
from sparknet.cli.bench.options import JsonOutOption, at_least, out_dir, positive, run
from sparknet.cli.common import DebugOption
from sparknet.errors import SparknetError

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet bench --help` and every other command import this module


def throughput(
    rounds: int = typer.Option(8, help="round 1 is not measured"),
    tau: int = typer.Option(50, help="steps per round"),
    batch_size: int = typer.Option(64, help="samples per step"),
    model: str = typer.Option("cnn", help="the model both sides train"),
    out: Path = JsonOutOption,
    debug: bool = DebugOption,
) -> None:
    """Training throughput through sparknet (K=1) against the plain PyTorch loop it wraps, on
    the same model, data and threads: the framework's cost per round."""
    from sparknet.bench import throughput as bench  # lazy: torch, pyspark, boto3

    def make():
        return bench.run(
            rounds=rounds,
            tau=at_least(tau, 1, "--tau"),
            batch_size=at_least(batch_size, 1, "--batch-size"),
            model=model,
            out=out_dir(out),
        )

    run(make, debug, show=False)


def sync_cost(
    floats: int = typer.Option(25_000_000, help="model size in float32"),
    warmup: int = typer.Option(2, help="unmeasured rounds first"),
    reps: int = typer.Option(7, help="measured rounds"),
    breakdown_reps: int = typer.Option(5, help="repetitions of each part of the breakdown"),
    no_breakdown: bool = typer.Option(False, "--no-breakdown", help="skip the breakdown"),
    out: Path = JsonOutOption,
    debug: bool = DebugOption,
) -> None:
    """One synchronization round of the spark transport on a ~100 MB model with no compute,
    against a gloo all_reduce of the same bytes; the naive collect, treeReduce and the round's
    parts beside it."""
    from sparknet.bench import sync_cost as bench  # lazy: torch, pyspark, boto3

    def make():
        return bench.run(
            floats=at_least(floats, 1, "--floats"),
            warmup=at_least(warmup, 0, "--warmup"),
            reps=at_least(reps, 1, "--reps"),
            breakdown_reps=at_least(breakdown_reps, 1, "--breakdown-reps"),
            no_breakdown=no_breakdown,
            out=out_dir(out),
        )

    run(make, debug, show=False)


def data_stream(
    images: int = typer.Option(400, help="ImageNet-like JPEGs, a multiple of --batch-size"),
    batch_size: int = typer.Option(40, help="images per round"),
    shard_mb: float = typer.Option(12.0, help="shard size in MiB"),
    reps: int = typer.Option(3, help="passes measured, after one warm-up"),
    out: Path = JsonOutOption,
    debug: bool = DebugOption,
) -> None:
    """Images per second on one core streaming WebDataset shards from S3 (moto) through the
    task code, against decoding and augmenting the same JPEGs from memory."""
    from sparknet.bench import data_stream as bench  # lazy: torch, PIL

    def make():
        return bench.run(
            images=at_least(images, 1, "--images"),
            batch_size=at_least(batch_size, 1, "--batch-size"),
            shard_mb=positive(shard_mb, "--shard-mb"),
            reps=reps,
            out=out_dir(out),
        )

    run(make, debug, show=False)


def images_per_core(
    images: int = typer.Option(400, help="ImageNet-like JPEGs, a multiple of --batch-size"),
    batch_size: int = typer.Option(40, help="images per batch"),
    reps: int = typer.Option(3, help="passes measured, after one warm-up"),
    accuracy: bool = typer.Option(
        True, "--accuracy/--no-accuracy", help="also train on full-size and --max-side shards"
    ),
    per_class: int = typer.Option(150, help="train photos per class"),
    tau: int = typer.Option(10, help="tau of the accuracy trainings"),
    rounds: int = typer.Option(15, help="rounds of the accuracy trainings"),
    seeds: int = typer.Option(3, help="trainings per dataset"),
    out: Path = JsonOutOption,
    debug: bool = DebugOption,
) -> None:
    """Images per second per core at 224 px, sparknet's shard stream against torchvision's
    recipe, with full-size and `--max-side 256` shards, and what the smaller images cost in
    accuracy."""
    from sparknet.bench import images_per_core as bench  # lazy: torch, PIL

    def make():
        return bench.run(
            images=at_least(images, 1, "--images"),
            batch_size=at_least(batch_size, 1, "--batch-size"),
            reps=at_least(reps, 1, "--reps"),
            accuracy=accuracy,
            per_class=at_least(per_class, 3, "--per-class"),
            tau=at_least(tau, 1, "--tau"),
            rounds=at_least(rounds, 1, "--rounds"),
            seeds=at_least(seeds, 1, "--seeds"),
            out=out_dir(out),
        )

    run(make, debug, show=False)


def shard_workers(
    small: int = typer.Option(600, help="photos in the smaller tree"),
    big: int = typer.Option(2400, help="photos in the bigger tree"),
    reps: int = typer.Option(3, help="runs of each mode per tree"),
    out: Path = JsonOutOption,
    debug: bool = DebugOption,
) -> None:
    """`data shard` on threads against processes and serially: the figures behind its default
    (PROCESS_MIN_IMAGES)."""
    from sparknet.bench import shard_workers as bench  # lazy: PIL

    def make():
        return bench.run(
            small=at_least(small, 1, "--small"),
            big=at_least(big, small + 1, "--big"),
            reps=at_least(reps, 1, "--reps"),
            out=out_dir(out),
        )

    run(make, debug, show=False)


def precision(
    repeats: int = typer.Option(5, help="calls per precision, measured"),
    tau: int = typer.Option(20, help="steps per call"),
    batch_size: int = typer.Option(64, help="samples per step"),
    model: str = typer.Option("cnn", help="the model trained"),
    out: Path = JsonOutOption,
    debug: bool = DebugOption,
) -> None:
    """What bf16 (and fp16) autocast costs or gains against fp32 on this machine's CPU, through
    the worker's own training code."""
    from sparknet.bench import precision as bench  # lazy: torch, boto3

    def make():
        return bench.run(
            repeats=at_least(repeats, 1, "--repeats"),
            tau=at_least(tau, 1, "--tau"),
            batch_size=at_least(batch_size, 1, "--batch-size"),
            model=model,
            out=out_dir(out),
        )

    run(make, debug, show=False)


def startup(
    rounds: int = typer.Option(5, help="rounds of each `sparknet train` run (>= 2)"),
    repeats: int = typer.Option(2, help="runs of each variant"),
    out: Path = JsonOutOption,
    debug: bool = DebugOption,
) -> None:
    """Where a run's first round goes (driver, Spark, Python workers, round 1) and round 1
    against the steady state, with and without the torch-importing worker daemon."""

    def make():
        return startup_bench.run(
            rounds=at_least(rounds, 2, "--rounds"),
            repeats=at_least(repeats, 1, "--repeats"),
            out=out_dir(out),
        )

    run(make, debug, show=False)


def all_(
    names: list[str] | None = typer.Argument(
        None,
        metavar="NAME",
        help="any of throughput, sync-cost, data-stream, images-per-core, shard-workers, "
        "precision, startup (default: all of them)",
        show_default=False,
    ),
    out: Path = JsonOutOption,
    debug: bool = DebugOption,
) -> None:
    """Every engine benchmark above (or those named), each in its own process with its
    defaults, then one table of their headline figures."""

    def make():
        commands = [suite.command_of(n) for n in names or suite.BENCHMARKS]
        if unknown := [n for n, c in zip(names or [], commands, strict=False) if c is None]:
            raise SparknetError(
                f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(suite.BENCHMARKS)}"
            )
        return suite.run_all([c for c in commands if c is not None], out_dir(out))

    codes: list[int] = []
    run(lambda: codes.append(make()), debug, show=False)
    if codes and codes[0]:
        raise typer.Exit(codes[0])
