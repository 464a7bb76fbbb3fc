"""Command line: `sparknet train` (the main job on one machine) and `sparknet-submit`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sparknet.config import load_train_config, read_run_config
from sparknet.errors import SparknetError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """sparknet: synchronized local SGD for PyTorch on Apache Spark."""


def _fail(exc: BaseException, debug: bool, code: int = 2) -> None:
    """One line that says what to fix, exit `code`; the traceback only with --debug."""
    if debug:
        raise exc
    print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
    raise typer.Exit(code)


def _fmt(row: dict[str, Any]) -> str:
    acc = f"  acc {row['eval_accuracy']:.3f}" if "eval_accuracy" in row else ""
    return f"loss {row['loss']:.4f}{acc}  {row['samples_per_s']:.0f} samples/s"


def _summary(result) -> Table:
    rows = result.metrics
    last_eval = next((r for r in reversed(rows) if "eval_accuracy" in r), {})
    table = Table(title="sparknet run", show_header=False)
    table.add_row("rounds", str(result.rounds))
    table.add_row("train loss (last round)", f"{result.final['loss']:.4f}")
    if last_eval:
        table.add_row("test loss", f"{last_eval['eval_loss']:.4f}")
        table.add_row("test accuracy", f"{last_eval['eval_accuracy']:.4f}")
    total = sum(r["seconds"]["total"] for r in rows)
    table.add_row("samples/s (mean)", f"{sum(r['samples'] for r in rows) / total:.0f}")
    table.add_row("wall time", f"{result.final['elapsed_s']:.1f} s")
    table.add_row("run dir", str(result.run_dir))
    return table


@app.command()
def train(
    config: Path | None = typer.Option(None, "--config", help="YAML file with a train: section"),
    set_: list[str] = typer.Option([], "--set", help="key=value, repeatable"),
    model: str | None = typer.Option(None, help="mlp, cnn, a torchvision name, or module:factory"),
    num_classes: int | None = typer.Option(None, help="default: from the dataset"),
    data: str | None = typer.Option(None, help="digits, or module:factory -> (train, test)"),
    workers: int | None = typer.Option(None, help="K: Spark partitions, one worker each"),
    tau: int | None = typer.Option(None, help="local steps per round"),
    rounds: int | None = typer.Option(None),
    batch_size: int | None = typer.Option(None, help="per worker"),
    optimizer: str | None = typer.Option(None, help="inner optimizer: sgd or adamw"),
    lr: float | None = typer.Option(None, help="inner learning rate"),
    momentum: float | None = typer.Option(None, help="inner momentum (sgd)"),
    weight_decay: float | None = typer.Option(None),
    outer: str | None = typer.Option(None, help="average (SparkNet) or nesterov (DiLoCo)"),
    outer_lr: float | None = typer.Option(None, help="nesterov only; default 0.7"),
    outer_momentum: float | None = typer.Option(None, help="nesterov only; default 0.9"),
    inner_state: str | None = typer.Option(None, help="keep or reset the inner optimizer state"),
    seed: int | None = typer.Option(None),
    eval_every: int | None = typer.Option(None, help="rounds; 0: only at the end"),
    checkpoint_every: int | None = typer.Option(None, help="rounds; 0: only at the end"),
    out: Path | None = typer.Option(None, help="run dir; default runs/<model>-<data>-<time>"),
    resume: bool = typer.Option(False, help="continue the run in --out from its last checkpoint"),
    master: str | None = typer.Option(None, help="Spark master; default local[<cores>,4]"),
    transport: str | None = typer.Option(None, help="spark"),
    debug: bool = typer.Option(False, help="show tracebacks"),
) -> None:
    """Train a model with synchronized local SGD on Spark and write a run dir."""
    flags = {k: v for k, v in locals().items() if k not in ("config", "set_", "resume", "debug")}
    try:
        base = None
        if resume:
            if out is None:
                raise SparknetError("--resume needs --out, the run dir to continue")
            base = read_run_config(out)
        cfg = load_train_config(config_file=config, sets=set_, flags=flags, base=base)
        from sparknet.training.driver import train as run_training

        progress = Progress(
            TextColumn("[bold]round"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        bar = progress.add_task("train", start=False, info="starting Spark")

        def on_start(done: int, total: int) -> None:
            progress.update(bar, completed=done, total=total)
            progress.start_task(bar)
            progress.start()

        def on_round(row: dict[str, Any]) -> None:
            progress.update(bar, completed=row["round"], info=_fmt(row))

        try:
            result = run_training(cfg, resume=resume, on_start=on_start, on_round=on_round)
        finally:
            progress.stop()
        console.print(_summary(result))
    except SparknetError as exc:
        _fail(exc, debug)
    except KeyboardInterrupt:
        _fail(
            SparknetError("interrupted; Spark stopped, the last complete checkpoint is kept"),
            debug,
            code=130,
        )


submit_app = typer.Typer(add_completion=False, help="Run a training job on an EC2 GPU cluster.")


@submit_app.command()
def submit(
    s3: str = typer.Option(
        ..., "--s3", help="dataset name from sparknet.yaml or s3://bucket/prefix"
    ),
) -> None:
    """Submit a job to a cluster (needs the cluster support, which this version does not have)."""
    _fail(
        SparknetError(
            "sparknet-submit: cluster support is not in this version yet; "
            "use `sparknet train` to run locally"
        ),
        debug=False,
    )


def main() -> None:
    # `package.module:factory` resolves against the current directory, as with `python -m`
    # (and as Spark's Python workers, started with -m, already do).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    app()


def submit_main() -> None:
    submit_app()
