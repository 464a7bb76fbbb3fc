"""Sections that a Ctrl-C or SIGTERM must not split.

The CLI turns the first signal into KeyboardInterrupt so `finally` blocks clean up. Between an
AWS Create call's answer and the line that records the new id, that would leave a resource the
clean-up does not know: inside `deferred()` the signal is held and raised as soon as the section
ends. The CLI's handler asks `holding()` and calls `hold()`; nothing else needs to know.

The main thread's short waits on threading's primitives (a future, a queue) run deferred too:
KeyboardInterrupt raised inside the pure-Python part of `Condition.wait` can leave its lock
released, and the `with` around it then fails with "release unlocked lock", a RuntimeError that
hides the interrupt, so the command exits 1 with a traceback instead of 130 after its clean-up.

Every signal counts from the console script's first line (`catch_from_start`), not only once a
command has set up its own handling: one that came during the seconds of imports before it
(torch, pyspark) was Python's default KeyboardInterrupt, which a finalizer or a library's
`except BaseException` can swallow, and the run went on. `received()` keeps the first signal,
whatever became of its KeyboardInterrupt, and `check()` raises it again where the run would go on.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

#: the signals a command stops for: Ctrl-C, `kill` (a CI timeout), a closed terminal
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_depth = 0
_held = False
_first: int | None = None
#: `catch_from_start` ran: this process is a console script, whose signals are its own to keep
_armed = False


def received() -> int | None:
    """The first signal of `SIGNALS` this process got since `catch_from_start`, or None."""
    return _first


def note(signum: int) -> None:
    """Record a signal; the first one is the one the exit code names (128 + it). Only in a
    console script: a process that runs commands in turn (a test run) keeps no signal from
    one to the next."""
    global _first
    if _armed:
        _first = _first or signum


def check() -> None:
    """Raise KeyboardInterrupt when a signal came: its own may have been swallowed (printed as
    "Exception ignored" in a finalizer, or caught by a library), and the run must not go on."""
    if _first is not None:
        raise KeyboardInterrupt


def _interrupt(signum: int, frame: Any) -> None:
    note(signum)
    if holding():
        hold()
        return
    raise KeyboardInterrupt


def catch_from_start() -> None:
    """Every signal of `SIGNALS` from now on is noted and raises KeyboardInterrupt (held inside a
    `deferred()` section); SIGTERM and SIGHUP would otherwise kill the process with no clean-up
    and no line. A command's own handling replaces this while it runs."""
    global _armed
    _armed = True
    for sig in SIGNALS:
        signal.signal(sig, _interrupt)
    sys.unraisablehook = _quiet_when_noted(sys.unraisablehook)


def _quiet_when_noted(hook: Any) -> Any:
    """`hook`, but silent for the KeyboardInterrupt of a noted signal that Python could not
    raise (it came in a finalizer or an import's weakref callback, and Python printed "Exception
    ignored" with a traceback into the job's log): `check()` raises it where the run goes on."""

    def unraisable(info: Any) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt) and _first is not None:
            return
        hook(info)

    return unraisable


def holding() -> bool:
    """A deferred section is running: the signal handler should `hold()` instead of raising."""
    return _depth > 0


def hold() -> None:
    """Note a signal that arrived inside a section; it is raised when the section ends."""
    global _held
    _held = True


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Run the block whole; a signal held meanwhile raises KeyboardInterrupt right after it."""
    global _depth, _held
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _held:
            _held = False
            raise KeyboardInterrupt


#: streams where a `write_line` did not finish its line (its write raised: a closed pipe)
_open_lines: set[int] = set()
_error_shown = False


def write_line(stream: Any, text: str) -> None:
    """`text` as one whole line: text and newline in one write, a signal held until it is out
    (`print` writes them apart, and a KeyboardInterrupt between them left the next line, the
    `error:` one, glued to this one: `4.9 serror: interrupted`). A line an earlier call left
    open is ended first. An `error: ` line is remembered (`error_shown`)."""
    global _error_shown
    key = id(stream)
    with deferred():
        start = "\n" if key in _open_lines else ""
        _open_lines.add(key)
        stream.write(f"{start}{text}\n")
        stream.flush()
        _open_lines.discard(key)
        _error_shown = _error_shown or text.startswith("error: ")


def error_shown() -> bool:
    """Whether this process printed its `error:` line already (the entry point adds none)."""
    return _error_shown
