"""A sparknet-submit job on its master, asked or ended there: its state, a signal, a cancel.

A job dir (`<prefix>/jobs/<run id>`) holds the pid file of the job's supervisor (`PID`), whose
process group is the whole job (the supervisor, the driver, their children), the exit code the
supervisor writes at the end (`RC`) and the marker of a job ended on purpose (`CANCELLED`).
A pid alone proves nothing (the number may be another process's by now): a signal goes to the
supervisor only while it leads its process group, else to the group."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from sparknet.node.daemon import read_pid, send

#: the job dir's files: the supervisor's pid, its final exit code, the cancel marker
PID, RC, CANCELLED = "driver.pid", "driver.rc", "cancelled"
#: the states of a job without an exit code: its supervisor died and left its driver (or a child)
#: running; its supervisor was killed and nothing of it is left; its job dir is not there
ORPHANED, KILLED, GONE = "orphaned", "killed", "gone"
#: how long a cancel waits for the job's session to end before it kills what is left of it
CANCEL_WAIT_S = 60.0


def parse_rc(text: str) -> int:
    """The exit code in a `driver.rc`; one that does not read as a number (a disk full while
    it was written, a hand edit) counts as a failure (-1), not a traceback."""
    try:
        return int(text.strip())
    except ValueError:
        return -1


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _exists(pid: int) -> bool:
    """Whether process `pid` exists (as `kill -0` says: one of another user's is not ours)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def group_alive(job_dir: str | Path) -> bool:
    """Whether any process of the job's session (its supervisor's process group) is alive."""
    pid = read_pid(Path(job_dir) / PID)
    if pid is None:
        return False
    try:
        os.killpg(pid, 0)
    except OSError:
        return False
    return True


def rc(job_dir: str | Path) -> int | None:
    """The job's exit code once it ended (its supervisor's: the driver's last, after any
    restarts); None while its supervisor runs. A job gone without one (cancelled, killed)
    counts as failed (-1)."""
    jd = Path(job_dir)
    text = _read(jd / RC)
    if text:
        return parse_rc(text)
    pid = read_pid(jd / PID)
    if pid is not None and _exists(pid):
        return None
    text = _read(jd / RC)  # it ended meanwhile
    return parse_rc(text) if text else -1


def how_it_ended(job_dir: str | Path) -> str:
    """Of a job whose supervisor is gone: `rc` (it wrote its exit code), ORPHANED (no code, but
    its process group still has a member), CANCELLED (the marker) or "" (its supervisor was
    killed, and nothing of it is left)."""
    jd = Path(job_dir)
    if _read(jd / RC):
        return "rc"
    if group_alive(jd):
        return ORPHANED
    if (jd / CANCELLED).exists():
        return CANCELLED
    return ""


def state(job_dir: str | Path) -> str:
    """running, succeeded, failed RC, CANCELLED, ORPHANED (its supervisor died and left its
    driver running: the driver's death signal or a cancel ends it), KILLED (its supervisor died
    without an exit code, and nothing of the job is left), or GONE (no job dir here: the cluster
    was made again under the same name). An exit code wins over the cancel marker: a job that
    ended on its own while a cancel came in ended as its code says."""
    jd = Path(job_dir)
    if not jd.is_dir():
        return GONE
    code = rc(jd)
    if code is None:
        return "running"
    how = how_it_ended(jd)
    if how in (ORPHANED, CANCELLED):
        return how
    if how != "rc":
        return KILLED
    return "succeeded" if code == 0 else f"failed {code}"


def signal_job(job_dir: str | Path) -> None:
    """SIGTERM to the supervisor while it leads its process group (it passes it on to the
    driver: one signal, so the driver stops its Spark in order), else to the group; a job with
    no pid file is left alone."""
    pid = read_pid(Path(job_dir) / PID)
    if pid is None:
        return
    try:
        leads = _exists(pid) and os.getpgid(pid) == pid
    except OSError:  # gone between the two looks: its group may still have members
        leads = False
    send(pid, signal.SIGTERM, group=not leads)


def stop_session(job_dir: str | Path, wait_s: float = CANCEL_WAIT_S, poll_s: float = 0.2) -> None:
    """`signal_job`, then wait until no process of the job's session is left: SIGKILL to the
    whole group once `wait_s` has passed."""
    signal_job(job_dir)
    pid = read_pid(Path(job_dir) / PID)
    if pid is None:
        return
    end = time.monotonic() + wait_s
    while group_alive(job_dir):
        if time.monotonic() >= end:
            send(pid, signal.SIGKILL, group=True)
        time.sleep(poll_s)


def cancel(job_dir: str | Path, wait_s: float = CANCEL_WAIT_S) -> bool:
    """When any process of the job's session is alive (whatever its state says: a driver whose
    supervisor was killed runs on, holding the GPUs), mark it cancelled and `stop_session`;
    whether there was any."""
    if not group_alive(job_dir):
        return False
    (Path(job_dir) / CANCELLED).touch()
    stop_session(job_dir, wait_s)
    return True


def live_jobs(jobs_dir: str | Path) -> list[str]:
    """The run ids of the jobs under `jobs_dir` whose session is alive."""
    root = Path(jobs_dir)
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and group_alive(d))


def end_jobs(jobs_dir: str | Path) -> None:
    """Mark every live job under `jobs_dir` cancelled and SIGTERM its session, without waiting."""
    for run_id in live_jobs(jobs_dir):
        jd = Path(jobs_dir) / run_id
        pid = read_pid(jd / PID)
        (jd / CANCELLED).touch()
        if pid is not None:  # else its pid file went meanwhile
            send(pid, signal.SIGTERM, group=True)


def _tail(data: bytes, lines: int) -> bytes:
    """The last `lines` lines of `data`, as `tail -n` gives them (a last line without its line
    break counts)."""
    pos = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(max(lines, 0)):
        pos = data.rfind(b"\n", 0, pos)
        if pos < 0:
            return data
    return data[pos + 1 :] if lines > 0 else b""


def log_since(log: str | Path, offset: int, lines: int | None = None) -> bytes:
    """The log's size in bytes now, a line break, then its bytes from `offset` up to that size
    (with `lines`: only the last `lines` lines of them). The size is the node's count: a byte
    that is no UTF-8 arrives at the submitter as U+FFFD, so it cannot count what arrived."""
    try:
        with open(log, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            data = f.read(max(size - offset, 0))
    except OSError:
        size, data = 0, b""
    return f"{size}\n".encode() + (data if lines is None else _tail(data, lines))
