"""Which clusters exist, where, and whose.

The resources tagged with a cluster's name in a region (AWS's truth, which `cluster list`,
`sweep`, `down` and the owner check go by), and what this machine keeps of one (its registry
entry, its Terraform state per region); with the refusals they ground: another principal's
cluster (`NotYours`), a name this machine knows in another region (`OtherRegion`).

Apart from the providers (ec2.py, static.py): all of it only reads (AWS's listings, local
files) and changes nothing, and `list` and `sweep` need it without any cluster's life being run.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sparknet import aws
from sparknet.cluster import registry
from sparknet.cluster.aws import instances, keys
from sparknet.cluster.spec import TAG_CLUSTER, TAG_OWNER, ClusterSpec
from sparknet.errors import SparknetError

# --- tagged resources: list and sweep ----------------------------------------------------------

#: (describe call, response key, id key, kind) of each tagged EC2 resource type of a foundation
_TAGGED_EC2 = (
    ("describe_vpcs", "Vpcs", "VpcId", "vpc"),
    ("describe_subnets", "Subnets", "SubnetId", "subnet"),
    ("describe_security_groups", "SecurityGroups", "GroupId", "security-group"),
    ("describe_internet_gateways", "InternetGateways", "InternetGatewayId", "internet-gateway"),
    ("describe_route_tables", "RouteTables", "RouteTableId", "route-table"),
    ("describe_vpc_endpoints", "VpcEndpoints", "VpcEndpointId", "vpc-endpoint"),
)
#: states of a resource that is gone or going (EC2 lists deleted VPC endpoints for a while)
_GONE_STATES = frozenset({"deleted", "deleting"})


@dataclass
class TaggedCluster:
    """A cluster as its tags show it: "kind:id" of each resource, and the owner tag values
    seen on them (None for a resource without one: made before sparknet tagged owners)."""

    name: str
    items: list[str] = field(default_factory=list)
    owners: set[str | None] = field(default_factory=set)

    def owned_by(self, owner: str) -> bool:
        """Every resource carries `owner`'s tag (none lacks one, none has another's)."""
        return self.owners == {owner}


def tagged_clusters(region: str, *, endpoint_url: str | None = None) -> dict[str, TaggedCluster]:
    """Every cluster with resources in `region`: live instances, the foundation's network and
    security group (by the `sparknet:cluster` tag), and its IAM role and instance profile (IAM
    is global: by the name that carries the region, then the tag). The bucket is not listed:
    it outlives clusters."""
    ec2 = instances.ec2_client(region, endpoint_url)
    out: dict[str, TaggedCluster] = {}

    def add(tags: list[dict[str, str]], item: str) -> None:
        by_key = {t["Key"]: t["Value"] for t in tags}
        name = by_key.get(TAG_CLUSTER)
        if name is not None:
            cluster = out.setdefault(name, TaggedCluster(name))
            cluster.items.append(item)
            cluster.owners.add(by_key.get(TAG_OWNER))

    tag_key = {"Name": "tag-key", "Values": [TAG_CLUSTER]}
    live = {"Name": "instance-state-name", "Values": list(instances.LIVE_STATES)}
    with aws.aws_call("DescribeInstances", region):
        for page in ec2.get_paginator("describe_instances").paginate(Filters=[tag_key, live]):
            for reservation in page["Reservations"]:
                for raw in reservation["Instances"]:
                    add(raw.get("Tags", []), f"instance:{raw['InstanceId']}")
    for pair in keys.tagged_key_pairs(ec2):
        add(pair.get("Tags", []), f"key-pair:{pair['KeyName']}")
    for call, key, id_key, kind in _TAGGED_EC2:
        with aws.aws_call(call, region):
            for page in ec2.get_paginator(call).paginate(Filters=[tag_key]):
                for item in page[key]:
                    if str(item.get("State", "")).lower() not in _GONE_STATES:
                        add(item.get("Tags", []), f"{kind}:{item[id_key]}")
    _add_iam(region, endpoint_url, add)
    return out


def _add_iam(region: str, endpoint_url: str | None, add: Callable[[list, str], None]) -> None:
    """The node roles and instance profiles of the region's clusters (IAM is global: by the
    name, which carries the region, then the tag). Profiles are listed on their own: one whose
    role is gone still names the cluster and must still be found and deleted."""
    iam = aws.client("iam", region, endpoint_url)

    def ours(name: str) -> bool:
        return name.startswith("sparknet-") and name.endswith(f"-{region}")

    with aws.aws_call("ListRoles", region):
        for page in iam.get_paginator("list_roles").paginate():
            for role in page["Roles"]:
                if ours(role["RoleName"]):
                    with contextlib.suppress(iam.exceptions.NoSuchEntityException):  # going
                        tags = iam.list_role_tags(RoleName=role["RoleName"])["Tags"]
                        add(tags, f"iam-role:{role['RoleName']}")
    with aws.aws_call("ListInstanceProfiles", region):
        for page in iam.get_paginator("list_instance_profiles").paginate():
            for profile in page["InstanceProfiles"]:
                name = profile["InstanceProfileName"]
                if ours(name):
                    with contextlib.suppress(iam.exceptions.NoSuchEntityException):  # going
                        found = iam.get_instance_profile(InstanceProfileName=name)
                        tags = found["InstanceProfile"].get("Tags", [])
                        add(tags, f"instance-profile:{name}")


def orphans(
    region: str, wanted: set[str], *, endpoint_url: str | None = None
) -> dict[str, TaggedCluster]:
    """Clusters with resources in `region` that nobody wants (not in `wanted`)."""
    return {
        name: cluster
        for name, cluster in tagged_clusters(region, endpoint_url=endpoint_url).items()
        if name not in wanted
    }


# --- the owner ---------------------------------------------------------------------------------


class NotYours(SparknetError):
    """A tagged resource of the cluster carries another principal's `sparknet:owner`."""


def check_owner(spec: ClusterSpec, owner: str, endpoint_url: str | None = None) -> None:
    """Refuse to touch cluster `spec.name` in its region when any of its tagged resources carries
    another principal's owner tag: in a shared account a name is no proof of whose a cluster
    is, and `up` would rewrite the other's SSH rule and role policy, `down` delete their
    cluster. Resources without an owner tag (made before sparknet tagged owners) pass."""
    cluster = tagged_clusters(spec.region, endpoint_url=endpoint_url).get(spec.name)
    others = sorted(o for o in cluster.owners if o not in (None, owner)) if cluster else []
    if others:
        raise NotYours(
            "cluster {name} in {region} belongs to {others} (its {tag} tag), not to you "
            "({owner}); choose another name, or pass {@any_owner} to act on it anyway",
            name=spec.name,
            region=spec.region,
            others=", ".join(others),
            tag=TAG_OWNER,
            owner=owner,
        )


# --- where this machine knows a cluster --------------------------------------------------------


class OtherRegion(SparknetError):
    """`up` of a name this machine has registered (or holds Terraform state of) in another
    region."""


def terraform_state_dir(spec: ClusterSpec) -> Path:
    """Where a cluster's Terraform state lives, unless `terraform_backend` names another:
    ``<registry>/<name>/<region>/terraform``. Keyed by region too: two regions' clusters of one
    name are two clusters (IAM names carry the region), and `down --region` of the wrong one
    must find no state to destroy. The dir of an older sparknet (``<name>/terraform``) is used
    for the region its saved variables name."""
    base = registry.registry_dir() / registry.file_stem(spec.name)
    legacy = base / "terraform"
    if _state_region(legacy) == spec.region:
        return legacy
    return base / spec.region / "terraform"


def _state_region(state_dir: Path) -> str | None:
    """The region a local Terraform state dir was applied for (its saved variables); None when
    it holds no resources (never applied, or destroyed)."""
    try:
        state = json.loads((state_dir / "terraform.tfstate").read_text())
        region = json.loads((state_dir / "variables.tfvars.json").read_text())["region"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(region) if state.get("resources") else None


def known_regions(name: str) -> set[str]:
    """The regions where this machine knows cluster `name`: its registry entry and any local
    Terraform state that still holds resources."""
    out = {spec.region for spec in [registry.registered().get(name)] if spec is not None}
    base = registry.registry_dir() / registry.file_stem(name)
    for state_dir in [base / "terraform", *base.glob("*/terraform")]:
        region = _state_region(state_dir)
        if region is not None:
            out.add(region)
    return out


def check_region(spec: ClusterSpec) -> None:
    """Refuse `up` of a name this machine knows in another region: the registry, the lock and
    `down` would confuse the two clusters, and the second would inherit the first's settings."""
    elsewhere = sorted(known_regions(spec.name) - {spec.region})
    if elsewhere:
        raise OtherRegion(
            f"cluster {spec.name} already runs in {', '.join(elsewhere)} (registered here); "
            f"take it down there first (`sparknet cluster down {spec.name} --region "
            f"{elsewhere[0]}`) or choose another name"
        )
