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
        help="the file to write, local or s3:// (default: RUN/model.torchscript.pt, RUN/model.pt2)",
    ),
    force: bool = typer.Option(False, "--force", help="replace a file that is there"),
    endpoint_url: str | None = EndpointOption,
    debug: bool = DebugOption,
) -> None:
    """Export a finished run's model to a file torch alone loads, model.json inside it."""
    try:
        from sparknet.training.saved_model import (  # lazy: torch
            EXPORT_FORMATS,
            SavedModel,
            exported,
        )

        if format not in EXPORT_FORMATS:
            raise SparknetError(f"--format {format}: use {' or '.join(EXPORT_FORMATS)}")
        target = f"{run.rstrip('/')}/{EXPORT_FORMATS[format]}" if out is None else out
        store, name = _file(target, endpoint_url)
        if store.size(name) is not None and not force:
            raise SparknetError(f"{target} exists: pass --force to replace it, or another --out")
        data = exported(SavedModel.read(run, endpoint_url), format)
        store.write_bytes(name, data)
    except SparknetError as exc:
        fail(exc, debug)
    except OSError as exc:  # a local --out the file system refuses: a dir, a path under a file
        fail(SparknetError(f"cannot write {target}: {exc.strerror or exc}"), debug)
    except KeyboardInterrupt:
        fail(SparknetError("interrupted; nothing was written"), debug, 130)
    loads = "torch.jit.load" if format == "torchscript" else "torch.export.load"
    print(f"{target}: {format}, {len(data) / 2**20:.1f} MiB; load it with {loads}")


def _file(target: str, endpoint_url: str | None):
    """The store of `target`'s dir and the file's name in it; one line for a target that names
    no file (empty, a dir, a bucket alone), or a run's own file."""
    from sparknet.data.store import open_store  # lazy: boto3
    from sparknet.training.rundir import (  # lazy: torch
        EXPORTED_PROGRAM,
        EXPORTED_TORCHSCRIPT,
        RUN_ENTRIES,
    )

    root = target.removeprefix("s3://")
    parent, _, name = root.rpartition("/")
    if not name or (target.startswith("s3://") and not parent):
        raise SparknetError(f"--out {target!r}: name a file (a path, or s3://bucket/key)")
    if name in RUN_ENTRIES - {EXPORTED_PROGRAM, EXPORTED_TORCHSCRIPT}:
        raise SparknetError(f"--out {target}: {name} is a run's own file; name another")
    if target.startswith("s3://"):
        return open_store(f"s3://{parent}", endpoint_url), name
    return open_store(parent or ".", endpoint_url), name
