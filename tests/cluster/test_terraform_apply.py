"""infra/ applied and destroyed for real: Terraform with the AWS provider against moto's server,
through the same `TerraformRunner` that `foundation: terraform` uses, and the end state compared
with what the boto3 foundation makes (network, rules both ways, role and policy, bucket settings,
the S3 gateway endpoint, tags).

The provider comes from a local plugin directory (no download): ``$SPARKNET_TF_PLUGIN_DIR``, else
/opt/tf-plugins, the directory that holds ``registry.terraform.io/``. Without it the module skips
and says why. Terraform runs on a copy of infra/ so that ``.terraform/`` and the lock file it
writes stay out of the checkout; the copy's lock file must be the one committed in infra/.
Apply takes about a minute on moto.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from sparknet.cluster.aws.boto3_foundation import ensure_boto3
from sparknet.cluster.aws.boto3_teardown import destroy_boto3
from sparknet.cluster.aws.foundation import node_role_name
from sparknet.cluster.aws.terraform import TerraformRunner
from sparknet.cluster.aws.terraform_foundation import terraform_variables
from sparknet.cluster.spec import INFRA_DIR, TAG_CLUSTER, TAG_OWNER, TAG_ROLE, ClusterSpec

PLUGIN_DIR = Path(os.environ.get("SPARKNET_TF_PLUGIN_DIR") or "/opt/tf-plugins")
REGION = "us-east-1"
CIDR = "203.0.113.7/32"
OWNER = "arn:aws:iam::123456789012:user/alice"
LOCK_FILE = ".terraform.lock.hcl"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (PLUGIN_DIR / "registry.terraform.io" / "hashicorp" / "aws").is_dir(),
        reason=f"no hashicorp/aws provider in {PLUGIN_DIR} (set SPARKNET_TF_PLUGIN_DIR to a "
        "directory holding registry.terraform.io/hashicorp/aws): infra/ cannot be applied offline",
    ),
    pytest.mark.integration,
]


def provider_override(endpoint: str) -> str:
    """The provider pointed at moto with fake credentials; default_tags stay infra/'s own."""
    services = "\n".join(
        f"    {name} = {json.dumps(endpoint)}" for name in ("ec2", "iam", "s3", "sts")
    )
    return f"""provider "aws" {{
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_metadata_api_check     = true
  skip_requesting_account_id  = true
  s3_use_path_style           = true

  endpoints {{
{services}
  }}
}}
"""


def module_copy(root: Path, endpoint: str) -> Path:
    """infra/ (its .tf, data files and committed lock file) copied, with the moto override."""
    copy = root / "infra"
    shutil.copytree(INFRA_DIR, copy, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*"))
    (copy / "provider_override.tf").write_text(provider_override(endpoint))
    return copy


def _names(spec: ClusterSpec) -> dict[str, str]:
    return {spec.bucket or "": "<bucket>", spec.name: "<cluster>"}


def _generic(value: Any, names: dict[str, str]) -> Any:
    """`value` with one cluster's names made generic, so two clusters' states compare."""
    text = json.dumps(value, sort_keys=True)
    for name, placeholder in sorted(names.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(name, placeholder)
    return json.loads(text)


def _tags(items: list[dict[str, str]] | None) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in items or [] if t["Key"].startswith("sparknet:")}


def _rules(perms: list[dict[str, Any]], group: str) -> list[tuple]:
    return sorted(
        (
            p["IpProtocol"], p.get("FromPort"), p.get("ToPort"), kind,
            "self" if source.get("GroupId") == group else source.get("CidrIp"),
            source.get("Description"),
        )
        for p in perms
        for kind in ("IpRanges", "UserIdGroupPairs", "Ipv6Ranges", "PrefixListIds")
        for source in p.get(kind, [])
    )  # fmt: skip


def _doc(document: Any) -> Any:
    return json.loads(urllib.parse.unquote(document)) if isinstance(document, str) else document


def drop_retried_route_tables(vpc: str) -> list[str]:
    """Delete the route tables of `vpc` that a retried CreateRouteTable left: moto ignores the
    request's ClientToken, which AWS honours (the retry gets the first table back), so on a busy
    machine a provider's retry after a slow answer makes a second table with the same tags and
    no subnet. Only such a twin goes; a table that differs in anything else is left to fail
    `end_state`. Returns the ids deleted."""
    ec2 = boto3.client("ec2", region_name=REGION)
    tables = [
        t
        for t in ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc]}])[
            "RouteTables"
        ]
        if not any(a.get("Main") for a in t.get("Associations", []))
    ]
    kept = [t for t in tables if t.get("Associations")]
    twins = [
        t["RouteTableId"]
        for t in tables
        if not t.get("Associations")
        and any(_tags(t.get("Tags", [])) == _tags(k.get("Tags", [])) for k in kept)
    ]
    for table in twins:
        ec2.delete_route_table(RouteTableId=table)
    return twins


def end_state(spec: ClusterSpec, vpc: str, group: str, role: str) -> dict[str, Any]:
    """What a foundation is in AWS, with the cluster's names made generic."""
    ec2 = boto3.client("ec2", region_name=REGION)
    iam = boto3.client("iam", region_name=REGION)
    s3 = boto3.client("s3", region_name=REGION)
    by_vpc = [{"Name": "vpc-id", "Values": [vpc]}]
    subnets = ec2.describe_subnets(Filters=by_vpc)["Subnets"]
    tables = [
        t
        for t in ec2.describe_route_tables(Filters=by_vpc)["RouteTables"]
        if not any(a.get("Main") for a in t.get("Associations", []))
    ]
    (table,) = tables
    endpoints = [
        e
        for e in ec2.describe_vpc_endpoints(Filters=by_vpc)["VpcEndpoints"]
        if e["State"].lower() != "deleted"
    ]
    groups = {
        g["GroupName"]: g for g in ec2.describe_security_groups(Filters=by_vpc)["SecurityGroups"]
    }
    cluster_group, default_group = groups[f"sparknet-{spec.name}"], groups["default"]
    assert cluster_group["GroupId"] == group
    attribute = ec2.describe_vpc_attribute
    profile = iam.get_instance_profile(InstanceProfileName=role)["InstanceProfile"]
    role_info = iam.get_role(RoleName=role)["Role"]
    (policy_name,) = iam.list_role_policies(RoleName=role)["PolicyNames"]
    encryption = s3.get_bucket_encryption(Bucket=spec.bucket)["ServerSideEncryptionConfiguration"]
    state = {
        "vpc": {
            "cidr": ec2.describe_vpcs(VpcIds=[vpc])["Vpcs"][0]["CidrBlock"],
            "dns_support": attribute(VpcId=vpc, Attribute="enableDnsSupport")["EnableDnsSupport"][
                "Value"
            ],
            "dns_hostnames": attribute(VpcId=vpc, Attribute="enableDnsHostnames")[
                "EnableDnsHostnames"
            ]["Value"],
            "tags": _tags(ec2.describe_vpcs(VpcIds=[vpc])["Vpcs"][0].get("Tags")),
        },
        "subnets": sorted(
            (
                s["AvailabilityZone"],
                s["CidrBlock"],
                s["MapPublicIpOnLaunch"],
                _tags(s.get("Tags")),
            )
            for s in subnets
        ),
        "routes": sorted(
            (r.get("DestinationCidrBlock"), r.get("GatewayId", "")[:4])
            for r in table["Routes"]
            if r.get("DestinationCidrBlock")
        ),
        "associated_subnets": len([a for a in table["Associations"] if a.get("SubnetId")]),
        "route_table_tags": _tags(table.get("Tags")),
        "s3_endpoints": [
            (
                e["ServiceName"],
                e["VpcEndpointType"].lower(),
                e["RouteTableIds"] == [table["RouteTableId"]],
                _tags(e.get("Tags")),
            )
            for e in endpoints
        ],
        "default_group_rules": _rules(default_group.get("IpPermissions", []), "")
        + _rules(default_group.get("IpPermissionsEgress", []), ""),
        "group": {
            "description": cluster_group["Description"],
            "ingress": _rules(cluster_group["IpPermissions"], group),
            "egress": _rules(cluster_group["IpPermissionsEgress"], group),
            "tags": _tags(cluster_group.get("Tags")),
            "name_tag": {t["Key"]: t["Value"] for t in cluster_group.get("Tags", [])}.get("Name"),
        },
        "role": {
            "description": role_info.get("Description"),
            "max_session_s": role_info.get("MaxSessionDuration"),
            "assume": _doc(role_info["AssumeRolePolicyDocument"]),
            "policy_name": policy_name,
            "policy": _doc(
                iam.get_role_policy(RoleName=role, PolicyName=policy_name)["PolicyDocument"]
            ),
            "tags": _tags(iam.list_role_tags(RoleName=role)["Tags"]),
            "profile_roles": [r["RoleName"] for r in profile["Roles"]],
        },
        "bucket": {
            "encryption": encryption["Rules"],
            "versioning": s3.get_bucket_versioning(Bucket=spec.bucket).get("Status"),
            "public_access_block": s3.get_public_access_block(Bucket=spec.bucket)[
                "PublicAccessBlockConfiguration"
            ],
            "ownership": s3.get_bucket_ownership_controls(Bucket=spec.bucket)["OwnershipControls"][
                "Rules"
            ],
            "policy": json.loads(s3.get_bucket_policy(Bucket=spec.bucket)["Policy"]),
            "lifecycle": s3.get_bucket_lifecycle_configuration(Bucket=spec.bucket)["Rules"],
            "tags": _tags(s3.get_bucket_tagging(Bucket=spec.bucket)["TagSet"]),
        },
    }
    return _generic(state, _names(spec))


@pytest.fixture(scope="module")
def applied(moto_endpoint, tmp_path_factory):
    """infra/ applied for one cluster (with its bucket) and the boto3 foundation of another,
    both with an owner; yields both end states, then destroys both."""
    root = tmp_path_factory.mktemp("apply")
    module = module_copy(root, moto_endpoint)
    suffix = uuid.uuid4().hex[:6]
    tf_spec = ClusterSpec(name=f"tf{suffix}", region=REGION, bucket=f"tf{suffix}-data", owner=OWNER)
    py_spec = ClusterSpec(name=f"py{suffix}", region=REGION, bucket=f"py{suffix}-data", owner=OWNER)
    runner = TerraformRunner(
        module, root / "state", plugin_cache_dir=root / "cache", plugin_dir=PLUGIN_DIR
    )
    variables = {**terraform_variables(tf_spec, CIDR), "create_bucket": True}
    runner.init()
    try:
        runner.apply(variables)
        out = runner.output()
        py = ensure_boto3(py_spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
        for vpc in (out["vpc_id"], py.vpc_id):
            drop_retried_route_tables(vpc)
        yield {
            "runner": runner,
            "variables": variables,
            "module": module,
            "out": out,
            "terraform": end_state(
                tf_spec, out["vpc_id"], out["security_group_id"], out["instance_profile_name"]
            ),
            "boto3": end_state(py_spec, py.vpc_id, py.security_group_id, py.role_name),
            "tf_spec": tf_spec,
        }
    finally:
        runner.destroy(variables)
        destroy_boto3(py_spec, endpoint_url=moto_endpoint)


def test_init_writes_the_committed_lock_file_and_nothing_into_infra(applied) -> None:
    committed = INFRA_DIR / LOCK_FILE
    assert committed.is_file(), f"commit the {LOCK_FILE} that `terraform init` writes into infra/"
    assert (applied["module"] / LOCK_FILE).read_text() == committed.read_text()
    assert not (INFRA_DIR / ".terraform").exists()
    assert (applied["runner"].state_dir / ".terraform").is_dir()


@pytest.mark.parametrize(
    "part",
    ["vpc", "subnets", "routes", "associated_subnets", "route_table_tags", "s3_endpoints",
     "default_group_rules", "group", "role", "bucket"],
)  # fmt: skip
def test_terraform_and_boto3_foundations_end_in_the_same_state(applied, part) -> None:
    assert applied["terraform"][part] == applied["boto3"][part]


def test_the_applied_state_is_the_shared_rules(applied) -> None:
    """Not only equal: what both hold is right (3 regular zones, SSH from the one source,
    members to each other, egress described, owner tags, a hardened bucket)."""
    state = applied["terraform"]
    assert [s[:3] for s in state["subnets"]] == [
        ["us-east-1a", "10.42.0.0/24", False],
        ["us-east-1b", "10.42.1.0/24", False],
        ["us-east-1c", "10.42.2.0/24", False],
    ]
    assert state["group"]["ingress"] == [
        ["-1", None, None, "UserIdGroupPairs", "self", "All traffic between cluster members: "
         "Spark RPC, block manager, shuffle, torch.distributed"],
        ["tcp", 22, 22, "IpRanges", CIDR, f"SSH from {CIDR} only (the cluster allowed_cidr)"],
    ]  # fmt: skip
    assert [rule[:5] for rule in state["group"]["egress"]] == [
        ["-1", None, None, "IpRanges", "0.0.0.0/0"]
    ]
    assert state["default_group_rules"] == []
    assert state["s3_endpoints"][0][:3] == ["com.amazonaws.us-east-1.s3", "gateway", True]
    owner_tags = {TAG_CLUSTER: "<cluster>", TAG_ROLE: "foundation", TAG_OWNER: OWNER}
    assert state["vpc"]["tags"] == state["group"]["tags"] == state["role"]["tags"] == owner_tags
    assert state["bucket"]["versioning"] == "Enabled"
    assert state["bucket"]["ownership"] == [{"ObjectOwnership": "BucketOwnerEnforced"}]
    assert state["bucket"]["encryption"][0]["BucketKeyEnabled"] is True


def test_destroy_leaves_nothing_of_the_cluster(applied, moto_endpoint) -> None:
    runner, spec = applied["runner"], applied["tf_spec"]
    runner.destroy(applied["variables"])
    assert json.loads(runner.state_file.read_text())["resources"] == []
    ec2 = boto3.client("ec2", region_name=REGION)
    tagged = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    assert ec2.describe_vpcs(Filters=tagged)["Vpcs"] == []
    assert ec2.describe_security_groups(Filters=tagged)["SecurityGroups"] == []
    iam = boto3.client("iam", region_name=REGION)
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_role(RoleName=node_role_name(spec))
