"""The driver's end of the allreduce channel, as a second user who reaches its port sees it:
anything but rank 0's hello with the stage's token is closed unheard, at once or by a deadline,
and leaves no word on the driver's output."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

import pytest

from sparknet.training import progress
from sparknet.training.allreduce import _Channel

TOKEN = "ab" * 16


@pytest.fixture
def channel(monkeypatch):
    monkeypatch.setattr(progress, "_HELLO_S", 0.5)
    raised: list = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    inbox: queue.Queue = queue.Queue()
    made = _Channel("127.0.0.1", TOKEN, inbox)
    yield made, inbox, raised
    made.close()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the driver closes `sock` within `seconds` (what it sends back, if anything,
    is read and dropped)."""
    sock.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


@pytest.mark.parametrize(
    "hello",
    [
        b'{"token": "\xc3\xa9", "start": 0}\n',  # not ASCII: compare_digest of str raised
        b"[1, 2]\n",
        b'"just text"\n',
        b'{"token": 5, "start": 0}\n',
        b'{"token": "' + b"cd" * 16 + b'", "start": 0}\n',  # a wrong token
        b'{"token": "' + TOKEN.encode() + b'"}\n',  # the token, no start
        b'{"token": "' + TOKEN.encode() + b'", "start": "x"}\n',
        b"not json\n",
        b"x" * 100_000,  # a huge line: never read whole
    ],
)
def test_anything_but_the_hello_is_closed_unheard(channel, hello):
    made, inbox, raised = channel
    with socket.create_connection(made.address) as sock:
        sock.sendall(hello)
        assert _closed_within(sock, 0.4)
    assert inbox.empty() and raised == []


def test_a_connection_that_says_nothing_or_trickles_is_closed_by_the_deadline(channel):
    made, inbox, raised = channel
    with (
        socket.create_connection(made.address) as silent,
        socket.create_connection(made.address) as trickle,
    ):
        trickle.settimeout(0.1)
        closed = False
        for _ in range(15):  # a byte each 0.1 s: each read in time, the hello never whole
            try:
                trickle.send(b"{")
                closed = trickle.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
            if closed:
                break
        assert closed
        assert _closed_within(silent, 0.5)
    assert inbox.empty() and raised == []


def test_rank_zero_s_hello_and_rows_are_heard(channel):
    made, inbox, raised = channel
    with socket.create_connection(made.address) as sock:
        sock.sendall(json.dumps({"token": TOKEN, "start": 3}).encode() + b"\n")
        sock.sendall(json.dumps({"row": {"round": 4}, "ack": True}).encode() + b"\n")
        first, second = inbox.get(timeout=2), inbox.get(timeout=2)
        assert first[:2] == ("message", {"start": 3})
        assert second[:2] == ("message", {"row": {"round": 4}, "ack": True})
        time.sleep(0.7)  # past the hello's deadline: the connection stays
        second[2].sendall(b"ok\n")
        assert sock.recv(3) == b"ok\n"
    assert raised == []


def test_a_driver_out_of_threads_drops_the_connection_and_keeps_listening(channel, monkeypatch):
    """A flood of connections that leaves no thread to start: each is closed, no traceback,
    and rank 0's hello is heard once threads are back."""
    made, inbox, raised = channel

    thread, timer = threading.Thread, threading.Timer

    class NoThread(thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    class NoTimer(timer):
        def start(self):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading, "Thread", NoThread)  # each connection's reader
    with socket.create_connection(made.address) as sock:
        assert _closed_within(sock, 1.0)
    monkeypatch.setattr(threading, "Thread", thread)
    monkeypatch.setattr(threading, "Timer", NoTimer)  # the hello's deadline
    with socket.create_connection(made.address) as sock:
        sock.sendall(json.dumps({"token": TOKEN, "start": 1}).encode() + b"\n")
        assert _closed_within(sock, 1.0)
    monkeypatch.setattr(threading, "Timer", timer)
    with socket.create_connection(made.address) as sock:
        sock.sendall(json.dumps({"token": TOKEN, "start": 2}).encode() + b"\n")
        assert inbox.get(timeout=2)[1] == {"start": 2}
    assert raised == []
