"""`sparknet.fit` in a user's own SparkSession whose executors run a Python without sparknet
(no PYSPARK_PYTHON): one line that says how to fix it, before the first training job. A real
session in a subprocess (a process holds one SparkContext), executors on /usr/bin/python3."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

OTHER_PYTHON = Path("/usr/bin/python3")

SCRIPT = """
import sys
from pyspark.sql import SparkSession
import sparknet
from sparknet.errors import SparknetError

spark = SparkSession.builder.master("local[2]").getOrCreate()
spark.sparkContext.setLogLevel("FATAL")
rows = [([float(i % 2)] * 4, i % 2) for i in range(16)]
df = spark.createDataFrame(rows, "features array<float>, label int")
try:
    sparknet.fit(df, model="mlp", workers=2, rounds=1, out=sys.argv[1])
except SparknetError as exc:
    print(f"error: {exc}")
spark.stop()
"""


def _lacks_sparknet(python: Path) -> bool:
    """A Python of the driver's minor version (PySpark refuses others) that cannot import us."""
    if not python.is_file():
        return False
    probe = (
        "import sys, importlib.util; "
        "print(sys.version_info[:2], importlib.util.find_spec('sparknet'))"
    )
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/")
    return done.stdout.strip() == f"{tuple(sys.version_info[:2])} None"


@pytest.mark.skipif(
    not _lacks_sparknet(OTHER_PYTHON),
    reason=f"needs {OTHER_PYTHON} of Python {sys.version_info[0]}.{sys.version_info[1]} without "
    "sparknet installed",
)
def test_executors_without_sparknet_fail_fast_saying_how_to_fix_it(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYSPARK_PYTHON": str(OTHER_PYTHON), "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"error: Spark's Python workers ({OTHER_PYTHON}) cannot import sparknet: set "
        "PYSPARK_PYTHON (spark-submit: spark.pyspark.python) to a Python that has sparknet, "
        f"e.g. {sys.executable}, before the SparkSession starts"
    ]
    assert not out.exists()
    print(f"failed in {time.monotonic() - t0:.1f} s")


def test_executors_on_something_that_is_not_python_fail_in_one_line(tmp_path):
    env = {**os.environ, "PYSPARK_PYTHON": "/bin/false", "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run")], capture_output=True, text=True,
        env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.splitlines()
    assert line.startswith("error: Spark's Python workers did not start (EOFException"), line
    assert line.endswith(f"e.g. {sys.executable}, before the SparkSession starts")
    assert not (tmp_path / "run").exists()
