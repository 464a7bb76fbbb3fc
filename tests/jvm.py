"""The JVMs of the tests start on a `java` that compiles with C1 only and collects with the
serial GC.

Why: the suite runs on 2 cores and is CPU-bound, and much of its CPU went to JVMs (Spark
drivers, executors and daemons) that live seconds to minutes: HotSpot's C2 compiler and G1's
threads warming up code that runs a few times. A local Spark session's start, 5 tiny jobs and
stop took 14.7 s of JVM CPU here, 7.7 s with these flags; the whole suite's test time went
from 31 to 25 minutes. The product's JVMs keep the defaults: on a cluster they live for hours
and move model-sized buffers, where C2 pays. (A class data sharing archive of Spark's classes
saved another 1.7 s a driver, but dumping it cost 40 s of CPU before any test could start.)

How: a copy of the real JDK's layout made of symlinks whose `bin/java` is a script that adds
the flags, put first on PATH and in JAVA_HOME. Spark starts every JVM through one of those two
(`spark-class`, its launcher, a worker starting executors), so this reaches the JVMs of CLI
subprocesses and of the loopback nodes (their SSH sessions get both through tests/sshd.py) too.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import tempfile
from pathlib import Path

from sparknet.errors import SparknetError
from sparknet.training.session import find_java

FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")

#: the name every quick JDK's directory starts with
PREFIX = "sparknet-test-jdk-"


def quick_java_home(real: Path) -> Path:
    """The symlinked JDK whose `java` adds FLAGS; made once per JDK and flags on this machine
    (atomically: several test processes start at once)."""
    key = hashlib.sha256(f"{real}\0{FLAGS}".encode()).hexdigest()[:12]
    home = Path(tempfile.gettempdir()) / f"{PREFIX}{key}"
    if (home / "bin" / "java").exists():
        return home
    staging = Path(tempfile.mkdtemp(prefix=f"{home.name}.", dir=home.parent))
    staging.chmod(0o755)
    for entry in real.iterdir():
        if entry.name != "bin":
            (staging / entry.name).symlink_to(entry)
    (staging / "bin").mkdir()
    for tool in (real / "bin").iterdir():
        if tool.name != "java":
            (staging / "bin" / tool.name).symlink_to(tool)
    java = staging / "bin" / "java"
    command = shlex.join([str(real / "bin" / "java"), *FLAGS])
    java.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    java.chmod(0o755)
    try:
        staging.rename(home)
    except OSError:  # another test process made it first
        shutil.rmtree(staging)
    return home


def use_quick_java() -> None:
    """Point JAVA_HOME and PATH at the quick JDK (nothing when there is no Java: the tests that
    need it fail with their own message)."""
    if Path(os.environ.get("JAVA_HOME", "")).name.startswith(PREFIX):
        return  # set already (a test process started by one that set it)
    try:
        java = find_java()  # the one Spark's launcher would use
    except SparknetError:
        return
    home = quick_java_home(Path(java).resolve().parents[1])
    os.environ["JAVA_HOME"] = str(home)
    os.environ["PATH"] = f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
