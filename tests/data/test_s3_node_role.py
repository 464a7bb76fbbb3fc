"""A missing object reads as missing to the nodes on AWS, where S3 answers its GET or HEAD with
403: the node role's s3:ListBucket holds only for the prefixes it names (`s3:prefix`), and a GET
carries none (tests/s3_role_front.py answers as S3 does under that role). The readers then list
the key itself, which the role allows under its own prefixes, and tell "missing" from "denied".
"""

from __future__ import annotations

import time

import boto3
import botocore.exceptions as bx
import numpy as np
import pytest
import torch

from sparknet.cluster.aws.rules import policy_document
from sparknet.data.s3 import S3Uri, open_object
from sparknet.data.store import MissingObjectError, S3Store, load_manifest
from sparknet.errors import SparknetError
from sparknet.training import checkpoint
from sparknet.training.rundir import S3Lock
from sparknet.training.state import StateLayout
from tests.s3_role_front import RoleFront, allowed

CLUSTER = "demo"
RUN = f"runs/{CLUSTER}/run-1"


@pytest.fixture
def front(moto_endpoint, bucket):
    """The suite's moto server as the node role of cluster `demo` sees it (data under
    `datasets/`, its runs under `runs/demo/`)."""
    policy = policy_document(
        "instance-role", partition="aws", region="us-east-1", account="123456789012",
        bucket=bucket, data_prefix="datasets/", runs_prefix="runs/", cluster=CLUSTER,
    )  # fmt: skip
    with RoleFront(moto_endpoint, policy) as f:
        yield f


@pytest.fixture
def s3(moto_endpoint):
    """moto itself, with no role in the way: where the tests put what the nodes then read."""
    return boto3.client("s3", endpoint_url=moto_endpoint)


def test_front_answers_as_s3_answers_the_node_role(front, bucket, s3) -> None:
    """What the readers meet on AWS: 403 for a GET or HEAD of a missing key, lists allowed only
    under the role's prefixes (and never of the whole bucket)."""
    s3.put_object(Bucket=bucket, Key=f"{RUN}/there", Body=b"x")
    node = boto3.client("s3", endpoint_url=front.url)
    assert node.get_object(Bucket=bucket, Key=f"{RUN}/there")["Body"].read() == b"x"
    for call in (node.get_object, node.head_object):
        with pytest.raises(bx.ClientError) as caught:
            call(Bucket=bucket, Key=f"{RUN}/missing")
        assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert front.missing_as_denied == 2
    listed = node.list_objects_v2(Bucket=bucket, Prefix=f"{RUN}/there")
    assert [o["Key"] for o in listed["Contents"]] == [f"{RUN}/there"]
    node.list_objects_v2(Bucket=bucket, Prefix="datasets/imagenet/")
    for prefix in ({}, {"Prefix": "runs/"}, {"Prefix": "runs/other/"}, {"Prefix": "x/"}):
        with pytest.raises(bx.ClientError, match="AccessDenied"):
            node.list_objects_v2(Bucket=bucket, **prefix)


def test_store_reads_a_missing_object_as_missing(front, bucket, s3) -> None:
    s3.put_object(Bucket=bucket, Key=f"{RUN}/there", Body=b"12345")
    s3.put_object(Bucket=bucket, Key=f"{RUN}/missing.d/inside", Body=b"a longer key")
    store = S3Store(f"s3://{bucket}/{RUN}", front.url)
    assert store.size("there") == 5
    assert store.read_bytes("there") == b"12345"
    # "missing" is a prefix of another key: only the key itself counts as there
    for name in ("missing", "missing.d"):
        assert store.head(name) is None
        assert store.size(name) is None
        with pytest.raises(MissingObjectError, match=f"s3://{bucket}/{RUN}/{name} does not"):
            store.read_bytes(name)
    with pytest.raises(MissingObjectError):
        open_object(S3Uri(bucket, f"{RUN}/missing"), 3, front.url)
    assert front.missing_as_denied >= 7


def test_fetch_of_a_missing_object_is_missing(front, bucket, tmp_path) -> None:
    store = S3Store(f"s3://{bucket}/datasets/digits", front.url)
    with pytest.raises(MissingObjectError):
        store.fetch("shard-000000.tar", tmp_path / "shard.tar")
    assert list(tmp_path.iterdir()) == []


def test_what_the_role_may_not_read_still_reads_denied(front, bucket, s3) -> None:
    """Outside the role's prefixes the list is refused too: present or not, it is "denied",
    never "missing"; and an object the list finds stays "denied"."""
    s3.put_object(Bucket=bucket, Key="elsewhere/there", Body=b"x")
    for key in ("elsewhere/there", "elsewhere/missing", "runs/other/run-1/config.yaml"):
        store = S3Store(f"s3://{bucket}/{key.rpartition('/')[0]}", front.url)
        with pytest.raises(SparknetError, match="denied") as caught:
            store.read_bytes(key.rpartition("/")[2])
        assert not isinstance(caught.value, MissingObjectError)
        with pytest.raises(SparknetError, match="denied"):
            store.head(key.rpartition("/")[2])


def test_dataset_without_manifest_says_so(front, bucket) -> None:
    store = S3Store(f"s3://{bucket}/datasets/imagenet", front.url)
    with pytest.raises(SparknetError, match=r"has no manifest\.json"):
        load_manifest(store)


def test_checkpoint_without_optional_files_loads(front, bucket, moto_endpoint) -> None:
    """A checkpoint of a run without outer momentum (`average`) and without inner states
    (`inner_state: reset`): its absent files are absent, not a failed stage."""
    model = torch.nn.Linear(3, 2)
    layout = StateLayout.of_model(model)
    theta = layout.flatten(model.state_dict())
    writer = S3Store(f"s3://{bucket}/{RUN}", moto_endpoint)
    checkpoint.write(writer, 4, layout, theta, layout.integers(model.state_dict()), None, 1.5,
                     "train: {}\n")  # fmt: skip
    reader = S3Store(f"s3://{bucket}/{RUN}", front.url)
    loaded = checkpoint.load(reader, 4, layout)
    assert loaded.outer_momentum is None and loaded.rounds == 4
    np.testing.assert_array_equal(loaded.theta, theta)
    assert checkpoint.read_inner(f"s3://{bucket}/{RUN}", 4, 0, endpoint_url=front.url) is None
    assert front.missing_as_denied >= 2


def test_lock_reads_as_lost_when_its_object_is_gone(front, bucket, s3) -> None:
    lock = S3Lock(S3Store(f"s3://{bucket}/{RUN}", front.url))
    lock.acquire()
    try:
        assert not lock.lost
        s3.delete_object(Bucket=bucket, Key=f"{RUN}/.sparknet-lock")
        lock._recheck(time.monotonic())
        assert lock.lost
    finally:
        lock.release()


def test_role_may_list_wherever_it_may_read() -> None:
    """The readers' list of a key is allowed wherever the role may read it: each prefix the role
    reads under is one it may list, so no missing object there stays "denied"."""
    policy = policy_document(
        "instance-role", partition="aws", region="us-east-1", account="123456789012",
        bucket="b", data_prefix="datasets/", runs_prefix="runs/", cluster=CLUSTER,
    )  # fmt: skip
    reads = [
        resource.removeprefix("arn:aws:s3:::b/")
        for st in policy["Statement"]
        if "s3:GetObject" in _listed(st["Action"])
        for resource in _listed(st["Resource"])
    ]
    assert reads == ["datasets/*", f"runs/{CLUSTER}/*"]
    for prefix in reads:
        key = prefix.replace("*", "checkpoints/round-00004/inner/part-00000.pt")
        assert allowed(policy, "s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": key}), prefix
    assert not allowed(policy, "s3:ListBucket", "arn:aws:s3:::b", {})


def _listed(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)
