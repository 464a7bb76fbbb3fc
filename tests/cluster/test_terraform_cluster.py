"""`foundation: terraform` as a user runs it: infra/ itself (not a copy) applied on moto's server
through `ensure_terraform` / `destroy_terraform` and through `sparknet cluster up`, with the AWS
provider from ``$SPARKNET_TF_PLUGIN_DIR`` (init -plugin-dir: no registry here) and moto reached
through ``AWS_ENDPOINT_URL``, which the provider honours as boto3 does.

Slow: an apply takes about a minute on moto; without the provider directory the module skips.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import boto3
import pytest
import yaml

from sparknet.cluster import registry
from sparknet.cluster.aws import foundation
from sparknet.cluster.aws.boto3_foundation import permissions
from sparknet.cluster.aws.boto3_teardown import destroy_boto3
from sparknet.cluster.aws.foundation import node_role_name
from sparknet.cluster.aws.terraform_foundation import (
    PLUGIN_DIR_ENV,
    TERRAFORM_KINDS,
    destroy_terraform,
    ensure_terraform,
)
from sparknet.cluster.spec import TAG_CLUSTER, ClusterSpec
from tests.cluster.test_terraform_apply import PLUGIN_DIR, pytestmark  # noqa: F401
from tests.conftest import SPARKNET
from tests.moto_server import amazon_ami

REGION = "us-east-1"
OWNER = "arn:aws:iam::123456789012:user/alice"


@pytest.fixture
def tf_spec(moto_endpoint, tmp_path, monkeypatch):
    """A fresh terraform-foundation cluster; whatever a test leaves of it is removed by tag."""
    monkeypatch.setenv(PLUGIN_DIR_ENV, str(PLUGIN_DIR))
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    name = f"t{uuid.uuid4().hex[:8]}"
    spec = ClusterSpec(
        name=name, region=REGION, bucket=f"{name}-data", foundation="terraform", owner=OWNER
    )
    yield spec
    ec2 = boto3.client("ec2", region_name=REGION)
    tagged = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]}]
    ids = [
        i["InstanceId"]
        for r in ec2.describe_instances(Filters=tagged)["Reservations"]
        for i in r["Instances"]
    ]
    if ids:
        ec2.terminate_instances(InstanceIds=ids)
    destroy_boto3(spec, endpoint_url=moto_endpoint)


def left_of(spec: ClusterSpec) -> list[str]:
    """Every foundation resource still there with the cluster's tag (IAM: by name)."""
    ec2 = boto3.client("ec2", region_name=REGION)
    tagged = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    calls = [
        ("vpc", ec2.describe_vpcs, "Vpcs", "VpcId"),
        ("subnet", ec2.describe_subnets, "Subnets", "SubnetId"),
        ("internet-gateway", ec2.describe_internet_gateways, "InternetGateways",
         "InternetGatewayId"),
        ("route-table", ec2.describe_route_tables, "RouteTables", "RouteTableId"),
        ("security-group", ec2.describe_security_groups, "SecurityGroups", "GroupId"),
        ("vpc-endpoint", ec2.describe_vpc_endpoints, "VpcEndpoints", "VpcEndpointId"),
    ]  # fmt: skip
    left = [
        f"{kind}:{item[id_key]}"
        for kind, call, key, id_key in calls
        for item in call(Filters=tagged)[key]
        if item.get("State", "").lower() not in ("deleted", "deleting")
        and item.get("GroupName") != "default"
    ]
    iam = boto3.client("iam", region_name=REGION)
    name = node_role_name(spec)
    roles = iam.list_roles()["Roles"]
    profiles = iam.list_instance_profiles()["InstanceProfiles"]
    left += [f"iam-role:{name}" for r in roles if r["RoleName"] == name]
    left += [f"instance-profile:{name}" for p in profiles if p["InstanceProfileName"] == name]
    return left


def test_destroy_lists_what_went_and_removes_what_terraform_did_not_hold(
    tf_spec, moto_endpoint, tmp_path
):
    """Issue 9 probe, points 2, 14a, 14c, 14e, 14i: infra/ applied with providers from
    SPARKNET_TF_PLUGIN_DIR; its group has the boto3 foundation's Name tag and an SSH rule
    description true for a /16; `destroy_terraform` then also removes a tagged gateway that
    Terraform never held, and lists real resources only (no bucket, no output names)."""
    spec, state = tf_spec, tmp_path / "state"
    wide = "198.51.0.0/16"
    base = ensure_terraform(spec, allowed_cidr=wide, state_dir=state, endpoint_url=moto_endpoint)
    ec2 = boto3.client("ec2", region_name=REGION)
    group = ec2.describe_security_groups(GroupIds=[base.security_group_id])["SecurityGroups"][0]
    assert {t["Key"]: t["Value"] for t in group["Tags"]}["Name"] == f"sparknet-{spec.name}"
    (ssh,) = [p for p in group["IpPermissions"] if p.get("FromPort") == 22]
    (want,) = [p for p in permissions("ingress", "sg", wide) if p.get("FromPort") == 22]
    assert ssh["IpRanges"] == want["IpRanges"]
    assert wide in ssh["IpRanges"][0]["Description"]
    # what a boto3 `up` of the same name, or an apply cut short before it wrote its state, leaves
    stray = ec2.create_internet_gateway(
        TagSpecifications=[{"ResourceType": "internet-gateway", "Tags": foundation.tags(spec)}]
    )["InternetGateway"]["InternetGatewayId"]

    gone = destroy_terraform(spec, state_dir=state, endpoint_url=moto_endpoint)

    assert left_of(spec) == []
    role = node_role_name(spec)
    assert {
        f"vpc:{base.vpc_id}", f"security-group:{base.security_group_id}",
        f"iam-role:{role}", f"instance-profile:{role}", f"internet-gateway:{stray}",
        *(f"subnet:{s}" for s in base.subnet_by_az.values()),
    } <= set(gone)  # fmt: skip
    kinds = set(TERRAFORM_KINDS.values())
    assert all(item.partition(":")[0] in kinds for item in gone), gone
    assert len(gone) == len(set(gone))
    # the bucket is kept, and said to be
    assert boto3.client("s3", region_name=REGION).head_bucket(Bucket=spec.bucket)


def _settings(spec: ClusterSpec, folder) -> None:
    entry = {
        "region": REGION, "foundation": "terraform", "bucket": spec.bucket, "workers": 1,
        "instance_types": ["g4dn.xlarge"], "master_type": "g5.xlarge",
        "allowed_cidr": "203.0.113.9/32",
    }  # fmt: skip
    (folder / "sparknet.yaml").write_text(yaml.safe_dump({"clusters": {spec.name: entry}}))


def _wait_for_vpc(spec: ClusterSpec, proc: subprocess.Popen, timeout_s: float) -> None:
    """Return once the apply has made the cluster's VPC (it is then mid-apply)."""
    ec2 = boto3.client("ec2", region_name=REGION)
    tagged = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    deadline = time.monotonic() + timeout_s
    while not ec2.describe_vpcs(Filters=tagged)["Vpcs"]:
        if proc.poll() is not None:
            raise AssertionError(f"up ended before its apply made a VPC: {proc.communicate()}")
        assert time.monotonic() < deadline, "no VPC within the time an apply takes to make one"
        time.sleep(0.3)


def test_a_signal_to_sparknet_alone_mid_apply_leaves_nothing(tf_spec, moto_endpoint, tmp_path):
    """Issue 9 probe, point 3: SIGTERM goes to the sparknet process only (not its group, as
    `kill PID` or `timeout` send it). Terraform gets it forwarded, stops and records what it
    made and releases its state lock; the clean-up's destroy then removes all of it, and only
    then does `up` say so. (SIGINT takes the same handler, which forwards one SIGINT to
    Terraform whatever came: test_terraform_runner.py's interrupt test.)"""
    spec = tf_spec
    _settings(spec, tmp_path)
    proc = subprocess.Popen(
        [str(SPARKNET), "cluster", "up", spec.name, "--ami", amazon_ami(REGION)],
        cwd=tmp_path, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        _wait_for_vpc(spec, proc, timeout_s=120)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    assert left_of(spec) == [], err
    assert "removed again" in err, err
    assert "state lock" not in err
