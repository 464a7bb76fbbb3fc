"""`sparknet evaluate RUN --data D`: a finished run's model over a whole split, on Spark."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from sparknet.cli.common import (
    ConfigOption,
    DebugOption,
    EndpointOption,
    console,
    results,
    spark_command,
    titled_table,
)
from sparknet.config import find_config_file, load_datasets

#: the weakest classes the summary lists (all of them are in evaluation.json)
WEAKEST = 5


def evaluate(
    run: str = typer.Argument(..., help="a finished run dir (local path or s3://bucket/prefix)"),
    data: str = typer.Option(
        ...,
        help="a shard dataset (dir, s3:// or a name from datasets:), digits, "
        "package.module:factory, parquet:PATH or table:NAME",
    ),
    split: str | None = typer.Option(None, help="the shard dataset's split to read (default: val)"),
    workers: int | None = typer.Option(
        None, min=1, help="Spark partitions (default: the run's; its own final evaluation's)"
    ),
    master: str | None = typer.Option(None, help="Spark master (default: local[<cores>,4])"),
    device: str | None = typer.Option(None, help="auto, cpu or cuda (default: the run's)"),
    label_col: str | None = typer.Option(None, help="DataFrame label column (default: the run's)"),
    input_col: str | None = typer.Option(None, help="DataFrame input column (default: the run's)"),
    report: str | None = typer.Option(
        None,
        help="where evaluation.json and confusion.png go (local or s3://) "
        "(default: RUN/evaluations/<data>)",
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Evaluate a finished run's model on a dataset: loss, top-1, top-5, per-class accuracy."""
    interrupted = "interrupted (a report is whole once its evaluation.json is written: last)"
    with spark_command(debug, interrupted):
        datasets = load_datasets(find_config_file(config))
        from sparknet.data.store import writable_store  # lazy: boto3
        from sparknet.training.evaluation import evaluate as run_evaluation  # lazy: torch, Spark
        from sparknet.training.evaluation import write_report  # lazy: torch, Spark

        # where the report goes must take it before the evaluation runs, not after
        where = report or f"{run.rstrip('/')}/evaluations/{_report_name(data, split)}"
        store = writable_store(where, endpoint_url)
        ev = run_evaluation(
            run, data, split=split, workers=workers, master=master, endpoint_url=endpoint_url,
            label_col=label_col, input_col=input_col, device=device, datasets=datasets,
            on_status=lambda text: console.print(text),
        )  # fmt: skip
        written = write_report(ev, store)
    results.print(summary(ev, where, written))


def _report_name(data: str, split: str | None) -> str:
    from sparknet.training.driver import slug  # lazy: torch

    return slug(data.rstrip("/")) + (f"-{split}" if split else "")


def summary(ev, where: str, written: list[str]) -> Table:
    """The table an evaluation ends with (`sparknet-submit evaluate`'s too)."""
    table = titled_table("sparknet evaluate", show_header=False)
    table.add_column()
    table.add_column(overflow="fold")
    table.add_row("data", ev.data + (f" ({ev.split})" if ev.split else ""))
    table.add_row("samples", str(ev.samples))
    if ev.skipped:
        table.add_row("skipped bad samples", str(ev.skipped))
    table.add_row("loss", f"{ev.loss:.4f}")
    table.add_row("top-1", f"{ev.top1:.4f}")
    if len(ev.confusion) > 5:  # top-5 of 5 classes or fewer is 1
        table.add_row("top-5", f"{ev.top5:.4f}")
    scored = [c for c in ev.per_class() if c.samples]
    for c in sorted(scored, key=lambda c: (c.accuracy, c.index))[:WEAKEST]:
        name = f"{c.index}" + (f" {c.wnid}" if c.wnid else "")
        table.add_row(f"class {name}", f"{c.accuracy:.4f} of {c.samples}")
    table.add_row("report", ", ".join(f"{where.rstrip('/')}/{name}" for name in written))
    return table
