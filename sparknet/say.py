"""The one type of a progress callback: what the engine calls to tell the user a line.

The engine never prints: a step that has news (a node ready, a retry, a job's state) takes a
`Say` and calls it with one line; each front end decides where the line goes (the CLI's stderr
console, a logger, nowhere).
"""

from __future__ import annotations

from collections.abc import Callable

#: tells the user one line of progress (no newline at its end)
Say = Callable[[str], None]


def quiet(_line: str) -> None:
    """The `Say` of a caller that wants no progress lines (the default where one is optional)."""
