"""Bring your own Spark: `spark-submit` of a script calling `sparknet.fit`, as
docs/spark-cluster.md ("On a Spark cluster you already have") shows, against the shared
standalone cluster."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sparknet.training.report import read_metrics
from tests.conftest import REPO

pytestmark = pytest.mark.integration

SCRIPT = REPO / "examples" / "fit_on_spark.py"
ROUNDS = 3


def apps(work_dirs: tuple[Path, ...]) -> set[Path]:
    """The application dirs the standalone workers made: one per executor they ran."""
    return {app for work in work_dirs if work.is_dir() for app in work.glob("app-*")}


def spark_submit(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Runs spark-submit in its own process group, ended with everything under it on timeout."""
    import pyspark

    cmd = [str(Path(pyspark.__file__).parent / "bin" / "spark-submit"), *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"spark-submit ran past {timeout} s; stderr ends:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
def test_spark_submit_of_a_fit_script_trains_on_the_cluster(standalone, tmp_path):
    out = tmp_path / "run"
    before = apps(standalone.work_dirs)
    # as a user would: the executors' Python is one that has sparknet (here: this venv's)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    done = spark_submit(
        "--master", standalone.master, "--conf", "spark.executor.memory=1g",
        str(SCRIPT), "--out", str(out), "--rounds", str(ROUNDS), "--tau", "10",
        env=env, timeout=240,
    )  # fmt: skip
    (tmp_path / "spark-submit.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]

    rows = read_metrics(out)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert rows[-1]["eval_samples"] == 360  # the script's test fifth of the 1797 digits
    assert rows[-1]["eval_accuracy"] > 0.3  # 10 classes: well above chance after 30 steps
    assert rows[-1]["loss"] < rows[0]["loss"]
    weights = load_file(out / "model.safetensors")
    assert weights and all(t.isfinite().all() for t in weights.values())
    assert f"run dir {out}: test accuracy {rows[-1]['eval_accuracy']:.3f}" in done.stdout
    # a line a round where logging was never set up (on stdout: spark-submit's PythonRunner
    # merges the script's stderr into it), and not Spark's INFO lines about each task
    said = [line.split("  ")[0] for line in done.stdout.splitlines() if line.startswith("round ")]
    assert said == [f"round {r}/{ROUNDS}" for r in range(1, ROUNDS + 1)]
    assert " INFO TaskSetManager" not in done.stderr
    # the tasks ran on the cluster's two workers, not in a local-mode JVM
    new = apps(standalone.work_dirs) - before
    assert {app.parent for app in new} == set(standalone.work_dirs)
