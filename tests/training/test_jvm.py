"""The tests' own JVM flags and class archive (tests/jvm.py) reach the JVMs Spark starts: without
them the suite takes a quarter longer, and nothing else would say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jvm import FLAGS, archive_marker

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
        ".getInputArguments()); info = jvm.java.lang.System.getProperty('java.vm.info'); "
        "s.stop(); print(json.dumps([args, info]))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    args, info = json.loads(shown.stdout.splitlines()[-1])
    archives = [a for a in args if a.startswith("-XX:SharedArchiveFile=")]
    assert [Path(a.split("=", 1)[1]).parent for a in archives] == [home / "cds"], (
        args,
        marker.with_suffix(".log").read_text()[-3000:],
    )
    assert "sharing" in info, info
