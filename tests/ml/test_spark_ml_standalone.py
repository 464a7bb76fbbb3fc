"""The Spark ML stages on the shared standalone cluster (two 1-core workers on 127.0.0.1, their
executors other processes), with run dirs on S3 (moto): fit in a Pipeline, transform on the
executors as torch computes it, save, delete the run dir, load and transform again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import boto3
import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_a_pipeline_fits_and_predicts_on_a_cluster_from_an_s3_run_dir(
    standalone, bucket, moto_endpoint, tmp_path
):
    runs = f"s3://{bucket}/runs"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ml.pipeline_on_cluster", standalone.master, runs,
         str(tmp_path / "pipeline")],
        cwd=REPO, capture_output=True, text=True, timeout=400,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["run"].startswith(f"{runs}/mlp-")
    assert got["equal_torch"] and got["prob_gap"] < 1e-6
    assert got["accuracy"] > 0.8
    assert got["loaded_equal"] and got["deleted"] >= 4
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    assert s3.list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0
    assert (tmp_path / "pipeline" / "stages").is_dir()
