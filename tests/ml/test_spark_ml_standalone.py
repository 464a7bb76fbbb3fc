"""The Spark ML stages, `sparknet evaluate` and `sparknet predict` on the shared standalone cluster
(two 1-core workers on 127.0.0.1, their executors other processes): a Pipeline fits with run dirs
on S3 (moto), transforms on the executors as torch computes it, is saved, its run dir deleted,
loaded and transforms again; evaluate and predict give the run's own final figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import boto3
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, SPARKNET

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


def test_evaluate_and_predict_run_on_a_cluster_as_they_run_locally(standalone, digits_run,
                                                                   tmp_path):  # fmt: skip
    """Through the CLI with `--master spark://...`: the executors are other processes, and the
    figures are the run's own final evaluation all the same."""
    run, final = digits_run
    where = ("--data", "digits", "--master", standalone.master)
    done = subprocess.run(
        [str(SPARKNET), "evaluate", str(run), *where, "--report", str(tmp_path / "report")],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "evaluation.json").read_text())
    assert (report["top1"], report["samples"]) == (final["eval_accuracy"], final["eval_samples"])
    done = subprocess.run(
        [str(SPARKNET), "predict", str(run), *where, "--out", f"parquet:{tmp_path / 'p'}"],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table = pq.read_table(tmp_path / "p").to_pandas()
    assert len(table) == 360
    assert (table["prediction"] == table["label"]).mean() == final["eval_accuracy"]
