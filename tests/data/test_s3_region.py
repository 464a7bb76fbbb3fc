"""The region of the S3 clients a node makes, and where a bucket says it lives.

A node has no region configured (no AWS_DEFAULT_REGION, no ~/.aws/config): boto3 then sends
every S3 request to us-east-1 and each client pays a redirect for a bucket elsewhere. The node's
own region comes from its instance metadata; IMDS is a link-local service of an EC2 host, so the
suite's stand-in (tests/imds.py) answers the placement as IMDS does.
"""

from __future__ import annotations

import uuid

import boto3
import pytest

from sparknet.data import s3
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


def test_a_nodes_s3_client_takes_the_region_of_its_instance(
    moto_endpoint, bare_node_env, monkeypatch
):
    bare_node_env.zones["i-0123456789abcdef0"] = "eu-west-1b"
    monkeypatch.setenv(
        "AWS_EC2_METADATA_SERVICE_ENDPOINT", bare_node_env.endpoint("i-0123456789abcdef0")
    )

    client = s3.client(moto_endpoint)

    assert client.meta.region_name == "eu-west-1"
    assert any("placement/availability-zone" in path for _m, path in bare_node_env.requests)


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
