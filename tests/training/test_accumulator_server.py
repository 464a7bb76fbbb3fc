"""PySpark's accumulator server (the driver's end of the JVM's accumulator updates) as sparknet
quiets it: a hang-up in the middle of an update is no traceback."""

from __future__ import annotations

import socket
import struct
import time
from types import SimpleNamespace

from pyspark import accumulators

from sparknet.training.session import _quiet_accumulator_server


def test_a_connection_cut_mid_update_prints_no_traceback(capfd) -> None:
    """A signal to the whole process group kills the JVM between its accumulator updates; the
    server then printed a traceback above the one error line. A real server (its own, not a
    session's: the server takes one connection at a time and the JVM's stays open), a client
    that authenticates, sends one empty update and hangs up."""
    server = accumulators._start_update_server("t0ken", False)
    try:
        _quiet_accumulator_server(SimpleNamespace(_accumulatorServer=server))
        with socket.create_connection(server.server_address[:2], timeout=5) as conn:
            conn.sendall(b"t0ken" + struct.pack("!i", 0))
            assert conn.recv(1) == b"\x01"  # the update was taken: the next read meets the end
        time.sleep(1.5)  # the server polls once a second
    finally:
        server.shutdown()
        server.server_close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "EOFError" not in err, err
