"""The one type of a progress callback, and the command lines a line tells the user to run next.

The engine never prints: a step that has news (a node ready, a retry, a job's state) takes a
`Say` and calls it with one line; each front end decides where the line goes (the CLI's stderr
console, a logger, nowhere). A line that names a command to run next (`sparknet cluster down
nb1 --region us-east-1`) builds it with `command_line`, which adds the flags the user gave the
command being run that say where things are (`--endpoint-url`, `--config`): the hint, followed,
reaches the same endpoint and settings.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

#: tells the user one line of progress (no newline at its end)
Say = Callable[[str], None]


def quiet(_line: str) -> None:
    """The `Say` of a caller that wants no progress lines (the default where one is optional)."""


@dataclass(frozen=True)
class Given:
    """The flags the user gave the command being run that a hinted command line carries.

    `flags` are (option, value) pairs as typed (`("--endpoint-url", "http://127.0.0.1:5000")`);
    `takes(command, option)` says whether a command (`sparknet cluster down`) has that option,
    so a hint never names one its command would refuse."""

    flags: tuple[tuple[str, str], ...] = ()
    takes: Callable[[str, str], bool] = lambda command, option: True


_GIVEN: ContextVar[Given | None] = ContextVar("sparknet_given_flags", default=None)


@contextmanager
def carrying(given: Given) -> Iterator[None]:
    """Within the block, `command_line` adds `given`'s flags (a front end sets them around the
    command it runs)."""
    token = _GIVEN.set(given)
    try:
        yield
    finally:
        _GIVEN.reset(token)


def command_line(command: str, *args: object, **options: object) -> str:
    """`command args --option value ...`: a command line to run next, quoted for a shell. Its
    own `options` (`region="us-east-1"` is `--region us-east-1`; True a bare switch; None or
    False left out) come first, then each flag the user gave the command being run (`carrying`)
    that `command` takes and `options` does not set."""
    words = [command, *(shlex.quote(str(a)) for a in args)]
    named = set()
    for name, value in options.items():
        option = "--" + name.replace("_", "-")
        named.add(option)
        if value is None or value is False:
            continue
        words.append(option if value is True else f"{option} {shlex.quote(str(value))}")
    given = _GIVEN.get() or Given()
    for option, value in given.flags:
        if option not in named and given.takes(command, option):
            words.append(f"{option} {shlex.quote(value)}")
    return " ".join(words)
