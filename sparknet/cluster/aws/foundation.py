"""The long-lived resources a cluster stands on: network, security group, node role, bucket.

Two backends make the same resources from the same data files (`infra/rules`, `infra/policies`):
`terraform` (the module in `infra/`, through `terraform_foundation.py`) and `boto3`
(`boto3_foundation.py`) for users without Terraform. Both are idempotent: `ensure` finds what
exists (by the cluster tag, or by name where AWS has no tag lookup) and creates only what is
missing, and reports what it created, so a failed `up` can remove exactly that
(`destroy_boto3(..., only=created)`). Without `only`, `destroy` finds everything by tag and name
alone (`boto3_teardown.py`), so it works without any local state.

This module is what the two have in common, apart from either: the `Foundation` a caller gets
back from both, and the names, tags, subnets and prefix rule both give the resources, so that
neither backend can drift from the other (and `infra/`'s own names are checked against these).
"""

from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass, field
from typing import Any

from sparknet import aws
from sparknet.cluster.aws.rules import network
from sparknet.cluster.spec import TAG_CLUSTER, TAG_OWNER, TAG_ROLE, ClusterSpec, check_prefixes
from sparknet.errors import SparknetError

NODE_POLICY = "sparknet-node"


@dataclass(frozen=True)
class Foundation:
    """What instances need from the foundation."""

    vpc_id: str
    subnet_by_az: dict[str, str]
    security_group_id: str
    instance_profile_name: str
    instance_profile_arn: str
    role_name: str
    bucket: str | None
    #: "kind:id" of everything this call created (a failed `up` removes exactly these)
    created: tuple[str, ...] = field(default=())


def node_role_name(spec: ClusterSpec) -> str:
    """IAM names are global to the account: the region keeps two regions' clusters apart."""
    return f"sparknet-{spec.name}-{spec.region}"


def node_role_description(spec: ClusterSpec) -> str:
    return f"sparknet cluster {spec.name} nodes in {spec.region}"


def security_group_name(spec: ClusterSpec) -> str:
    return f"sparknet-{spec.name}"


def security_group_description(spec: ClusterSpec) -> str:
    """As infra/security.tf; AWS allows only a-z A-Z 0-9 spaces and ._-:/()#,@[]+=&;{}!$*."""
    return f"sparknet cluster {spec.name}: SSH from allowed_cidr, all traffic between members"


def partition(region: str) -> str:
    """The ARN partition of `region`: aws, aws-us-gov, aws-cn, ..."""
    return aws.session().get_partition_for_region(region)


def tags(spec: ClusterSpec, name: str | None = None) -> list[dict[str, str]]:
    """The tags of every foundation resource: cluster, role, the owner when known, and a Name."""
    out = [{"Key": TAG_CLUSTER, "Value": spec.name}, {"Key": TAG_ROLE, "Value": "foundation"}]
    if spec.owner:
        out.append({"Key": TAG_OWNER, "Value": spec.owner})
    if name is not None:
        out.append({"Key": "Name", "Value": name})
    return out


def subnet_cidr(k: int) -> str:
    """The k-th AZ's subnet: Terraform's `cidrsubnet(vpc_cidr, <subnet - vpc prefix>, k)`."""
    settings = network()
    net = ipaddress.ip_network(settings["vpc_cidr"])
    subnets = net.subnets(new_prefix=settings["subnet_prefix"])
    return str(next(itertools.islice(subnets, k, None)))


def check_spec_prefixes(spec: ClusterSpec) -> None:
    """`spec`'s bucket prefixes against the rule both foundations apply (`spec.check_prefixes`,
    as infra/variables.tf): checked again here, as a spec changed with `model_copy` skips its
    validators."""
    try:
        check_prefixes(spec.data_prefix, spec.runs_prefix)
    except ValueError as exc:
        raise SparknetError(f"cluster {spec.name}: {exc}") from exc


def region_zones(ec2: Any, region: str) -> list[str]:
    """The region's first `az_count` regular zones, sorted: where a cluster that names none
    runs (as infra/ takes them)."""
    settings = network()
    with aws.aws_call("DescribeAvailabilityZones", region):
        found = ec2.describe_availability_zones(
            Filters=[
                {"Name": "state", "Values": ["available"]},
                {"Name": "zone-type", "Values": [settings["zone_type"]]},
            ],
        )["AvailabilityZones"]
    names = sorted(z["ZoneName"] for z in found)
    if len(names) < 2:
        raise SparknetError(
            f"{region} offers {len(names)} availability zone(s); the cluster needs 2"
        )
    return names[: settings["az_count"]]


def launch_zones(ec2: Any, spec: ClusterSpec) -> list[str]:
    """The AZs the cluster's instances launch into: its `availability_zones`, else its own
    VPC's subnets' zones, else the region's first regular zones (`region_zones`)."""
    if spec.availability_zones:
        return list(spec.availability_zones)
    if spec.subnet_ids:
        return sorted(subnet_zones(ec2, spec))
    return region_zones(ec2, spec.region)


def subnet_zones(ec2: Any, spec: ClusterSpec, subnet_ids: list[str] | None = None) -> dict:
    """AZ -> subnet of the given subnets (the spec's existing ones by default)."""
    ids = list(subnet_ids if subnet_ids is not None else spec.subnet_ids)
    with aws.aws_call("DescribeSubnets", spec.region):
        found = ec2.describe_subnets(SubnetIds=ids)["Subnets"]
    return {s["AvailabilityZone"]: s["SubnetId"] for s in found}
