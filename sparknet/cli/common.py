"""What every command shares: the stderr console, the one-line failure, the common options."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import click
import typer
import typer.rich_utils
from rich.console import Console
from typer.core import TyperOption

from sparknet import interrupts as signals
from sparknet.errors import SparknetError, first_line
from sparknet.interrupts import hold, holding

#: progress and notes go to stderr; results (tables, summaries) to stdout. A line printed is
#: never wrapped by rich (`soft_wrap`): a terminal wraps it as wide as it is, and a log file
#: or a pipe (rich's 80 columns) keeps an error or a path whole on one line. Nor is a line read
#: as markup: `cluster up`/`down`, `ami bake` and `bench` say what remote commands and AWS said
#: (`[sudo] password`, `[i-0abc]`), which rich dropped, or failed on (`[/x]`: MarkupError)
console = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)
results = Console()

ConfigOption = typer.Option(None, "--config", help="settings YAML; default ./sparknet.yaml")
EndpointOption = typer.Option(None, help="S3-compatible endpoint (MinIO, moto)")
DebugOption = typer.Option(False, help="show tracebacks")


def _flags_without_type() -> None:
    """`--help` shows no `<bool>` after a switch (`--keep`, `--spot/--on-demand`, `--help`):
    typer gives every option its type's name, though a switch takes no value."""
    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_type()


def _usage_error_in_one_line() -> None:
    """A flag typer or click refuses (`--workers 2.5`, `--yes=1`, a misspelled option, a
    missing argument) is one `error:` line naming the help to read, exit 2, as every other
    refusal of bad input: typer's own is a usage line, a hint and a box wrapped at 80
    columns, cut in the middle of the message in a log file."""
    boxed = typer.rich_utils.rich_format_error

    def one_line(self: click.ClickException) -> None:
        if self.__class__.__name__ == "NoArgsIsHelpError":  # the help is printed instead
            return boxed(self)
        text = " ".join(ln.strip() for ln in self.format_message().splitlines() if ln.strip())
        ctx = getattr(self, "ctx", None)
        if ctx is not None and ctx.command.get_help_option(ctx) is not None:
            text += f" (`{ctx.command_path} {ctx.help_option_names[0]}`)"
        print(f"error: {text}", file=sys.stderr)

    typer.rich_utils.rich_format_error = one_line


_usage_error_in_one_line()


def fail(exc: BaseException, debug: bool, code: int = 2) -> None:
    """One line that says what to fix, exit `code`; the traceback only with --debug. The line
    is written whole, on a line of its own (`signals.write_line`); under the live bar, rich's
    proxy of stderr prints it above the bar."""
    if debug:
        raise exc
    signals.write_line(sys.stderr, f"error: {first_line(exc)}")
    raise typer.Exit(code)


@dataclass
class Caught:
    """The signal that interrupted a command; None until one arrives."""

    signum: int | None = None


def signal_exit(caught: Caught | None) -> int | None:
    """The exit code of a command a signal stopped, as a shell reports one: 128 + the signal's
    number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP); None when no signal came."""
    signum = caught_signal(caught)
    return 128 + signum if signum else None


def caught_signal(caught: Caught | None) -> int | None:
    """The signal that stopped a command: its own handler's, or one that came before that was
    set up (during the imports: `signals.catch_from_start`), or None."""
    return (caught.signum if caught is not None else None) or signals.received()


@contextlib.contextmanager
def interrupts(caught: Caught, *, stop_at: int = 1, note: str = "") -> Iterator[Caught]:
    """Ctrl-C, SIGTERM and SIGHUP (`kill`, a CI timeout, a closed terminal) unwind alike: the
    `stop_at`-th one raises KeyboardInterrupt, so `finally` blocks stop Spark, remove partial
    files or what `up` made; every other one only prints `note`, so it cannot cut that
    clean-up short. `caught.signum` keeps the first signal, for the exit code (128 + it). A
    signal that came before (`signals.received()`: its KeyboardInterrupt may have been lost in
    the imports) is the first one: at `stop_at` 1 it raises here, before anything starts."""
    count = 0
    if early := signals.received():
        caught.signum = caught.signum or early
        count = 1
        if stop_at == 1:
            raise KeyboardInterrupt

    def interrupt(signum: int, frame: Any) -> None:
        nonlocal count
        count += 1
        signals.note(signum)
        caught.signum = caught.signum or signum
        if count == stop_at:
            if holding():
                hold()  # raised as the section that records a new AWS resource ends
                return
            raise KeyboardInterrupt
        if note:
            console.print(note)

    before = {sig: signal.signal(sig, interrupt) for sig in signals.SIGNALS}
    try:
        yield caught
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def quiet_py4j() -> None:
    """py4j logs every call that an interrupt cuts short with `logging.exception` on the root
    logger (pages of tracebacks under the one `error: interrupted` line): drop its records."""
    logging.getLogger().addFilter(lambda record: "py4j" not in record.pathname)
    py4j = logging.getLogger("py4j")  # its own loggers too ("py4j.clientserver")
    py4j.addHandler(logging.NullHandler())
    py4j.propagate = False


@contextlib.contextmanager
def spark_command(debug: bool, interrupted: str) -> Iterator[None]:
    """The body of a command that runs Spark jobs for a result (`evaluate`, `predict`): a
    signal stops it with the line `interrupted` (exit 128 + the signal), a SparknetError is
    one line, py4j's logging of calls cut short is dropped."""
    caught = Caught()
    try:
        if not debug:
            quiet_py4j()
        with interrupts(caught):
            yield
    except (KeyboardInterrupt, Exception) as exc:
        if isinstance(exc, KeyboardInterrupt) or caught_signal(caught) is not None:
            signum = caught_signal(caught) or signal.SIGINT
            fail(SparknetError(interrupted), debug, 128 + signum)
        if isinstance(exc, SparknetError):
            fail(exc, debug)
        raise


def short_help(command: Callable[..., Any]) -> str:
    """A command's line in its group's list: its docstring up to the first colon or full stop,
    on one line (typer shows the docstring's first paragraph with its line breaks, which cut
    it mid-sentence)."""
    text = " ".join((command.__doc__ or "").split())
    return re.split(r"[:.](?:\s|$)", text, maxsplit=1)[0]
