"""`sparknet export RUN --format F`: a run's model as a file torch alone loads."""

from __future__ import annotations

import typer

from sparknet.cli.common import DebugOption, EndpointOption, fail
from sparknet.errors import SparknetError


def export(
    run: str = typer.Argument(..., help="a finished run dir (local path or s3://bucket/prefix)"),
    format: str = typer.Option(
        "torchscript",
        "--format",
        help="torchscript (torch.jit.load) or torch-export (torch.export.load)",
    ),
    out: str | None = typer.Option(
        None,
        help="the file to write (local or s3://) [default: RUN/model.torchscript.pt, "
        "RUN/model.pt2]",
    ),
    endpoint_url: str | None = EndpointOption,
    debug: bool = DebugOption,
) -> None:
    """Export a finished run's model to a file torch alone loads, model.json inside it."""
    try:
        from sparknet.data.store import open_store  # lazy: boto3
        from sparknet.training.saved_model import (  # lazy: torch
            EXPORT_FORMATS,
            SavedModel,
            exported,
        )

        if format not in EXPORT_FORMATS:
            raise SparknetError(f"--format {format}: use {' or '.join(EXPORT_FORMATS)}")
        target = out or f"{run.rstrip('/')}/{EXPORT_FORMATS[format]}"
        if target.endswith("/"):
            raise SparknetError(f"--out {target}: name a file, not a directory")
        data = exported(SavedModel.read(run, endpoint_url), format)
        parent, _, name = target.rpartition("/")
        open_store(parent or ".", endpoint_url).write_bytes(name, data)
    except SparknetError as exc:
        fail(exc, debug)
    except KeyboardInterrupt:
        fail(SparknetError("interrupted; nothing was written"), debug, 130)
    loads = "torch.jit.load" if format == "torchscript" else "torch.export.load"
    print(f"{target}: {format}, {len(data) / 2**20:.1f} MiB; load it with {loads}")
