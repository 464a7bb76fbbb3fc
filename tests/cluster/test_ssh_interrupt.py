"""Ctrl-C (or SIGTERM, which the CLI raises alike) while the main thread waits on a remote
command: the wait ends at once, not when the command ends. Fabric raised the interrupt only
after its output threads had read the command to its end: a submitter whose master went silent
sat out the keepalive's deadline after Ctrl-C, one in a cancel's wait the whole wait. Real sshd
on 127.0.0.1 (tests/sshd.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from sparknet.cluster import nodes, remote

pytestmark = pytest.mark.integration


def test_an_interrupt_ends_the_wait_on_a_remote_command_at_once(sshd_nodes) -> None:
    group = sshd_nodes(1)
    conn = nodes.connect(group.endpoints[0], group.access)

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, interrupt)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        started = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            remote.run(conn, "sleep 10", timeout=60)
        assert time.monotonic() - started < 3
        assert remote.run(conn, "echo still").strip() == "still"  # the connection serves on
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)
        conn.close()
