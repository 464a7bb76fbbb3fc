"""A master that stops answering on an open SSH connection: its sshd and the processes serving
the connection stopped with SIGSTOP, so the TCP connection stays open and nothing answers on it
(a frozen host, a link that drops every packet). Every call on such a connection must end
within its deadline (`nodes.SILENCE_ENV`, shortened here), and an attached submitter must give
the job up as out of reach once `submit.RECONNECT_ENV` has passed, exit 1 and name `attach`.
Real sshd on 127.0.0.1 (tests/sshd.py); what a test stops it continues in a `finally`."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparknet.cluster import nodes, remote
from sparknet.cluster.spark.plan import Node
from sparknet.jobs import driver_control, follow
from sparknet.jobs import submit as flow
from sparknet.jobs.preflight import Checked

pytestmark = pytest.mark.integration


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@contextlib.contextmanager
def _silent(sshd) -> Iterator[None]:
    """The sshd (its listener first, so it forks no new session meanwhile) and every process
    under it (each connection's sshd, in a session of its own, and what it runs) stopped for
    the block; continued after it, whatever happened."""
    stopped: list[int] = []
    try:
        todo = [sshd.proc.pid]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            todo.extend(_children(pid))
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_call_on_a_connection_the_node_went_silent_on_ends_within_its_deadline(
    sshd_nodes, monkeypatch, tmp_path
) -> None:
    """A command in flight when the node goes silent (a 60 s command timeout would not end it
    for a minute; before the keepalive its next call waited forever to open a channel) fails
    as ConnectionLost within about the silence allowed; so does the next call, whose new
    connection meets the silent sshd (no banner)."""
    monkeypatch.setenv(nodes.SILENCE_ENV, "1")
    group = sshd_nodes(1)
    conn = nodes.connect(group.endpoints[0], group.access)
    started = tmp_path / "started"
    failed: list[BaseException] = []

    def call() -> None:
        try:
            remote.run(conn, f"touch {started}; sleep 20", timeout=60)
        except BaseException as exc:  # the test asserts on it
            failed.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while not started.exists():
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        with _silent(group.servers[0]):
            began = time.monotonic()
            thread.join(timeout=8)
            assert not thread.is_alive(), "the call did not end"
            assert time.monotonic() - began < 4
            (lost,) = failed
            assert isinstance(lost, remote.ConnectionLost)
            assert str(lost) == "SSH connection lost (the node answered nothing for 1 s)"
            began = time.monotonic()
            with pytest.raises(remote.ConnectionLost):
                remote.run(conn, "true")
            assert time.monotonic() - began < 4
    finally:
        conn.close()


def test_a_channel_opened_as_the_node_falls_silent_is_named_as_the_silence(
    sshd_nodes, monkeypatch
) -> None:
    """A call that opens its channel just after the node fell silent: the opening's deadline
    (the same silence allowed) ends it before the keepalive does, and the error says the same
    as the keepalive's (held off here, so the opening's deadline is the one that ends it)."""
    monkeypatch.setenv(nodes.SILENCE_ENV, "1")
    group = sshd_nodes(1)
    conn = nodes.connect(group.endpoints[0], group.access)
    try:
        remote.run(conn, "true")
        conn._keepalive.stop()
        with _silent(group.servers[0]):
            began = time.monotonic()
            with pytest.raises(remote.ConnectionLost) as lost:
                remote.run(conn, "true")
            assert time.monotonic() - began < 4
        assert str(lost.value) == "SSH connection lost (the node answered nothing for 1 s)"
        assert nodes.went_silent(conn) is None  # the keepalive did not see it
    finally:
        conn.close()


def test_a_submit_whose_master_goes_silent_exits_1_naming_attach_within_the_window(
    sshd_nodes, monkeypatch, tmp_path
) -> None:
    """The whole submit (its cluster made and bootstrapped stood in for: the loopback node is
    its master), its job started over SSH on the loopback master, which then goes silent: the
    submitter gives the job up after `RECONNECT_ENV` (2 s here), exits 1 with `attach RUN`,
    neither cancels the job nor takes the cluster down, and names the autostop that ends it."""
    import sys

    from typer.testing import CliRunner

    from sparknet.cli.submit import submit_app
    from sparknet.cluster import ec2 as aws_provider
    from sparknet.cluster import registry

    group = sshd_nodes(1)
    endpoint = group.endpoints[0]
    root = tmp_path / "master"
    venv = root / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "sparknet").write_text("#!/bin/sh\nexec sleep 60\n")  # a driver that trains on
    for f in ("python", "sparknet"):
        (venv / f).chmod(0o755)
    master = driver_control.Master(
        Node(endpoint, "127.0.0.1", str(root), 0), group.access, "spark://x:1", 1
    )
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    checked = Checked("R1", f"{prefix}/", None)  # type: ignore[arg-type]
    monkeypatch.setattr(flow, "preflight", lambda job: checked)
    monkeypatch.setattr(flow, "check_name_free", lambda spec, endpoint_url: None)
    monkeypatch.setattr(flow, "check_gpu_counts", lambda spec, endpoint_url: None)
    monkeypatch.setattr(aws_provider, "up", lambda spec, **kwargs: None)
    monkeypatch.setattr(aws_provider, "down", lambda spec, **kwargs: pytest.fail("taken down"))
    monkeypatch.setattr(flow, "master_of", lambda spec, endpoint_url: master)
    monkeypatch.setattr(follow, "POLL_S", 0.2)
    monkeypatch.setenv(nodes.SILENCE_ENV, "1")
    monkeypatch.setenv(follow.RECONNECT_ENV, "2")
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {}\n")
    job = root / "jobs" / "R1"
    stop = threading.Event()
    silenced: list[float] = []

    def silence_once_it_runs() -> None:
        while not stop.is_set() and not (job / "train.pid").exists():
            time.sleep(0.05)
        if stop.is_set():
            return
        with _silent(group.servers[0]):
            silenced.append(time.monotonic())
            stop.wait(60)

    watcher = threading.Thread(target=silence_once_it_runs, daemon=True)
    watcher.start()
    try:
        done = CliRunner().invoke(submit_app, ["--s3", "s3://b-b/x", *_JOB])
        ended = time.monotonic()
        assert silenced, done.stderr
        assert done.exit_code == 1, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(
            "error: no answer over SSH from the master (127.0.0.1) for 2 s (SSH connection lost "
            "(the node answered nothing for 1 s)); "
        )
        assert last.endswith("job R1 may go on there: `sparknet-submit attach R1` follows it again")
        assert (
            "cluster c1 stays up (the job runs); its autostop timer terminates it 30 minutes"
            in (" ".join(done.stderr.split()))
        )
        assert not (job / "driver.rc").exists() and not (job / "cancelled").exists()
        # silence noticed within 1 s and a bit, then 2 s of tries (each new connection meets
        # no banner for 1 s): seconds, not the minutes of a 60 s command timeout or forever
        assert ended - silenced[0] < 8
    finally:
        stop.set()
        watcher.join(timeout=10)
        _end_job(job)


#: flags that keep the submit's settings valid without a dataset (preflight is stood in for)
_JOB = ("--model", "cnn", "--rounds", "2")


def _end_job(job: Path) -> None:
    """Kill what the submit started on the loopback master (its supervisor's whole group)."""
    with contextlib.suppress(OSError, ValueError):
        os.killpg(int((job / "driver.pid").read_text()), signal.SIGKILL)
