"""The region of the S3 clients sparknet makes, and where a bucket says it lives.

A node has no region configured (no AWS_DEFAULT_REGION, no ~/.aws/config): boto3 then sends
every S3 request to us-east-1 and each client pays a redirect for a bucket elsewhere. The region
is not read from instance metadata, which off EC2 (a laptop, a static node) costs each process
seconds of timeouts: the bootstrap of an EC2 cluster gives its nodes' Pythons the cluster's
region (`steps.conf_pth`). IMDS is a link-local service of an EC2 host, so the suite's stand-in
(tests/imds.py) answers as IMDS does and records what was asked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest

from sparknet.cluster.address import Endpoint
from sparknet.cluster.spark import steps
from sparknet.cluster.spark.plan import Context, Facts, Node, Plan
from sparknet.cluster.spark.wheel import Wheel
from sparknet.data import s3
from sparknet.errors import SparknetError
from tests.cluster.test_bootstrap_parts import Recorder
from tests.imds import ImdsStandIn


@pytest.fixture
def bare_node_env(tmp_path, monkeypatch):
    """This process as a node sees AWS: no region in the environment or a config file."""
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_EC2_METADATA_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    imds = ImdsStandIn()
    yield imds
    imds.close()


def test_an_s3_client_without_a_region_asks_no_instance_metadata(
    moto_endpoint, bare_node_env, monkeypatch
):
    """Where metadata would answer (an EC2 node of another region), it is not asked: the
    region is boto3's own lookup's, which has none here."""
    bare_node_env.zones["i-0123456789abcdef0"] = "eu-west-1b"
    monkeypatch.setenv(
        "AWS_EC2_METADATA_SERVICE_ENDPOINT", bare_node_env.endpoint("i-0123456789abcdef0")
    )

    client = s3.client(moto_endpoint)

    assert bare_node_env.requests == []
    assert client.meta.region_name != "eu-west-1"


def pth_region(pth: str, tmp_path, env: dict[str, str]) -> str:
    """What AWS_DEFAULT_REGION and an S3 client's region are in a Python whose site dir holds
    the .pth line `pth` (as the node venv's site-packages does), started with `env`."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / steps.CONF_PTH).write_text(pth)
    code = (
        f"import site; site.addsitedir({str(site)!r}); import os; "
        "from sparknet.data import s3; "
        "print(os.environ.get('AWS_DEFAULT_REGION'), s3.client(os.environ['AWS_ENDPOINT_URL'])"
        ".meta.region_name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_ec2_nodes_pythons_get_the_clusters_region_from_the_bootstrap(
    moto_endpoint, bare_node_env, monkeypatch, tmp_path
):
    """The bootstrap of an EC2 cluster writes the cluster's region into the node venv's .pth
    (SparkConf's file), so every Python there (a driver, Spark's Python workers) makes its S3
    clients for that region, with no metadata read; a static cluster's gets none, and a region
    set on the node wins."""
    node = Node(Endpoint("master", "203.0.113.8"))
    plan = Plan((node,), Wheel(Path("w.whl"), "1", "d"), "s" * 32, region="eu-west-1")
    facts = Facts("ubuntu", 1000, 8, 1 << 20, True, ())
    files = steps.SparkConf(Context(plan, node, facts)).files(Recorder())
    (pth,) = [text for path, (text, _mode) in files.items() if path.endswith(steps.CONF_PTH)]
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", bare_node_env.endpoint("i-1"))
    env = dict(os.environ)

    assert pth_region(pth, tmp_path, env) == "eu-west-1 eu-west-1"
    assert pth_region(steps.conf_pth(node), tmp_path, env).startswith("None ")
    assert pth_region(pth, tmp_path, {**env, "AWS_DEFAULT_REGION": "ap-south-1"}) == (
        "ap-south-1 ap-south-1"
    )
    assert bare_node_env.requests == []


def test_a_configured_region_wins_and_asks_no_metadata(moto_endpoint, bare_node_env, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", bare_node_env.endpoint("i-1"))

    assert s3.client(moto_endpoint).meta.region_name == "ap-south-1"
    assert bare_node_env.requests == []


def test_bucket_region_reads_where_the_bucket_lives(moto_endpoint):
    name = f"far-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", region_name="us-east-1").create_bucket(
        Bucket=name, CreateBucketConfiguration={"LocationConstraint": "eu-central-1"}
    )

    assert s3.bucket_region(name, moto_endpoint) == "eu-central-1"
    assert s3.bucket_region(f"none-{uuid.uuid4().hex[:12]}", moto_endpoint) is None


def test_a_failed_headbucket_is_no_answer_not_no_bucket(moto_endpoint, aws_faults):
    """Throttled (S3's SlowDown 503, through the fault front) past the client's retries, a
    HeadBucket says nothing of where the bucket is, nor whether it exists: a one-line error,
    not the None of a bucket S3 answers 404 for."""
    name = f"slow-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=name)
    aws_faults.fail("s3:HeadBucket", "SlowDown", times=None)

    with pytest.raises(SparknetError) as failed:
        s3.bucket_region(name, os.environ["AWS_ENDPOINT_URL"])
    # a HEAD's answer has no body: S3's own code is not in it, only its status
    assert "failed: 503" in str(failed.value) and "\n" not in str(failed.value)
    assert ("HeadBucket", "SlowDown") in aws_faults.injected


def test_only_aws_s3_has_regions_to_compare(moto_endpoint):
    """A store that speaks S3's API elsewhere (MinIO reports us-east-1 whatever it is told)
    is no AWS region's: AWS's own endpoints and the one this process's AWS calls go to are."""
    assert s3.on_aws_s3(None)
    assert s3.on_aws_s3("https://s3.eu-west-1.amazonaws.com")
    assert s3.on_aws_s3(moto_endpoint)  # AWS_ENDPOINT_URL: the suite's AWS
    assert not s3.on_aws_s3("http://minio.internal:9000")
