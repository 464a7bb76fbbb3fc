"""`sparknet-submit evaluate` and `predict`: a finished run's model scored on a cluster, as a
user runs them (subprocesses). The run is trained on this machine (a local run dir, which the
nodes could never read: the submit copies the model into the job's run prefix); the cluster is
a static one on two real sshd on 127.0.0.1 whose bootstrap starts a real Spark standalone
cluster (test_submit_static.py's hosts), and the dataset lies in moto's S3. Stand-in, as there:
the hosts' SSH sessions get moto's endpoint and fake credentials.
"""

from __future__ import annotations

import json
import subprocess

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, SPARKNET
from tests.jobs.test_submit import JOB, dataset, shards, submit  # noqa: F401 (fixtures)
from tests.jobs.test_submit_static import ADDRESSES, static_settings  # noqa: F401 (fixture)
from tests.sshd import daemon_pids

pytestmark = pytest.mark.integration


def _train_here(shards, out) -> None:  # noqa: F811
    done = subprocess.run(
        [str(SPARKNET), "train", "--data", str(shards), "--out", str(out), *JOB,
         "--master", "local[2]"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_a_local_run_is_evaluated_and_predicts_on_a_static_cluster(
    static_settings,  # noqa: F811
    shards,  # noqa: F811
    bucket,
    moto_endpoint,
    tmp_path,
):
    name = static_settings
    run = tmp_path / "run"
    _train_here(shards, run)
    here = subprocess.run(
        [str(SPARKNET), "evaluate", str(run), "--data", str(shards), "--report",
         str(tmp_path / "report")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert here.returncode == 0, here.stderr[-3000:]
    want = json.loads((tmp_path / "report" / "evaluation.json").read_text())

    # refused before anything starts, one line, exit 2: no such run, a local --out, a split the
    # dataset does not have
    refusals = {
        ("evaluate", str(tmp_path / "nope")): "no such run dir here, nor a job of",
        ("predict", str(run), "--out", "parquet:/tmp/p"): "a cluster writes predictions to S3",
        ("evaluate", str(run), "--split", "test"): "has no split 'test' (it has: train, val)",
    }
    for args, why in refusals.items():
        refused = submit(*args, "--s3", "tiny", "--provider", "static", "--name", name,
                         cwd=tmp_path, timeout=120)  # fmt: skip
        assert refused.returncode == 2 and why in refused.stderr, (args, refused.stderr)
        assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert daemon_pids(tmp_path, ADDRESSES) == {}

    # evaluate: the cluster is made for the job and kept; top-1 as this machine's evaluation
    done = submit("evaluate", str(run), "--s3", "tiny", "--provider", "static", "--name", name,
                  "--keep", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(ln.split(": ", 1) for ln in done.stdout.splitlines() if ln.startswith("run "))
    run_id, prefix = out["run id"], out["run prefix"]
    assert prefix == f"s3://{bucket}/runs/{name}/{run_id}/"
    got = json.loads((tmp_path / "runs" / run_id / "evaluation.json").read_text())
    assert (got["samples"], got["top1"], got["confusion"]) == (
        want["samples"], want["top1"], want["confusion"],
    )  # fmt: skip
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert (tmp_path / "runs" / run_id / "confusion.png").read_bytes()[:4] == b"\x89PNG"
    top1 = [ln for ln in done.stdout.splitlines() if "top-1" in ln]
    assert len(top1) == 1 and f"{want['top1']:.4f}" in top1[0], done.stdout
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    keys = {
        o["Key"].rsplit("/", 1)[-1]
        for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"runs/{name}/{run_id}/")["Contents"]
    }
    assert {"model.json", "model.safetensors", "config.yaml", "evaluation.json"} <= keys
    assert sorted(daemon_pids(tmp_path, ADDRESSES)) == ["master/master", "master/worker",
                                                       "worker-1/worker"]  # fmt: skip

    # predict on the kept cluster, detached, then attached to: a row per val sample, into the
    # job's run prefix
    detached = submit("predict", str(run), "--s3", "tiny", "--cluster", name, "--top-k", "2",
                      "--detach", cwd=tmp_path)  # fmt: skip
    assert detached.returncode == 0, detached.stderr[-3000:]
    run_id = dict(ln.split(": ", 1) for ln in detached.stdout.splitlines())["run id"]
    done = submit("attach", run_id, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(ln.split(": ", 1) for ln in done.stdout.splitlines() if ": " in ln)
    assert out["run id"] == run_id
    target = f"s3://{bucket}/runs/{name}/{run_id}/predictions"
    assert (out["predictions"], out["rows"]) == (f"parquet:{target}", str(want["samples"]))
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=target.split("/", 3)[3] + "/")["Contents"]
    parts = [
        pq.read_table(pa.BufferReader(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()))
        for o in listed
        if o["Key"].endswith(".parquet")
    ]
    table = pa.concat_tables(parts).to_pandas()
    assert len(table) == want["samples"] and len(table["top_k"][0]) == 2
    right = sum(int(row.prediction == row.label) for row in table.itertuples())
    assert right / len(table) == want["top1"]
    assert f"cluster {name} stays up" in detached.stderr
