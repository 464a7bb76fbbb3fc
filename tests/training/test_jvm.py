"""The tests' own JVM flags (tests/jvm.py) reach the JVMs Spark starts: without them the suite
takes a quarter longer, and nothing else would say so."""

from __future__ import annotations

import subprocess

import pytest

from tests.jvm import FLAGS

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
