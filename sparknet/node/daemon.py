"""A daemon started and stopped by its pid file, on the node where it runs (no systemd there).

The daemon runs in its own session (so it outlives the SSH session that started it), its pid
file names the session's leader, and a stamp file beside it says what it was started with (the
submitter's hash of its command line, environment and conf). A pid file alone proves nothing
(the number may be another process's by now): a daemon is alive when the process it names runs
this daemon's class (`klass`, one word of its command line) with a path only this install
prefix's daemon has (`own`)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: how often a wait looks again
POLL_S = 0.2
#: how long a stopped daemon's session has to end after SIGTERM before it gets SIGKILL
STOP_WAIT_S = 30.0


def read_pid(pid_file: str | Path) -> int | None:
    """The pid in `pid_file`; None when it is missing, empty or no number."""
    try:
        text = Path(pid_file).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def cmdline(pid: int) -> list[str] | None:
    """The words process `pid` runs with; None when it is gone (or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")


def alive(pid_file: str | Path, klass: str, own: str) -> bool:
    """Whether the pid file names a live process running `klass` (a word of its command line)
    with `own` (part of a word: a path only this prefix's daemon has)."""
    pid = read_pid(pid_file)
    words = [] if pid is None else cmdline(pid) or []
    return klass in words and any(own in w for w in words)


def running(pid_file: str | Path, klass: str, own: str, stamp_file: str, stamp: str) -> bool:
    """`alive`, and started with today's `stamp` (a changed setting is a restart)."""
    try:
        started = Path(stamp_file).read_text().strip()
    except OSError:
        return False
    return started == stamp and alive(pid_file, klass, own)


def start(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    log_file: str,
    pid_file: str,
    stamp_file: str | None = None,
    stamp: str = "",
) -> int:
    """Start `argv` (with `env` added to this environment) in `cwd`, in a session of its own,
    SIGHUP ignored, its output going to `log_file` (truncated first) and no stdin: nothing
    holds the SSH channel that started it. Then the pid file (and, given a `stamp_file`, the
    stamp); the pid."""
    with open(log_file, "wb") as log, open(os.devnull, "rb") as null:
        hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited: the daemon ignores it
        try:
            proc = subprocess.Popen(
                list(argv), cwd=cwd, env={**os.environ, **env}, stdin=null, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        finally:
            signal.signal(signal.SIGHUP, hup)
    Path(pid_file).write_text(f"{proc.pid}\n")
    if stamp_file is not None:
        Path(stamp_file).write_text(f"{stamp}\n")
    return proc.pid


def send(pid: int, sig: int, *, group: bool) -> bool:
    """`sig` to process `pid` (or the process group it leads); whether it was delivered (a
    process gone meanwhile is no error to whoever wanted it ended)."""
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except OSError:
        return False
    return True


def stop(pid_file: str, stamp_file: str, klass: str, own: str, wait_s: float = STOP_WAIT_S) -> None:
    """Stop the daemon if it is alive: SIGTERM to its process group, SIGKILL to the group after
    `wait_s`; then its pid and stamp files go (also those of a daemon not alive)."""
    pid = read_pid(pid_file)
    if pid is not None and alive(pid_file, klass, own):
        send(pid, signal.SIGTERM, group=True) or send(pid, signal.SIGTERM, group=False)
        end = time.monotonic() + wait_s
        while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
            time.sleep(POLL_S)
        if Path(f"/proc/{pid}").exists():
            send(pid, signal.SIGKILL, group=True)
    for path in (pid_file, stamp_file):
        Path(path).unlink(missing_ok=True)


def wait_started(pid_file: str, klass: str, own: str, within_s: float) -> bool:
    """Whether the daemon is `alive` within `within_s`. False at once when the process its pid
    file names ended: it will not come up. (`spark-class` runs a launcher JVM before it execs
    the daemon's: until then `alive` cannot tell it from another prefix's daemon.)"""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if alive(pid_file, klass, own):
            return True
        pid = read_pid(pid_file)
        if pid is None or not Path(f"/proc/{pid}").exists():
            return False
        time.sleep(POLL_S)
    return False


def wait_listening(host: str, port: int, within_s: float) -> bool:
    """Whether `host:port` takes a connection within `within_s`."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            socket.create_connection((host, port), 1).close()
            return True
        except OSError:
            time.sleep(POLL_S)
    return False


def wait_file(path: str, within_s: float) -> bool:
    """Whether the file `path` has content within `within_s`."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if Path(path).stat().st_size > 0:
                return True
        except OSError:
            pass  # not there yet
        time.sleep(POLL_S)
    return False


def spark_home() -> str:
    """The venv's pyspark dir (SPARK_HOME: its `bin/spark-class` starts the daemons), found
    without importing pyspark."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pyspark is not installed in this Python")
    return str(spec.submodule_search_locations[0])
