"""Cluster lifecycle defects a tester found after the first hardening round, against moto's
server: another principal's cluster of the same name, regions, stopped instances, names sparknet
no longer accepts, resources `list` missed, interrupted `down`, exit codes, free checks, and a
shrinking `up`."""

from __future__ import annotations

import boto3

from sparknet.cluster import lifecycle
from sparknet.cluster.spec import TAG_OWNER, ClusterSpec
from tests.integration import test_lifecycle
from tests.integration.test_lifecycle import REGION, _left, _settings_file, _up, cli

#: the same cluster fixture (a fresh name, SPARKNET_HOME in tmp_path, taken down afterwards)
spec = test_lifecycle.spec

BOB = "arn:aws:sts::123456789012:assumed-role/Dev/bob"


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def _retag_owner(spec: ClusterSpec, owner: str, endpoint: str) -> None:
    """Every tagged resource of the cluster (EC2 and IAM) now says `owner` made it."""
    ec2 = boto3.client("ec2", region_name=REGION)
    iam = boto3.client("iam", region_name=REGION)
    tag = {"Key": TAG_OWNER, "Value": owner}
    for item in lifecycle.tagged_clusters(REGION, endpoint_url=endpoint)[spec.name].items:
        kind, _, ident = item.partition(":")
        if kind == "iam-role":
            iam.tag_role(RoleName=ident, Tags=[tag])
        elif kind == "instance-profile":
            iam.tag_instance_profile(InstanceProfileName=ident, Tags=[tag])
        else:
            ec2.create_tags(Resources=[ident], Tags=[tag])


def _ssh_sources(spec: ClusterSpec) -> list[str]:
    ec2 = boto3.client("ec2", region_name=REGION)
    groups = ec2.describe_security_groups(
        Filters=[{"Name": "tag:sparknet:cluster", "Values": [spec.name]}]
    )["SecurityGroups"]
    return sorted(
        r["CidrIp"] for g in groups for p in g["IpPermissions"] for r in p.get("IpRanges", [])
    )


# --- 1: another principal's cluster of the same name -------------------------------------------


def test_up_and_down_refuse_a_cluster_of_that_name_owned_by_another(spec, moto_endpoint, tmp_path):
    """bob's cluster has the name; this machine's registry does not know it. `up` must not
    rewrite bob's SSH rule or launch into bob's VPC, `down` must not delete it: both refuse in
    one line (exit 1) naming bob; `--any-owner` is the explicit way through."""
    _up(spec.model_copy(update={"workers": 1}), moto_endpoint)
    _retag_owner(spec, BOB, moto_endpoint)
    for path in lifecycle.registry_dir().glob("*.json"):
        path.unlink()
    _settings_file(spec, tmp_path, instance_types=["g4dn.xlarge"])
    before = _left(spec)
    rules = _ssh_sources(spec)

    took = cli("up", spec.name, "--allowed-cidr", "192.0.2.9/32", "--workers", "4", cwd=tmp_path)
    assert took.returncode == 1, took.stderr
    line = _one_line(took.stderr)
    assert BOB in line and "--any-owner" in line
    assert _left(spec) == before and _ssh_sources(spec) == rules

    gone = cli("down", spec.name, cwd=tmp_path)
    assert gone.returncode == 1, gone.stderr
    assert BOB in _one_line(gone.stderr)
    assert _left(spec) == before == {"instances": 2, "vpcs": 1, "security_groups": 1, "roles": 1}

    forced = cli("down", spec.name, "--any-owner", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
