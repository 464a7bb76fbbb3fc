"""Command line: `sparknet` and `sparknet-submit`, and their console scripts' entry points.

`sparknet` is `commands` (train, data, cluster, ami, bench), `sparknet-submit` is `submit`. The
entry points import nothing slow at module level: a signal must count from their first line
(`interrupts.catch_from_start`), and the commands' imports before it took ~0.3 s (seconds on a
busy machine) in which Ctrl-C was a traceback and SIGTERM a silent death."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from sparknet import interrupts


def main() -> None:
    _run(lambda: _commands().app())


def submit_main() -> None:
    _run(lambda: _submit().submit_app())


def _commands():
    from sparknet.cli import commands  # lazy: typer, rich, every command (~0.3 s): signals first

    return commands


def _submit():
    from sparknet.cli import submit  # lazy: typer, rich (~0.3 s): signals first

    return submit


def _run(app: Callable[[], Any]) -> None:
    """Catch signals, then import and run the app. A signal whose KeyboardInterrupt no command
    turned into its line (it came during the imports or typer's parsing, where typer exits 130
    without a word) ends here: one `error: interrupted` line and 128 + the signal."""
    interrupts.catch_from_start()
    # `package.module:factory` resolves against the current directory, as with `python -m`
    # (and as Spark's Python workers, started with -m, already do).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        app()
    except (KeyboardInterrupt, SystemExit) as exc:
        signum = interrupts.received()
        if signum is None or interrupts.error_shown():
            raise
        if isinstance(exc, SystemExit) and exc.code not in (130, 128 + signum):
            raise
        how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
        interrupts.write_line(sys.stderr, f"error: interrupted{how}")
        raise SystemExit(128 + signum) from None


def __getattr__(name: str) -> Any:
    # `from sparknet.cli import app` (tests, the docs' examples) without the imports at start
    if name == "app":
        return _commands().app
    raise AttributeError(f"module 'sparknet.cli' has no attribute {name!r}")
