"""`sparknet predict RUN --data D --out parquet:PATH`: a row per input, scored on Spark."""

from __future__ import annotations

from pathlib import Path

import typer

from sparknet.cli.common import (
    ConfigOption,
    DebugOption,
    EndpointOption,
    console,
    spark_command,
)
from sparknet.config import find_config_file, load_datasets


def predict(
    run: str = typer.Argument(..., help="a finished run dir (local path or s3://bucket/prefix)"),
    data: str = typer.Option(
        ...,
        help="a shard dataset (dir, s3:// or a name from datasets:), digits, "
        "package.module:factory, parquet:PATH or table:NAME",
    ),
    out: str = typer.Option(
        ..., help="parquet:PATH (a dir or s3://bucket/prefix), which must not exist"
    ),
    split: str | None = typer.Option(None, help="the shard dataset's split (default: val)"),
    top_k: int | None = typer.Option(
        None, min=1, help="likeliest classes a row lists (default: 5, or the classes if fewer)"
    ),
    key_col: list[str] | None = typer.Option(
        None,
        help="a DataFrame column to keep with each row (repeat it) (default: all but the input)",
    ),
    input_col: str | None = typer.Option(
        None, help="DataFrame input column (default: image or features, as the model takes)"
    ),
    batch_size: int = typer.Option(64, min=1, help="rows a forward pass takes at once"),
    replace_unfinished: bool = typer.Option(
        False,
        "--replace-unfinished",
        help="delete what a killed write left at an s3:// --out (its parts, no _SUCCESS) and "
        "write anew; anything else there is still refused",
    ),
    write_id: str | None = typer.Option(
        None,
        hidden=True,
        help="names this write's parts; with --replace-unfinished only this id's are deleted "
        "(a submitted job passes its run id, so its restart replaces its own write alone)",
    ),
    workers: int | None = typer.Option(None, min=1, help="Spark cores (default: the run's)"),
    master: str | None = typer.Option(None, help="Spark master (default: local[<cores>,4])"),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Predict with a finished run's model: a Parquet row per input (its key, prediction,
    top-k, probabilities)."""
    with spark_command(debug, f"interrupted; nothing was written at {out}"):
        datasets = load_datasets(find_config_file(config))
        from sparknet.ml.batch_predict import predict as run_predict  # lazy: torch, Spark

        done = run_predict(
            run, data, out, split=split, top_k=top_k, key_cols=key_col or None,
            workers=workers, master=master, endpoint_url=endpoint_url, input_col=input_col,
            batch_size=batch_size, replace_unfinished=replace_unfinished, write_id=write_id,
            datasets=datasets,
            on_status=lambda text: console.print(text),
        )  # fmt: skip
    bad = f" ({done.skipped} unreadable inputs left out)" if done.skipped else ""
    print(f"{done.out}: {done.rows} rows{bad}")
