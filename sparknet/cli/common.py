"""What every command shares: the stderr console, the one-line failure, the common options."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

#: progress and notes go to stderr; results (tables, summaries) to stdout
console = Console(stderr=True)

ConfigOption = typer.Option(None, "--config", help="settings YAML; default ./sparknet.yaml")
EndpointOption = typer.Option(None, help="S3-compatible endpoint (MinIO, moto)")
DebugOption = typer.Option(False, help="show tracebacks")


def fail(exc: BaseException, debug: bool, code: int = 2) -> None:
    """One line that says what to fix, exit `code`; the traceback only with --debug."""
    if debug:
        raise exc
    print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
    raise typer.Exit(code)
