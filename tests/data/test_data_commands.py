"""`sparknet data ...` and `--data` as a user meets them: a bucket for a new account
(`upload --create-bucket`, on moto's server), an ImageFolder sharded with a held-out val, sizes
under 1 MiB, and a path that is not there. Real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import boto3
import botocore.exceptions as bx
import pytest

from sparknet.data.manifest import MANIFEST_NAME, Manifest
from sparknet.data.sources import check_frame_path
from sparknet.errors import SparknetError
from tests.conftest import SPARKNET
from tests.data.test_image_folder import make_folder

pytestmark = pytest.mark.integration


def run(*args: str, cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SPARKNET), *args], cwd=cwd, env=os.environ.copy(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def error_line(done: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints (lower- or upper-case `error:`), exit non-zero."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0].lower().startswith("error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A dataset of a few KiB: an ImageFolder of 18 images, 4 train shards, val held out."""
    root = tmp_path_factory.mktemp("cmds")
    make_folder(root / "photos")
    done = run(
        "data", "shard", "photos", "ds", "--val-fraction", "0.3", "--shards", "4", "--seed", "2",
        "--processes", "1", cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "val: 0.3 of each class held out of train, seed 2" in done.stdout, done.stdout
    return root / "ds"


def test_an_image_folder_shards_into_n_shards_with_its_val_recorded(dataset):
    m = Manifest.loads((dataset / MANIFEST_NAME).read_text(), "manifest")
    assert len(m.shards("train")) == 4
    assert (m.held_out.fraction, m.held_out.seed) == (0.3, 2)
    assert m.samples("val") == 3 + 2 + 1 and [c.wnid for c in m.classes] == ["cat", "dog", "emu"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--shards", "2", "--shard-mb", "4"], "--shards and --shard-mb both size the shards"),
        (["--val-fraction", "1.5"], "--val-fraction 1.5 must be above 0 and below 1"),
    ],
)
def test_shard_options_that_cannot_work_are_one_line(tmp_path, args, needle):
    make_folder(tmp_path / "photos")
    assert needle in error_line(run("data", "shard", "photos", "ds", *args, cwd=tmp_path))
    assert not (tmp_path / "ds").exists()


def test_shard_to_s3_is_refused_instead_of_writing_a_local_s3_dir(tmp_path):
    make_folder(tmp_path / "photos")
    line = error_line(run("data", "shard", "photos", "s3://bkt/ds", cwd=tmp_path))
    assert "writes to a local directory" in line and "sparknet data upload DIR s3://bkt/ds" in line
    assert not (tmp_path / "s3:").exists()


def test_ls_shows_a_small_dataset_in_kib(dataset):
    done = run("data", "ls", str(dataset), cwd=dataset.parent)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "train" in line or "val" in line]
    assert len(rows) == 2 and all(row.split()[-2] == "KiB" for row in rows), done.stdout
    assert " size " in done.stdout and "MiB" not in done.stdout, done.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["data", "ls", "./nope-dir"],
        ["data", "verify", "./nope-dir"],
        ["data", "upload", "./nope-dir", "s3://bkt/ds"],
        ["data", "shard", "./nope-dir", "ds"],
        ["train", "--data", "./nope-dir", "--out", "run"],
    ],
    ids=["ls", "verify", "upload", "shard", "train"],
)
def test_a_data_dir_that_is_not_there_is_one_line(tmp_path, command):
    line = error_line(run(*command, cwd=tmp_path))
    assert "no such directory" in line and "nope-dir" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run dir, no dataset dir


def test_a_parquet_path_that_is_not_there_is_refused_before_spark(tmp_path):
    done = run("train", "--data", "parquet:./nope.parquet", "--out", "run", cwd=tmp_path)
    line = error_line(done)
    assert "parquet:./nope.parquet: no such file or directory" in line, line
    assert "Spark" not in done.stderr and not (tmp_path / "run").exists()


def test_a_parquet_prefix_without_objects_is_refused(bucket, moto_endpoint, tmp_path):
    with pytest.raises(SparknetError, match=f"no object at s3://{bucket}/frames"):
        check_frame_path(f"parquet:s3://{bucket}/frames", moto_endpoint)
    boto3.client("s3").put_object(Bucket=bucket, Key="frames/part-0.parquet", Body=b"x")
    check_frame_path(f"parquet:s3://{bucket}/frames", moto_endpoint)  # there: Spark reads it
    (tmp_path / "t.parquet").write_bytes(b"x")
    check_frame_path(f"parquet:{tmp_path / 't.parquet'}")
    check_frame_path("table:nope")  # a table is Spark's to find


def test_upload_to_a_missing_bucket_names_create_bucket(dataset, moto_endpoint):
    name = f"new-{uuid.uuid4().hex[:12]}"
    line = error_line(run("data", "upload", str(dataset), f"s3://{name}/ds", cwd=dataset.parent))
    assert f"bucket {name} does not exist: pass --create-bucket (and --region)" in line, line
    with pytest.raises(bx.ClientError):
        boto3.client("s3").head_bucket(Bucket=name)


#: the foundation bucket policy's one condition: a request without TLS is denied
TLS_ONLY = {"Bool": {"aws:SecureTransport": "false"}}


@pytest.fixture
def as_over_tls(moto_endpoint, monkeypatch):
    """moto's server (in this process) takes its plain-HTTP requests for the HTTPS ones they
    stand for: it evaluates no condition, so the TLS-only statement would deny every write to
    a foundation bucket. That statement alone is left out of its check; any other stays."""
    from moto.iam.access_control import IAMPolicy, PermissionResult
    from moto.s3.models import FakeBucket

    def get_permission(self, action: str, resource: str):
        if self.policy is None:
            return PermissionResult.NEUTRAL
        doc = json.loads(self.policy)
        doc["Statement"] = [s for s in doc["Statement"] if s.get("Condition") != TLS_ONLY]
        if not doc["Statement"]:
            return PermissionResult.NEUTRAL
        return IAMPolicy(json.dumps(doc)).is_action_permitted(action, resource)

    monkeypatch.setattr(FakeBucket, "get_permission", get_permission)


@pytest.mark.parametrize("region", [None, "eu-west-1"], ids=["default-us-east-1", "eu-west-1"])
def test_create_bucket_makes_it_as_cluster_up_does(dataset, as_over_tls, region):
    """The foundation's own settings: KMS, no public access, TLS only; in its region, which
    CreateBucket names as AWS requires (no LocationConstraint for us-east-1, one elsewhere:
    moto refuses both mistakes as AWS does)."""
    name = f"new-{uuid.uuid4().hex[:12]}"
    more = ["--region", region] if region else []
    done = run(
        "data", "upload", str(dataset), f"s3://{name}/ds", "--create-bucket", *more,
        cwd=dataset.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"bucket {name}: made in {region or 'us-east-1'}" in done.stderr
    s3 = boto3.client("s3", region_name=region or "us-east-1")
    assert s3.get_bucket_location(Bucket=name).get("LocationConstraint") == region
    rules = s3.get_bucket_encryption(Bucket=name)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
    block = s3.get_public_access_block(Bucket=name)["PublicAccessBlockConfiguration"]
    assert block == dict.fromkeys(
        ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets"),
        True,
    )
    (deny,) = json.loads(s3.get_bucket_policy(Bucket=name)["Policy"])["Statement"]
    assert deny["Effect"] == "Deny"
    assert deny["Condition"] == TLS_ONLY
    assert s3.get_bucket_versioning(Bucket=name)["Status"] == "Enabled"
    assert s3.head_object(Bucket=name, Key=f"ds/{MANIFEST_NAME}")["ContentLength"] > 0
    again = run(  # the bucket is there now: made again by no one, the upload skips every shard
        "data", "upload", str(dataset), f"s3://{name}/ds", "--create-bucket", *more,
        cwd=dataset.parent,
    )  # fmt: skip
    assert again.returncode == 0 and "0 shards uploaded" in again.stdout, again.stderr
    assert f"bucket {name}: there already" in again.stderr


def test_create_bucket_leaves_a_users_own_bucket_as_it_is(dataset, bucket, moto_endpoint):
    done = run(
        "data", "upload", str(dataset), f"s3://{bucket}/ds", "--create-bucket",
        cwd=dataset.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with pytest.raises(bx.ClientError, match="NoSuchBucketPolicy"):
        boto3.client("s3").get_bucket_policy(Bucket=bucket)  # theirs: no policy put on it


def test_region_without_create_bucket_is_refused(dataset, tmp_path):
    done = run("data", "upload", str(dataset), "s3://b/ds", "--region", "eu-west-1", cwd=tmp_path)
    assert "--region is where --create-bucket makes the bucket" in error_line(done)
