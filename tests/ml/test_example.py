"""examples/spark_ml_pipeline.py, as docs/model.md gives it, run as a user runs it (its own
Python process and Spark session): it trains, scores, saves and loads a pipeline."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_the_pipeline_example_trains_saves_loads_and_scores_alike(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "spark_ml_pipeline.py"), "--runs", "runs",
         "--pipeline", "pipe"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = re.search(r"accuracy: ([\d.]+) \(loaded again: ([\d.]+)\)", done.stdout)
    assert got is not None, done.stdout
    assert got[1] == got[2] and float(got[1]) > 0.85  # chance is 0.1; 0.94 measured
    assert (tmp_path / "pipe" / "stages").is_dir()
    assert len(list((tmp_path / "runs").iterdir())) == 1
