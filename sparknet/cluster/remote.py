"""Commands on a node over its SSH connection.

Run one (its output, or `CommandFailed` with the last lines of its output), test one, quote words
for its shell, and stream a file to it (never through a command line: the secret travels this
way)."""

from __future__ import annotations

import io
import shlex
import socket
import subprocess
from typing import Any, Protocol

import paramiko
from invoke.exceptions import CommandTimedOut

from sparknet.cluster.nodes import went_silent
from sparknet.errors import SparknetError
from sparknet.node.files import script

#: how many of a failed command's last output lines an error carries
TAIL_LINES = 10


class Conn(Protocol):
    """What the steps use of a Fabric Connection (an `invoke.Context` will do for `run`)."""

    def run(self, command: str, **kwargs: Any) -> Any: ...


# --- commands ----------------------------------------------------------------------------------


class CommandFailed(SparknetError):
    """A command on a node exited non-zero (or ran past its timeout); `tail` holds the last lines
    of its output."""

    def __init__(self, what: str, tail: list[str]) -> None:
        super().__init__(what)
        self.what = what
        self.tail = tail


class ConnectionLost(CommandFailed):
    """The SSH connection to the node failed (dropped, refused, reset): the command may not
    have run at all. Raised in place of paramiko's and the socket's own errors, so a caller
    sees one SparknetError and can tell a lost link from a command that failed."""

    def __init__(self, exc: BaseException | str) -> None:
        why = exc if isinstance(exc, str) else _describe(exc)
        super().__init__(f"SSH connection lost ({why})", [])


def _silent(conn: Conn) -> ConnectionLost | None:
    """ConnectionLost naming the silence, when the keepalive closed the connection under the
    call (the node stopped answering: see `nodes._Keepalive`); else None."""
    seconds = went_silent(conn)
    if seconds is None:
        return None
    return ConnectionLost(f"the node answered nothing for {seconds:g} s")


#: what paramiko and the socket raise when the link to a node breaks or cannot be made
SSH_ERRORS = (OSError, EOFError, socket.timeout, paramiko.SSHException)

#: paramiko's error (an SSHException without a class of its own) when a channel's opening got
#: no answer within the connection's `channel_timeout`
_CHANNEL_OPEN_TIMEOUT = "Timeout opening channel."


def _lost(conn: Conn, exc: BaseException) -> ConnectionLost:
    """ConnectionLost for `exc`, raised by a call on `conn`. A silent node is named as such
    whichever deadline saw it first: the keepalive's, or the channel opening's, which is the
    same silence allowed (`nodes.connection`) and can end first when the call opens a channel
    just after the node fell silent."""
    silent = _silent(conn)
    if silent is not None:
        return silent
    waited = getattr(conn, "connect_kwargs", {}).get("channel_timeout")
    if isinstance(exc, paramiko.SSHException) and str(exc) == _CHANNEL_OPEN_TIMEOUT and waited:
        return ConnectionLost(f"the node answered nothing for {waited:g} s")
    return ConnectionLost(exc)


def _describe(exc: BaseException) -> str:
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def tail_lines(*texts: str) -> list[str]:
    lines = [ln.rstrip() for text in texts for ln in (text or "").splitlines() if ln.strip()]
    return lines[-TAIL_LINES:]


class _AllAtOnce(io.StringIO):
    """A command's standard input, given whole at the first read: invoke reads a stream that is
    no terminal one character per 10 ms (a 2 KB script would take 20 s)."""

    def read(self, size: int | None = -1) -> str:
        return super().read()


def run(conn: Conn, command: str, timeout: float = 60, stdin: str | None = None) -> str:
    """Run `command` on the node (`stdin`, when given, is its standard input); its stdout.
    Non-zero exit or a timeout is CommandFailed, a broken or refused SSH connection
    ConnectionLost, also one that went silent under the call (its keepalive closed it: a
    command cut so reads as exit -1 or a timeout)."""
    given = False if stdin is None else _AllAtOnce(stdin)
    try:
        result = conn.run(
            command, hide=True, warn=True, timeout=timeout, pty=False, in_stream=given
        )
    except CommandTimedOut as exc:
        raise _silent(conn) or CommandFailed(
            f"timed out after {timeout:g} s", tail_lines(exc.result.stdout, exc.result.stderr)
        ) from None
    except SSH_ERRORS as exc:
        raise _lost(conn, exc) from exc
    if result.exited != 0:
        raise _silent(conn) or CommandFailed(
            f"exited {result.exited}", tail_lines(result.stdout, result.stderr)
        )
    return result.stdout


def run_script(
    conn: Conn, name: str, *args: object, timeout: float = 60, python: str | None = None
) -> str:
    """Run the package's script `name` (`sparknet.node.files.script`: a step that runs before
    the wheel is on the node) with `args`, streamed as the standard input of the node's `sh`
    (of `python` for a Python script): one short command line. Its stdout, as `run`."""
    words = q(*map(str, args))
    command = f"sh -s -- {words}" if python is None else f"{q(python)} - {words}"
    return run(conn, command, timeout, stdin=script(name))


def succeeds(conn: Conn, command: str, timeout: float = 60) -> bool:
    """Whether `command` exits 0 on the node (what most checks ask); a lost connection is no
    answer and raises ConnectionLost."""
    try:
        run(conn, command, timeout)
    except ConnectionLost:
        raise
    except CommandFailed:
        return False
    return True


def q(*words: str) -> str:
    """Words quoted for the node's shell."""
    return " ".join(shlex.quote(str(w)) for w in words)


def upload(conn: Conn, data: bytes, remote: str, mode: int, timeout: float = 300) -> None:
    """Write `data` to the file `remote` on the node with `mode`, streamed over the SSH channel
    into `cat` (no SFTP subsystem needed, nothing on a command line). The file is made under
    umask 077, so it is never readable by others, not even before its chmod; it replaces the
    old one at once (`mv`), so a reader never sees half a file."""
    new = q(f"{remote}.new")
    command = f"umask 077 && cat > {new} && chmod {mode:o} {new} && mv -f {new} {q(remote)}"
    client = getattr(conn, "client", None)
    if client is None:  # a local invoke.Context (unit tests): the same command, locally
        subprocess.run(["sh", "-c", command], input=data, check=True, timeout=timeout)
        return
    try:
        stdin, stdout, stderr = client.exec_command(command, timeout=timeout)
        stdin.write(data)
        stdin.channel.shutdown_write()
        status = stdout.channel.recv_exit_status()
    except SSH_ERRORS as exc:
        raise _lost(conn, exc) from exc
    if status != 0:
        raise _silent(conn) or CommandFailed(
            f"writing {remote} exited {status}", tail_lines(stderr.read().decode(errors="replace"))
        )
