"""The tests' own JVM flags (tests/jvm.py) reach the JVMs Spark starts: without them the suite
takes a quarter longer, and nothing else would say so."""

from __future__ import annotations

import subprocess

from tests.jvm import FLAGS


def test_the_local_sessions_driver_runs_with_the_tests_flags(spark) -> None:
    jvm = spark.sparkContext._jvm
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert set(FLAGS) <= set(args), args


def test_java_on_path_is_the_quick_one() -> None:
    shown = subprocess.run(
        ["java", "-XX:+PrintFlagsFinal", "-version"], capture_output=True, text=True, check=True
    ).stdout
    flags = {line.split()[1]: line.split()[3] for line in shown.splitlines() if " = " in line}
    assert flags["TieredStopAtLevel"] == "1"
    assert flags["UseSerialGC"] == "true"


def test_a_jvm_connection_cut_mid_update_prints_no_traceback(spark, capfd) -> None:
    """A signal to the whole process group kills the JVM in the middle of its accumulator
    updates; PySpark's accumulator server then printed a traceback above the one error line.
    Here a client authenticates, sends one empty update, and hangs up."""
    import socket
    import struct
    import time

    server = spark.sparkContext._accumulatorServer
    with socket.create_connection(server.server_address[:2], timeout=5) as conn:
        conn.sendall(server.auth_token.encode() + struct.pack("!i", 0))
        assert conn.recv(1) == b"\x01"  # the update was taken: the next read meets the hang-up
    time.sleep(1.5)  # the server polls once a second
    err = capfd.readouterr().err
    assert "Traceback" not in err and "EOFError" not in err, err
