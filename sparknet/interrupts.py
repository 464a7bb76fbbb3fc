"""Sections that a Ctrl-C or SIGTERM must not split.

The CLI turns the first signal into KeyboardInterrupt so `finally` blocks clean up. Between an
AWS Create call's answer and the line that records the new id, that would leave a resource the
clean-up does not know: inside `deferred()` the signal is held and raised as soon as the section
ends. The CLI's handler asks `holding()` and calls `hold()`; nothing else needs to know.

The main thread's short waits on threading's primitives (a future, a queue) run deferred too:
KeyboardInterrupt raised inside the pure-Python part of `Condition.wait` can leave its lock
released, and the `with` around it then fails with "release unlocked lock", a RuntimeError that
hides the interrupt, so the command exits 1 with a traceback instead of 130 after its clean-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_depth = 0
_held = False


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
