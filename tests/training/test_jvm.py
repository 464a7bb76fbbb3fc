"""The tests' own JVM flags and class archive (tests/jvm.py) reach the JVMs Spark starts: without
them the suite takes a quarter longer, and nothing else would say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyspark
import pytest

from sparknet.errors import SparknetError
from sparknet.processes import alive
from tests.jvm import FLAGS, _take, archive_marker, quick_java_home

pytestmark = pytest.mark.integration


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


def test_a_spark_jvm_maps_the_class_archive_once_it_is_built(tmp_path) -> None:
    """The archive the first test process builds in the background (tests/jvm.py) is taken by
    the JVMs that start after it: a new session's driver is given it and runs with sharing on
    (a JVM whose classpath does not match it would run with sharing off)."""
    home = Path(os.environ["JAVA_HOME"])
    marker = archive_marker(home)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert time.monotonic() < deadline, marker.with_suffix(".log").read_text()[-3000:]
        time.sleep(1)
    code = (
        "import json; from sparknet.training.session import start_session; "
        "s = start_session('local[1]', workers=1); jvm = s.sparkContext._jvm; "
        "args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()"
        ".getInputArguments()); prop = jvm.java.lang.System.getProperty; "
        "info, cp = prop('java.vm.info'), prop('java.class.path'); "
        "s.stop(); print(json.dumps([args, info, cp]))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    args, info, cp = json.loads(shown.stdout.splitlines()[-1])
    archives = [a for a in args if a.startswith("-XX:SharedArchiveFile=")]
    assert [Path(a.split("=", 1)[1]).parent for a in archives] == [home / "cds"], (
        args,
        marker.with_suffix(".log").read_text()[-3000:],
    )
    assert "sharing" in info, info
    # its conf dir moved behind the jars; a loopback node's JVM, with a conf dir of its own
    # before the same jars, maps the archive too
    assert cp.endswith(":" + str(Path(pyspark.__file__).parent / "conf")), cp[-300:]
    jars = Path(archives[0].split("=", 1)[1]).with_suffix(".cp").read_text()
    (tmp_path / "conf").mkdir()
    node = subprocess.run(
        ["java", "-Xlog:class+load=info", "-cp", f"{tmp_path / 'conf'}/:{jars}",
         "org.apache.spark.deploy.SparkSubmit", "--version"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "org.apache.spark.deploy.SparkSubmit source: shared objects file" in node.stdout, (
        node.stdout[-3000:]
    )


def test_a_quick_jdk_another_user_can_write_is_refused(tmp_path, monkeypatch) -> None:
    """Every JVM of the tests runs the quick JDK's script from the shared temp dir: one found
    there that others may write is refused, not run; a sound one is reused as it is."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = Path(os.environ["JAVA_HOME"], "lib").resolve().parent  # where its links lead
    umask = os.umask(0o002)  # a group-writable default: what it makes is still not
    try:
        home = quick_java_home(real)
    finally:
        os.umask(umask)
    assert quick_java_home(real) == home  # reused
    (home / "cds").chmod(0o777)  # anyone may drop an archive the JVMs would map
    with pytest.raises(SparknetError, match=r"writable by others: remove .*sparknet-test-jdk-"):
        quick_java_home(real)
    (home / "cds").chmod(0o755)
    (home / "bin" / "java").chmod(0o775)
    with pytest.raises(SparknetError, match="writable by others"):
        quick_java_home(real)


def test_the_archive_builders_lock_is_taken_over_only_from_a_dead_builder(tmp_path) -> None:
    lock = tmp_path / "built-x.lock"
    fd = _take(lock)
    assert fd is not None
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    assert _take(lock) is None  # a live builder holds it
    child = subprocess.Popen(["sleep", "30"])
    lock.write_text(str(child.pid))
    assert _take(lock) is None
    child.kill()
    time.sleep(0.2)  # killed, not reaped yet: a zombie, which builds nothing
    assert not alive(child.pid) and Path(f"/proc/{child.pid}").exists()
    fd = _take(lock)
    assert fd is not None and lock.read_text() == ""
    os.close(fd)
    child.wait()
    lock.write_text("")  # made by a builder that has not written its pid yet: left to it
    assert _take(lock) is None
