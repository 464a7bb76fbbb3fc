"""`sparknet bench sync|scaling|convergence|peers`: the paper's analysis, measured here.

The measurements are taken on this machine, with sparknet against TorchDistributor and plain
PyTorch. Each prints its table, writes `<name>.json`, `<name>.csv` and a plot into `--out`, and
asserts nothing: a goal missed is a line in the report."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from sparknet.cli.bench.options import (
    OutOption,
    at_least,
    distinct_links,
    floats,
    ints,
    names,
    one,
    out_dir,
    run,
    within,
)
from sparknet.cli.common import DebugOption, console
from sparknet.errors import SparknetError

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet bench --help` and every other command import this module


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
    from sparknet.bench import sync as bench  # lazy: torch

    def make():
        return bench.run(
            sizes_mb=floats(sizes_mb, "--sizes-mb"),
            workers=at_least(workers, 2, "--workers"),
            rounds=at_least(rounds, 1, "--rounds"),
            transports=names(transports, "--transports", ("spark", "allreduce")),
            out=out_dir(out),
            on_status=console.print,
        )

    run(make, debug)


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
    from sparknet.bench import scaling as bench  # lazy: +4 ms to `sparknet --help`

    def make():
        return bench.run(
            taus=ints(tau, "--tau"),
            max_workers=at_least(max_workers, 1, "--max-workers"),
            rounds=at_least(rounds, 1, "--rounds"),
            transport=one(transport, "--transport", ("spark", "allreduce")),
            out=out_dir(out),
            on_status=console.print,
        )

    run(make, debug)


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
    from sparknet.bench import convergence as bench  # lazy: numpy

    def make():
        return bench.run(
            datasets=names(data, "--data", bench.DATASETS),
            workers=ints(workers, "--workers"),
            taus=ints(tau, "--tau"),
            outers=names(outer, "--outer", ("average", "nesterov")),
            max_rounds=at_least(max_rounds, 1, "--max-rounds"),
            out=out_dir(out),
            on_status=console.print,
        )

    run(make, debug)


def peers(
    data: str = typer.Option(
        "digits,imagenet-like",
        help="digits, imagenet-like, imagenet-like-wide (a 40 MB MLP that the links bind; give "
        "it --budget-s 150), comma-separated",
    ),
    links: str = typer.Option(
        "unshaped,10gbit:0.5ms,10gbit:10ms,1gbit:0.5ms,1gbit:10ms,100mbit:0.5ms,100mbit:10ms",
        help="emulated links (RATE:DELAY, or unshaped), comma-separated",
    ),
    contenders: str = typer.Option(
        "allreduce,spark,distributor,plain",
        help="allreduce and spark (sparknet's transports), distributor (TorchDistributor on the "
        "cluster), distributor-local (its local_mode), plain (one PyTorch process)",
    ),
    tau: str = typer.Option("1,10,50", help="sparknet's tau values; auto: chosen as it runs"),
    outer: str = typer.Option("average,nesterov", help="sparknet's outer optimizers (allreduce)"),
    variants: str = typer.Option(
        "none",
        help="allreduce's slow-link settings, each crossing every allreduce tau and outer: "
        "none, or +-joined int8, int4, bf16, fp16, overlap, fragN (N >= 2), comma-separated, "
        "e.g. none,int8,int8+overlap+frag4",
    ),
    workers: int = typer.Option(2, help="K: Spark workers, each in its own namespace"),
    threads: int = typer.Option(1, help="torch threads (and Spark cores) per worker"),
    batch_size: int = typer.Option(32, help="samples per step per worker"),
    budget_s: float = typer.Option(30.0, help="seconds of training each contender gets"),
    reps: int = typer.Option(1, help="runs of each contender, in rotated order"),
    seed: int = typer.Option(0, help="the seed every contender starts from"),
    out: Path = OutOption,
    debug: bool = DebugOption,
) -> None:
    """sparknet (both transports, each tau and outer optimizer, allreduce with each variant)
    against TorchDistributor (DDP) and plain PyTorch: samples/s, bytes on the wire per sample,
    seconds to a target accuracy, the accuracy reached in a fixed time and the share of it spent
    waiting on the network, on emulated links (network namespaces and tc)."""
    from sparknet.bench import links as lab  # lazy: +4 ms to `sparknet --help`
    from sparknet.bench import peers as bench  # lazy: numpy

    def make():
        outers = names(outer, "--outer", ("average", "nesterov"))
        kinds = names(contenders, "--contenders", bench.KINDS)
        if not math.isfinite(budget_s) or budget_s <= 0:
            raise SparknetError(f"--budget-s takes a number of seconds > 0, got {budget_s:g}")
        plan = bench.Plan(
            datasets=names(data, "--data", bench.DATASETS),
            links=distinct_links(lab.parse_links(links)),
            contenders=bench.contenders_of(
                kinds, bench.taus_of(tau), outers, bench.variants_of(variants)
            ),
            workers=within(workers, 2, lab.MAX_WORKERS, "--workers"),
            threads=at_least(threads, 1, "--threads"),
            batch_size=at_least(batch_size, 1, "--batch-size"),
            budget_s=budget_s,
            reps=at_least(reps, 1, "--reps"),
            seed=at_least(seed, 0, "--seed"),
            out=out_dir(out),
        )
        return bench.run(plan, on_status=console.print)

    run(make, debug)
