"""What every command shares: the stderr console, the one-line failure, the common options."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import re
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import click
import typer
import typer.rich_utils
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer import _click as typer_click
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from sparknet import interrupts as signals
from sparknet.errors import SparknetError, first_line
from sparknet.interrupts import hold, holding
from sparknet.say import Given, carrying

#: progress and notes go to stderr; results (tables, summaries) to stdout. A line printed is
#: never wrapped by rich (`soft_wrap`): a terminal wraps it as wide as it is, and a log file
#: or a pipe (rich's 80 columns) keeps an error or a path whole on one line. Nor is a line read
#: as markup: `cluster up`/`down`, `ami bake` and `bench` say what remote commands and AWS said
#: (`[sudo] password`, `[i-0abc]`), which rich dropped, or failed on (`[/x]`: MarkupError)
console = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)
results = Console()

ConfigOption = typer.Option(None, "--config", help="settings YAML (default: ./sparknet.yaml)")
#: one wording of `--endpoint-url` for every command (`sparknet train`'s too: `settings.py`)
ENDPOINT_HELP = "endpoint URL of S3 (and EC2) in place of AWS's: MinIO, moto"
EndpointOption = typer.Option(None, help=ENDPOINT_HELP)
DebugOption = typer.Option(False, help="show tracebacks")


def _flags_without_type() -> None:
    """`--help` shows no `<bool>` after a switch (`--keep`, `--spot/--on-demand`, `--help`):
    typer gives every option its type's name, though a switch takes no value."""
    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag and self.metavar is None else _readable(shown(self, ctx))

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]
    argument_type = TyperArgument.display_type_rich
    TyperArgument.display_type_rich = lambda self, ctx: _readable(argument_type(self, ctx))  # type: ignore[method-assign]
    typer.rich_utils.RANGE_STRING = ""  # `[x>=0]` widened every help's type column


def _readable(kind: str | None) -> str | None:
    """A type as `--help` shows it, read by a person: a repeatable option's `<str>...`, not
    `<list[str]>`; a range's `<int>`, not `<int range>` (its bounds are the help's to say)."""
    if kind is None:
        return None
    kind = re.sub(r"^<list\[(\w+)\]>$", r"<\1>...", kind)
    return re.sub(r"^<(\w+) range>$", r"<\1>", kind)


_flags_without_type()


def _switch_defaults_as_words() -> None:
    """A switch's default reads `(default: on)`, or nothing where it is off unless given: not
    typer's `(default: no-debug)`, a flag's name where a value goes."""
    worded = TyperOption._get_default_string

    def default_string(self: Any, **kwargs: Any) -> str:
        if isinstance(self, TyperOption) and self.is_bool_flag:
            return "on" if self.default else ""
        return worded(self, **kwargs)

    TyperOption._get_default_string = default_string  # type: ignore[method-assign]


_switch_defaults_as_words()


def _required_only_without_a_default() -> None:
    """`(required)` in a parameter's help, worded as a default is, and only where no default
    is shown beside it (typer's `[required]` came after `(default: ...)`)."""
    helped = typer.rich_utils._get_parameter_help
    typer.rich_utils.REQUIRED_LONG_STRING = "(required)"

    def parameter_help(*args: Any, **kwargs: Any) -> Any:
        columns = helped(*args, **kwargs)
        texts = [str(r) for r in columns.renderables]
        if any("(default: " in t for t in texts):
            columns.renderables = [r for r in columns.renderables if str(r) != "(required)"]
        return columns

    typer.rich_utils._get_parameter_help = parameter_help


_required_only_without_a_default()


def _usage_error_in_one_line() -> None:
    """A flag typer or click refuses (`--workers 2.5`, `--yes=1`, a misspelled option, a
    missing argument) is one `error:` line naming the help to read, exit 2, as every other
    refusal of bad input: typer's own is a usage line, a hint and a box wrapped at 80
    columns, cut in the middle of the message in a log file. With rich off (`TYPER_USE_RICH=0`)
    typer has click show it (a usage line, `Try ...`, `Error: ...`): one line too."""
    boxed = typer.rich_utils.rich_format_error

    def one_line(self: click.ClickException) -> None:
        if self.__class__.__name__ == "NoArgsIsHelpError":  # the help is printed instead
            return boxed(self)
        print(_error_line(self), file=sys.stderr)

    def shown(self: click.ClickException, file: Any = None) -> None:
        print(_error_line(self), file=sys.stderr if file is None else file)

    typer.rich_utils.rich_format_error = one_line
    # NoArgsIsHelpError has a `show` of its own (the help), which stays
    for cls in (typer_click.exceptions.ClickException, typer_click.exceptions.UsageError):
        cls.show = shown  # type: ignore[method-assign]


def _error_line(exc: click.ClickException) -> str:
    """A refusal of the command line as one `error:` line naming the help to read."""
    text = " ".join(ln.strip() for ln in exc.format_message().splitlines() if ln.strip())
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and ctx.command.get_help_option(ctx) is not None:
        text += f" (`{ctx.command_path} {ctx.help_option_names[0]}`)"
    return f"error: {text}"


_usage_error_in_one_line()


def _defaults_worded_as_help() -> None:
    """A default typer shows reads as the help texts write one: `(default: 2)`, not
    `[default: 2]`."""
    typer.rich_utils.DEFAULT_STRING = "(default: {})"


_defaults_worded_as_help()


def _arguments_named_in_capitals() -> None:
    """An argument reads `SRC DEST` in the usage line, the argument list and its errors, as
    click and every other CLI write them, not typer's `{src} {dest}`."""
    TyperArgument.display_name_raw = property(  # type: ignore[method-assign,assignment]
        lambda self: self.metavar if self.metavar is not None else (self.name or "").upper()
    )
    usage = TyperArgument._usage_display_name

    def usage_display_name(self: TyperArgument) -> str:
        shown = usage(self)
        return shown.replace("{", "").replace("}", "") if self.required else shown

    TyperArgument._usage_display_name = usage_display_name  # type: ignore[method-assign]


_arguments_named_in_capitals()


class _FittedOptions:
    """The console typer prints an options panel with, which lays its table out again before
    it prints: an option's names (`--deterministic`, then `--no-deterministic` under it) and
    type in columns never cut (typer's cut `--checkpoint-every` to `--checkpoint-eve…` at 80
    columns), the help taking what is left and wrapping in it."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def print(self, panel: Panel, *args: Any, **kwargs: Any) -> None:
        table = panel.renderable
        if isinstance(table, Table) and len(table.columns) >= 6:
            panel.renderable = _fitted(table)
        self.console.print(panel, *args, **kwargs)


def _fitted(table: Table) -> Table:
    """`table` (typer's: [required,] long names, short names, the switch's other side and its
    short one, type, help) as [required,] names, type, help."""
    cells = [list(column.cells) for column in table.columns]
    required = cells[:-6]
    names, types, helps = cells[-6:-2], cells[-2], cells[-1]
    fitted = Table(
        highlight=table.highlight, show_header=False, expand=True, box=None, padding=(0, 1),
        pad_edge=False,
    )  # fmt: skip
    if required:
        fitted.add_column(no_wrap=True)
    row_names = [Text(" ").join(n for n in row if str(n)) for row in zip(*names, strict=True)]
    widest = max((len(w) for n in row_names for w in str(n).split()), default=1)
    fitted.add_column(max_width=widest)  # a name a line where they do not fit side by side
    fitted.add_column(no_wrap=True)
    fitted.add_column(ratio=1)
    for k, name in enumerate(row_names):
        for part in getattr(helps[k], "renderables", ()):
            if isinstance(part, Text):
                part.overflow = "fold"  # a word wider than the column (a long default) folds
        fitted.add_row(*(r[k] for r in required), name, types[k], helps[k])
    return fitted


def _options_fitted() -> None:
    printed = typer.rich_utils._print_options_panel

    def print_options_panel(*, console: Console, **kwargs: Any) -> None:
        printed(console=_FittedOptions(console), **kwargs)  # type: ignore[arg-type]

    typer.rich_utils._print_options_panel = print_options_panel


_options_fitted()


#: the options whose values a hint's command line carries where the user gave them: where
#: things are (`say.command_line`)
CARRIED = ("--endpoint-url", "--config", "--region")
#: the programs by name (`sparknet`, `sparknet-submit`), each registered by its app's module
_PROGRAMS: dict[str, typer.Typer] = {}
#: the module that registers each program: a hint may name the other program's commands, which
#: this process has not loaded (`sparknet cluster down` names `sparknet-submit cancel`)
_MODULES = {"sparknet": "sparknet.cli.commands", "sparknet-submit": "sparknet.cli.submit"}
#: the carried flags each other program's commands take (the AWS CLI's: no --config)
_OTHERS = {"aws": frozenset({"--endpoint-url", "--region"})}


def program(name: str, app: typer.Typer) -> None:
    """Register `app` as the program `name`, whose commands a hint's command line names: it
    carries a given flag only to a command of it that takes it."""
    _PROGRAMS[name] = app


@functools.cache
def _root(name: str) -> click.Command:
    if name not in _PROGRAMS:  # lazy: the other program's commands, only for a hint naming one
        importlib.import_module(_MODULES[name])
    return typer.main.get_command(_PROGRAMS[name])


def takes(command: str, option: str) -> bool:
    """Whether `command` (`sparknet cluster down`, `sparknet-submit cancel`, `aws ec2 ...`) has
    `option`: looked up in its program's commands (loaded here if it is the other one); False
    for a program this does not know."""
    name, *words = command.split()
    if name in _OTHERS:
        return option in _OTHERS[name]
    if name not in _MODULES:
        return False
    found: Any = _root(name)
    for word in words:
        found = getattr(found, "commands", {}).get(word)
        if found is None:
            return False
    return any(option in (*p.opts, *p.secondary_opts) for p in found.params)


def given(ctx: click.Context) -> Given:
    """The `CARRIED` flags given to the command `ctx` runs, on its command line, as typed."""
    flags = []
    for param in ctx.command.params:
        option = next((o for o in param.opts if o in CARRIED), None)
        if option is None or param.name is None or ctx.params.get(param.name) is None:
            continue
        source = ctx.get_parameter_source(param.name)  # typer's own click's enum: by name
        if source is not None and source.name == "COMMANDLINE":
            flags.append((option, str(ctx.params[param.name])))
    return Given(tuple(flags), takes)


def command_given(ctx: Any = None) -> str:
    """The command line the running command was given, rebuilt from what was parsed (quoted
    for a shell; an option repeated as given): what runs it again with the same settings."""
    ctx = ctx or typer_click.globals.get_current_context()
    words = [ctx.command_path]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if source is None or source.name != "COMMANDLINE":
            continue
        value = ctx.params[param.name]
        values = value if isinstance(value, list | tuple) else [value]
        if param.param_type_name == "argument":
            words += [shlex.quote(str(v)) for v in values]
        elif getattr(param, "is_flag", False):
            words.append(
                param.opts[0] if value or not param.secondary_opts else param.secondary_opts[0]
            )
        else:
            for v in values:
                words += [param.opts[0], shlex.quote(str(v))]
    return " ".join(words)


def _hints_carry_given_flags() -> None:
    """Every command runs `carrying` the flags it was given, so a hint it prints (`sparknet
    cluster down nb1 --region us-east-1 --endpoint-url URL`) reaches what the command did."""
    for cls in (TyperCommand, TyperGroup):
        invoke = cls.invoke

        def carrying_invoke(self: click.Command, ctx: click.Context, invoke=invoke) -> Any:
            with carrying(given(ctx)):
                return invoke(self, ctx)

        cls.invoke = carrying_invoke  # type: ignore[method-assign]


_hints_carry_given_flags()


def version_shown(value: bool) -> None:
    """`--version`: the installed package's version, then exit."""
    if value:
        from importlib.metadata import version  # lazy: only for --version

        print(f"sparknet {version('sparknet')}")
        raise typer.Exit()


VersionOption = typer.Option(
    False, "--version", callback=version_shown, is_eager=True, help="show the version and exit"
)


def short_helps(app: typer.Typer) -> None:
    """Each command of `app` and its groups, at any depth, listed by `short_help` where it has
    no short help of its own: a line, never the docstring cut mid-sentence."""
    for info in app.registered_commands:
        if not info.short_help and info.callback is not None:
            info.short_help = short_help(info.callback)
    for group in app.registered_groups:
        if group.typer_instance is None:
            continue
        text = group.help or group.typer_instance.info.help  # a placeholder where unset is falsy
        if not group.short_help and isinstance(text, str):
            group.short_help = first_clause(text, ".")  # a group's list names its commands
        short_helps(group.typer_instance)


def titled_table(title: str, **kwargs: Any) -> Table:
    """A rich table at least as wide as its title, which rich would otherwise wrap to the
    table's width (a two-column summary at 80 columns)."""
    return Table(title=title, min_width=len(title) + 4, **kwargs)


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
    """A command's line in its group's list: its docstring up to the first colon or full stop
    that ends a clause (`first_clause`), on one line (typer shows the docstring's first
    paragraph with its line breaks, which cut it mid-sentence)."""
    return first_clause(command.__doc__ or "")


def first_clause(text: str, ends: str = ":.") -> str:
    """`text` on one line up to the first of `ends` that is followed by a space or the end and
    is not inside parentheses or backquotes (`(idempotent: ...)` does not end it)."""
    text = " ".join(text.split())
    depth, quoted = 0, False
    for end in re.finditer(rf"[()`]|[{re.escape(ends)}](?=\s|$)", text):
        mark = end.group()
        if mark == "`":
            quoted = not quoted
        elif not quoted and mark in "()":
            depth += 1 if mark == "(" else -1
        elif not quoted and depth <= 0:
            return text[: end.start()]
    return text.rstrip(ends)


def sized(n: int) -> str:
    """Bytes as a person reads them, to one decimal: B under a KiB, then KiB, MiB, GiB, TiB (a
    small dataset never reads as 0.0 MiB). A value that rounds to 1024 of a unit is shown in the
    next one: 1048575 B is 1.0 MiB, not 1024.0 KiB.

    Example::

        >>> sized(1023), sized(1536), sized(2**20 - 1), sized(5 * 2**40)
        ('1023 B', '1.5 KiB', '1.0 MiB', '5.0 TiB')
    """
    if n < 2**10:
        return f"{n} B"
    value = n / 2**10
    for unit in ("KiB", "MiB", "GiB"):
        if round(value, 1) < 1024:  # as shown: 1023.95 KiB would read 1024.0 KiB
            return f"{value:.1f} {unit}"
        value /= 2**10
    return f"{value:.1f} TiB"
