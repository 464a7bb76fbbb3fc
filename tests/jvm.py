"""The JVMs of the tests start on a `java` that compiles with C1 only, collects with the
serial GC, and maps Spark's classes from a class data sharing archive.

Why: the suite runs on 2 cores and is CPU-bound, and much of its CPU went to JVMs (Spark
drivers, executors and daemons) that live seconds to minutes: HotSpot's C2 compiler and G1's
threads warming up code that runs a few times, and some 11,000 classes read from jars, parsed
and verified in every JVM. A local Spark session's start, 5 tiny jobs and stop took 14.7 s of
JVM CPU here, 7.7 s with the flags; a session's start, one job and stop 11 CPU-s with the
flags, 7 with the archive too. The product's JVMs keep the defaults: on a cluster they live for
hours and move model-sized buffers, where C2 pays, and start too seldom for an archive to.

How: a copy of the real JDK's layout made of symlinks whose `bin/java` is a script that adds
the flags, put first on PATH and in JAVA_HOME. Spark starts every JVM through one of those two
(`spark-class`, its launcher, a worker starting executors), so this reaches the JVMs of CLI
subprocesses and of the loopback nodes (their SSH sessions get both through tests/sshd.py) too.

The archive: a JVM may map one only where its classpath starts with the one the archive was
dumped with (else it loads as usual, silently). Spark's JVMs have a conf dir first and the jars
after it, and the conf dir differs between the test process's JVMs and each loopback node's; so
archives are made for the jars alone, in the quick JDK's `cds/`, named by their classpath's md5,
and where one exists the script maps it and moves the conf dir behind the jars. That changes no
lookup: the conf dir holds no classes, and Spark's jars no resource of its names (log4j2's
properties, spark-defaults.conf, *-site.xml) at their root. The first test process on a machine
builds the archive of this pyspark's jars (drivers, executors and daemons share them; the
launcher's own small JVM gets none) in the background: a local session whose JVMs list the
classes they load, then a dump of that list (about 40 CPU-s in all, paid back by the tenth Spark
application). JVMs that start before it is there run without it.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from sparknet.errors import SparknetError
from sparknet.processes import alive
from sparknet.training.session import find_java

FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")

#: the name every quick JDK's directory starts with
PREFIX = "sparknet-test-jdk-"

#: set for a JVM, the script has it write the classes it loads to DIR/<md5 of its jars>.classes
#: (and the jars' classpath to .cp): how the archive's class list is made
CLASS_LIST_ENV = "SPARKNET_TEST_CLASS_LIST_DIR"

#: the script: the flags; with CLASS_LIST_ENV, a class list; else the archive of its -cp's jars,
#: if any, the conf dir behind them (a JVM without -cp, as `java -version`, starts at once)
_SCRIPT = """#!/bin/sh
cp= prev=
for arg in "$@"; do
    case "$prev" in -cp|-classpath|--class-path) cp=$arg ;; esac
    prev=$arg
done
[ -n "$cp" ] || exec JAVA "$@"
conf= jars=$cp
case "${cp%%:*}" in *.jar|*'*'|"$cp") ;; *) conf=${cp%%:*} jars=${cp#*:} ;; esac
key=$(printf %s "$jars" | md5sum | cut -c1-32)
if [ -n "${CLASS_LIST_ENV}" ]; then
    printf %s "$jars" > "${CLASS_LIST_ENV}/$key.cp"
    exec JAVA -XX:DumpLoadedClassList="${CLASS_LIST_ENV}/$key.classes" "$@"
fi
[ -f "CDS/$key.jsa" ] || exec JAVA "$@"
if [ -n "$conf" ]; then
    n=$# prev=
    for arg in "$@"; do
        new=$arg
        case "$prev" in -cp|-classpath|--class-path) new=$jars:$conf ;; esac
        prev=$arg
        set -- "$@" "$new"
    done
    shift "$n"
fi
exec JAVA -XX:SharedArchiveFile="CDS/$key.jsa" "$@"
"""


def _script(real: Path, home: Path) -> str:
    java = shlex.join([str(real / "bin" / "java"), *FLAGS])
    return (
        _SCRIPT.replace("CLASS_LIST_ENV", CLASS_LIST_ENV)
        .replace("CDS", shlex.quote(str(home / "cds")))
        .replace("JAVA", java)
    )


def quick_java_home(real: Path) -> Path:
    """The symlinked JDK whose `java` is the script above; made once per JDK, flags and script
    on this machine (atomically: several test processes start at once)."""
    key = hashlib.sha256(f"{real}\0{FLAGS}\0{_SCRIPT}\0{os.getuid()}".encode()).hexdigest()
    home = Path(tempfile.gettempdir()) / f"{PREFIX}{key[:12]}"
    if home.exists() or home.is_symlink():
        _check_ours(home)
        return home
    staging = Path(tempfile.mkdtemp(prefix=f"{home.name}.", dir=home.parent))
    staging.chmod(0o755)
    for entry in real.iterdir():
        if entry.name != "bin":
            (staging / entry.name).symlink_to(entry)
    (staging / "bin").mkdir(mode=0o755)  # under any umask: `_check_ours`
    for tool in (real / "bin").iterdir():
        if tool.name != "java":
            (staging / "bin" / tool.name).symlink_to(tool)
    (staging / "cds").mkdir(mode=0o755)
    java = staging / "bin" / "java"
    java.write_text(_script(real, home))
    java.chmod(0o755)
    try:
        staging.rename(home)
    except OSError:  # another test process made it first
        shutil.rmtree(staging)
        _check_ours(home)
    return home


def _check_ours(home: Path) -> None:
    """The quick JDK lies in the shared temp dir, and every JVM of the tests runs its script: one
    another user made or can write (the dir, its `bin`, `cds` or script) is refused."""
    for path in (home, home / "bin", home / "cds", home / "bin" / "java"):
        try:
            st = path.lstat()
        except FileNotFoundError:
            raise SparknetError(f"{home} is half made: remove it and run the tests again") from None
        if not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
            raise SparknetError(f"{path} is not a plain file or dir: remove {home}")
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise SparknetError(
                f"{path} is another user's or writable by others: remove {home} (the tests run "
                "its java)"
            )


def archive_marker(home: Path) -> Path:
    """Present once this pyspark's archive was built (or tried: a failed build is not retried);
    pyspark's jars installed again, or another pyspark, have a marker of their own."""
    import pyspark  # lazy: pyspark, for its path only

    jars = sorted((Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    stats = [(str(j), j.stat().st_size, j.stat().st_mtime_ns) for j in jars]
    return home / "cds" / f"built-{hashlib.md5(repr(stats).encode()).hexdigest()}"


def build_archive_in_background(home: Path) -> None:
    """Start `python -m tests.jvm` to build this pyspark's archive, unless it is built or being
    built (a lock file holds the builder's pid; a dead builder's lock is taken over)."""
    marker = archive_marker(home)
    if marker.exists():
        return
    fd = _take(marker.with_suffix(".lock"))
    if fd is None:
        return
    log = marker.with_suffix(".log").open("w")
    builder = subprocess.Popen(
        [sys.executable, "-m", "tests.jvm", str(home)], cwd=Path(__file__).resolve().parents[1],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    os.write(fd, str(builder.pid).encode())
    os.close(fd)


def _take(lock: Path) -> int | None:
    """The lock file made by this process, open for its builder's pid; None while a live
    builder holds it. A dead builder's lock is taken over once (two processes that find it at
    once: one makes the new lock, the other finds that one)."""
    for _ in range(2):
        try:
            return os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                if alive(int(lock.read_text())):
                    return None
            except ValueError:
                return None  # its builder has not written its pid yet
            except OSError:
                continue  # gone since: try again
            lock.unlink(missing_ok=True)  # its builder died: build again
    return None


def build_archive(home: Path) -> None:
    """A local session's JVMs list the classes they load (the session runs a job and a
    DataFrame query, as the tests do); each list of a Spark JVM is dumped into the archive of
    its classpath. The marker is written whatever happens: a failed build is not tried again."""
    from sparknet.training.session import start_session  # lazy: pyspark

    marker = archive_marker(home)
    lists = marker.with_suffix(".lists")  # one of a killed build is made anew
    shutil.rmtree(lists, ignore_errors=True)
    lists.mkdir()
    try:
        os.environ[CLASS_LIST_ENV] = str(lists)
        spark = start_session("local[2,2]", workers=2)
        spark.sparkContext.parallelize(range(100), 2).map(lambda x: x * x).sum()
        spark.createDataFrame([(1, "a")], ["n", "s"]).groupBy("s").count().collect()
        spark.stop()
        for classes in lists.glob("*.classes"):
            if len(classes.read_text().splitlines()) < 5000:
                continue  # the launcher's small JVM: the JDK's own archive serves it
            cp = classes.with_suffix(".cp").read_text()
            staging = classes.with_suffix(".jsa")
            subprocess.run(
                [str(home / "bin" / "java"), "-Xshare:dump", f"-XX:SharedClassListFile={classes}",
                 f"-XX:SharedArchiveFile={staging}", "-cp", cp],
                env={k: v for k, v in os.environ.items() if k != CLASS_LIST_ENV}, check=True,
            )  # fmt: skip
            # in place of an archive of the jars this classpath had before (pyspark installed
            # again), with which a JVM would run with no sharing at all: the others' stay
            staging.rename(home / "cds" / f"{classes.stem}.jsa")
            classes.with_suffix(".cp").rename(home / "cds" / f"{classes.stem}.cp")  # its jars
    finally:
        marker.touch()
        marker.with_suffix(".lock").unlink(missing_ok=True)
        shutil.rmtree(lists, ignore_errors=True)


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
    build_archive_in_background(home)


if __name__ == "__main__":
    build_archive(Path(sys.argv[1]))
