"""The one command line that runs a function of this package on a node, as the submitter sends."""

from __future__ import annotations

import shlex

#: the module a node's Python runs (`python -m sparknet.node ...`)
MODULE = "sparknet.node"


def node_argv(python: str, *args: str) -> list[str]:
    """`python -m sparknet.node ARGS` as words: what a systemd unit or a pid-file start runs."""
    return [python, "-m", MODULE, *args]


def node_command(python: str, *args: object, unless_absent: bool = False) -> str:
    """`python -m sparknet.node ARGS`, quoted for the node's shell: one short line over SSH.
    With `unless_absent`, a node whose Python lacks this package succeeds doing nothing: what
    the command would find or end was never started there by it (a host whose bootstrap ended
    before its venv, or whose venv has a sparknet from before this package). A shell `if`, so
    what follows it on the same line still runs."""
    line = " ".join(shlex.quote(str(word)) for word in node_argv(python, *map(str, args)))
    if not unless_absent:
        return line
    return f"if {shlex.quote(python)} -c 'import {MODULE}' 2>/dev/null; then {line}; fi"
