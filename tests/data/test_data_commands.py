"""`sparknet data ...` and `--data` as a user meets them: a bucket for a new account
(`upload --create-bucket`, on moto's server), an ImageFolder sharded with a held-out val, sizes
under 1 MiB, and a path that is not there. Real subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import boto3
import botocore.exceptions as bx
import pytest

from sparknet.cli.common import sized
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
    assert line == "error: no such directory: ./nope-dir", line
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


@pytest.mark.parametrize("region", [None, "eu-west-1"], ids=["default-us-east-1", "eu-west-1"])
def test_create_bucket_makes_it_as_cluster_up_does(dataset, moto_endpoint, region):
    """The foundation's own settings: KMS, no public access, versioned; in its region, which
    CreateBucket names as AWS requires (no LocationConstraint for us-east-1, one elsewhere:
    moto refuses both mistakes as AWS does). Over moto's plain http the TLS-only policy, which
    would deny this very upload, is left out, and a note says so (over https it stays: the
    foundation's own test)."""
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
    with pytest.raises(bx.ClientError, match="NoSuchBucketPolicy"):
        s3.get_bucket_policy(Bucket=name)
    assert f"is plain http, so bucket {name} has no TLS-only policy" in done.stderr
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


#: an endpoint nothing listens on: a command that made any AWS call would fail on it otherwise
NO_AWS = ["--endpoint-url", "http://127.0.0.1:9"]


@pytest.mark.parametrize(
    ("bucket", "why"),
    [
        ("Upper_Case", "3-63 of a-z"),
        ("under_score", "3-63 of a-z"),
        ("192.168.1.1", "not an IP address"),
        ("bad..dots", "no '..'"),
        ("xn--foo", "none of S3's reserved prefixes"),
        ("foo-s3alias", "none of S3's reserved prefixes"),
    ],
)
@pytest.mark.parametrize("create", [True, False], ids=["create-bucket", "plain"])
def test_a_bucket_name_s3_refuses_is_one_line(dataset, bucket, why, create, moto_endpoint):
    """A bucket to make is refused before any AWS call; without --create-bucket S3 is asked
    first (a bucket of an older name S3 once allowed may be there), and a missing one of a
    name S3 refuses is named as that, not as one --create-bucket could make."""
    more = ["--create-bucket", *NO_AWS] if create else ["--endpoint-url", moto_endpoint]
    done = run("data", "upload", str(dataset), f"s3://{bucket}/ds", *more, cwd=dataset)
    line = error_line(done)
    assert done.returncode == 2 and f"{bucket!r} is not an S3 bucket name: {why}" in line, line
    assert "does not exist" not in line


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--region", "EU"], {}),
        (["--region", "eu-west-9"], {}),
        ([], {"AWS_DEFAULT_REGION": "eu-west-9"}),
    ],
    ids=["EU", "eu-west-9", "configured-eu-west-9"],
)
def test_an_unknown_region_is_one_line_before_any_aws_call(dataset, args, env):
    done = subprocess.run(
        [str(SPARKNET), "data", "upload", str(dataset), "s3://probe-eu/ds", "--create-bucket",
         *args, *NO_AWS],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    line = error_line(done)
    assert done.returncode == 2 and "is not an AWS region" in line, line


def _settings(s3, name: str) -> tuple[str | None, str]:
    """A bucket's versioning status and its default encryption ("" for none)."""
    try:
        rules = s3.get_bucket_encryption(Bucket=name)["ServerSideEncryptionConfiguration"]
        sse = rules["Rules"][0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"]
    except bx.ClientError:
        sse = ""
    return s3.get_bucket_versioning(Bucket=name).get("Status"), sse


def test_ctrl_c_while_the_bucket_is_made_leaves_one_a_rerun_completes(dataset, aws_faults):
    """S3 does not show a new bucket to every call at once (NoSuchBucket for a moment): the tag
    is asked again, and a Ctrl-C meanwhile waits for it. The bucket left is tagged as
    sparknet's, so the next run (which finds it "there already") gives it its settings."""
    name = f"new-{uuid.uuid4().hex[:12]}"
    aws_faults.fail("s3:PutBucketTagging", "NoSuchBucket", times=3, status=404)
    proc = subprocess.Popen(
        [str(SPARKNET), "data", "upload", str(dataset), f"s3://{name}/ds", "--create-bucket"],
        env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not aws_faults.codes() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # within the 3 s of retries that 3 NoSuchBucket take
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    s3 = boto3.client("s3")
    tags = {t["Key"]: t["Value"] for t in s3.get_bucket_tagging(Bucket=name)["TagSet"]}
    assert tags["sparknet:cluster"] == "data-upload", tags
    aws_faults.clear()
    again = run("data", "upload", str(dataset), f"s3://{name}/ds", "--create-bucket", cwd=dataset)
    assert again.returncode == 0, again.stderr
    assert f"bucket {name}: there already, in us-east-1" in again.stderr
    assert _settings(s3, name) == ("Enabled", "aws:kms")


def test_a_bucket_that_cannot_be_tagged_is_not_left_behind(dataset, aws_faults):
    """A denied PutBucketTagging would leave a bucket every later run takes for the user's own
    (never hardened): it is deleted again, and the line says why."""
    name = f"new-{uuid.uuid4().hex[:12]}"
    aws_faults.fail("s3:PutBucketTagging", "AccessDenied", status=403)
    done = run("data", "upload", str(dataset), f"s3://{name}/ds", "--create-bucket", cwd=dataset)
    assert "AccessDenied" in error_line(done) or "denied" in error_line(done)
    with pytest.raises(bx.ClientError):
        boto3.client("s3").head_bucket(Bucket=name)


def test_a_bucket_another_run_made_first_is_there_already(dataset, aws_faults):
    """Two runs outside us-east-1: both look (404), one creates, the other's CreateBucket is
    answered BucketAlreadyOwnedByYou (moto's own answer); that one goes on and holds it to the
    settings, as for any bucket of ours."""
    name = f"new-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", region_name="eu-west-1")
    s3.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    s3.put_bucket_tagging(Bucket=name, Tagging={"TagSet": [
        {"Key": "sparknet:cluster", "Value": "data-upload"},
        {"Key": "sparknet:role", "Value": "foundation"},
    ]})  # fmt: skip
    aws_faults.fail("s3:HeadBucket", "404", status=404)  # it looked before the other made it
    done = run(
        "data", "upload", str(dataset), f"s3://{name}/ds", "--create-bucket", "--region",
        "eu-west-1", cwd=dataset,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"bucket {name}: there already, in eu-west-1" in done.stderr
    assert _settings(s3, name) == ("Enabled", "aws:kms")


def test_a_bucket_in_another_region_than_asked_names_its_own(dataset, bucket):
    done = run(
        "data", "upload", str(dataset), f"s3://{bucket}/ds", "--create-bucket", "--region",
        "eu-west-1", cwd=dataset,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"bucket {bucket}: there already, in us-east-1, not eu-west-1" in done.stderr


def test_a_tls_only_policy_put_over_http_before_is_taken_off(dataset, moto_endpoint):
    """A sparknet bucket that got the TLS-only policy over plain http (an older sparknet) denied
    every later upload: the next run takes it off, and the upload goes through."""
    from sparknet.cluster.aws.boto3_foundation import Boto3Foundation
    from sparknet.cluster.spec import ClusterSpec

    name = f"new-{uuid.uuid4().hex[:12]}"
    spec = ClusterSpec(name="data-upload", region="us-east-1", bucket=name, owner="me")
    Boto3Foundation(spec, moto_endpoint).bucket(name)  # tls_only: as before
    assert boto3.client("s3").get_bucket_policy(Bucket=name)["Policy"]
    done = run("data", "upload", str(dataset), f"s3://{name}/ds", "--create-bucket", cwd=dataset)
    assert done.returncode == 0, done.stderr
    with pytest.raises(bx.ClientError, match="NoSuchBucketPolicy"):
        boto3.client("s3").get_bucket_policy(Bucket=name)


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_ls_and_verify_say_a_parquet_frame_is_not_a_shard_dataset(tmp_path, command):
    line = error_line(run("data", command, "parquet:/nope", cwd=tmp_path))
    assert "parquet:/nope is a DataFrame, not a shard dataset" in line, line
    assert "parquet: and table: are for the --data of train, evaluate and predict" in line


@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1048575, "1.0 MiB"),
        (1048524, "1023.9 KiB"),
        (1073741823, "1.0 GiB"),
        (5 * 2**40, "5.0 TiB"),
    ],
)
def test_sized_moves_to_the_next_unit_where_the_rounded_value_reaches_1024(n, shown):
    assert sized(n) == shown
