"""Taking a foundation apart with boto3, whichever backend made it.

Separate from `boto3_foundation.py` because both backends end here: `destroy_terraform` sweeps
by tag after `terraform destroy` with `destroy_boto3`, and `check_removed` confirms by tag that
nothing of a cluster is left, however it was made.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster.aws.boto3_foundation import Boto3Foundation, filters
from sparknet.cluster.aws.foundation import node_role_name
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError
from sparknet.say import command_line

#: the order a foundation is taken apart in: each kind only after what depends on it
DESTROY_ORDER = (
    "instance-profile", "iam-role", "vpc-endpoint", "security-group", "route-table", "subnet",
    "internet-gateway", "vpc",
)  # fmt: skip
#: kinds `destroy` never deletes: the bucket holds datasets and runs that outlive any cluster
KEPT_KINDS = frozenset({"bucket"})
#: how long a delete waits for AWS to let go of what still depends on it: a security group stays
#: "in use" for seconds to minutes after its instances terminate, and a VPC endpoint deletes
#: asynchronously, so the subnet, gateway and VPC after it are refused meanwhile
DEPENDENCY_WAIT_S = 300.0
#: AWS's answer while a dependency is still letting go (retried until `DEPENDENCY_WAIT_S`)
_BUSY_CODES = frozenset({"DependencyViolation"})


def destroy_boto3(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    only: Collection[str] | None = None,
) -> list[str]:
    """Delete the cluster's foundation; returns "kind:id" of each thing deleted.

    Args:
        only: "kind:id" strings (a `Foundation.created`, or what `ensure_boto3` appended to its
            `created` list): delete exactly those and nothing else, so a failed `up` removes
            what it made and never what a concurrent `up` of the same name made. Default
            ``None``: everything of the cluster, found by tag and name alone.

    The bucket is kept either way: it holds datasets and runs that outlive any cluster. The
    VPC's `default` security group is never deleted (AWS refuses; it goes with its VPC). Call
    after the cluster's instances are terminated (the security group is in use until then);
    a delete AWS refuses with DependencyViolation is retried for up to `DEPENDENCY_WAIT_S`.
    Without `only`, it then checks by tag that nothing of the cluster is left (`check_removed`).
    """
    f = Boto3Foundation(spec, endpoint_url)
    targets = _parse_only(only) if only is not None else _tagged(f)
    deleted = []
    for kind in DESTROY_ORDER:
        for ident in targets.get(kind, []):
            if _DELETERS[kind](f, ident):
                deleted.append(f"{kind}:{ident}")
    if only is None:
        check_removed(spec, endpoint_url=endpoint_url)
    return deleted


def _parse_only(only: Collection[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in only:
        kind, _, ident = item.partition(":")
        if kind in KEPT_KINDS:
            continue
        if kind not in _DELETERS or not ident:
            raise SparknetError(
                f"cannot delete {item!r}: expected kind:id, kind one of {', '.join(DESTROY_ORDER)}"
            )
        out.setdefault(kind, []).append(ident)
    return out


def _tagged(f: Boto3Foundation) -> dict[str, list[str]]:
    """Everything of the cluster's foundation, by tag (EC2) and by name (IAM)."""
    spec, ec2, iam = f.spec, f.ec2, f.iam
    name = node_role_name(spec)
    out: dict[str, list[str]] = {}
    if f.find("GetInstanceProfile", iam.get_instance_profile, InstanceProfileName=name):
        out["instance-profile"] = [name]
    if f.find("GetRole", iam.get_role, RoleName=name):
        out["iam-role"] = [name]
    listed = [
        ("vpc-endpoint", "DescribeVpcEndpoints", ec2.describe_vpc_endpoints, "VpcEndpoints",
         "VpcEndpointId"),
        ("security-group", "DescribeSecurityGroups", ec2.describe_security_groups,
         "SecurityGroups", "GroupId"),
        ("route-table", "DescribeRouteTables", ec2.describe_route_tables, "RouteTables",
         "RouteTableId"),
        ("subnet", "DescribeSubnets", ec2.describe_subnets, "Subnets", "SubnetId"),
        ("internet-gateway", "DescribeInternetGateways", ec2.describe_internet_gateways,
         "InternetGateways", "InternetGatewayId"),
        ("vpc", "DescribeVpcs", ec2.describe_vpcs, "Vpcs", "VpcId"),
    ]  # fmt: skip
    for kind, action, fn, key, id_key in listed:
        items = f.call(action, fn, Filters=filters(spec))[key]
        out[kind] = [item[id_key] for item in items if _deletable(kind, item)]
    return out


def _deletable(kind: str, item: dict[str, Any]) -> bool:
    """Not the VPC's `default` group (Terraform's aws_default_security_group tags it; AWS
    refuses to delete it), not a VPC's main route table, not an endpoint already going."""
    if kind == "security-group":
        return item.get("GroupName") != "default"
    if kind == "route-table":
        return not any(a.get("Main") for a in item.get("Associations", []))
    if kind == "vpc-endpoint":
        return item.get("State", "").lower() not in ("deleting", "deleted")
    return True


def patient(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a boto3 call) retried while AWS answers DependencyViolation, with a growing pause,
    until `DEPENDENCY_WAIT_S` has passed; then the last answer is raised. botocore's own retries
    cover throttling and 5xx only, never this."""

    def call(**kwargs: Any) -> Any:
        return aws.retrying(lambda: fn(**kwargs), _busy, within_s=DEPENDENCY_WAIT_S)

    return call


def _busy(exc: bx.ClientError) -> bool:
    return aws.error_code(exc) in _BUSY_CODES


def _delete_instance_profile(f: Boto3Foundation, name: str) -> bool:
    found = f.find("GetInstanceProfile", f.iam.get_instance_profile, InstanceProfileName=name)
    if found is None:
        return False
    for role in found["InstanceProfile"].get("Roles", []):
        f.call(
            "RemoveRoleFromInstanceProfile", f.iam.remove_role_from_instance_profile,
            InstanceProfileName=name, RoleName=role["RoleName"],
        )  # fmt: skip
    f.call("DeleteInstanceProfile", f.iam.delete_instance_profile, InstanceProfileName=name)
    return True


def _delete_role(f: Boto3Foundation, name: str) -> bool:
    if f.find("GetRole", f.iam.get_role, RoleName=name) is None:
        return False
    profiles = f.call(
        "ListInstanceProfilesForRole", f.iam.list_instance_profiles_for_role, RoleName=name
    )["InstanceProfiles"]
    for profile in profiles:  # a profile this call did not create still holds the role
        f.call(
            "RemoveRoleFromInstanceProfile", f.iam.remove_role_from_instance_profile,
            InstanceProfileName=profile["InstanceProfileName"], RoleName=name,
        )  # fmt: skip
    policies = f.call("ListRolePolicies", f.iam.list_role_policies, RoleName=name)
    for policy in policies["PolicyNames"]:
        f.call("DeleteRolePolicy", f.iam.delete_role_policy, RoleName=name, PolicyName=policy)
    f.call("DeleteRole", f.iam.delete_role, RoleName=name)
    return True


def _delete_endpoint(f: Boto3Foundation, endpoint: str) -> bool:
    answer = f.find("DeleteVpcEndpoints", f.ec2.delete_vpc_endpoints, VpcEndpointIds=[endpoint])
    return answer is not None and not answer.get("Unsuccessful")


def _delete_group(f: Boto3Foundation, group: str) -> bool:
    found = f.find("DescribeSecurityGroups", f.ec2.describe_security_groups, GroupIds=[group])
    if not found or not _deletable("security-group", found["SecurityGroups"][0]):
        return False
    deleted = f.find("DeleteSecurityGroup", patient(f.ec2.delete_security_group), GroupId=group)
    return deleted is not None


def _delete_route_table(f: Boto3Foundation, table: str) -> bool:
    found = f.find("DescribeRouteTables", f.ec2.describe_route_tables, RouteTableIds=[table])
    if not found or not _deletable("route-table", found["RouteTables"][0]):
        return False
    for assoc in found["RouteTables"][0].get("Associations", []):
        f.find(
            "DisassociateRouteTable", f.ec2.disassociate_route_table,
            AssociationId=assoc["RouteTableAssociationId"],
        )  # fmt: skip
    return f.find("DeleteRouteTable", f.ec2.delete_route_table, RouteTableId=table) is not None


def _delete_subnet(f: Boto3Foundation, subnet: str) -> bool:
    return f.find("DeleteSubnet", patient(f.ec2.delete_subnet), SubnetId=subnet) is not None


def _delete_gateway(f: Boto3Foundation, igw: str) -> bool:
    found = f.find(
        "DescribeInternetGateways", f.ec2.describe_internet_gateways, InternetGatewayIds=[igw]
    )
    if not found or not found["InternetGateways"]:
        return False
    for att in found["InternetGateways"][0].get("Attachments", []):
        f.find(
            "DetachInternetGateway", patient(f.ec2.detach_internet_gateway),
            InternetGatewayId=igw, VpcId=att["VpcId"],
        )  # fmt: skip
    deleted = f.find(
        "DeleteInternetGateway", patient(f.ec2.delete_internet_gateway), InternetGatewayId=igw
    )
    return deleted is not None


def _delete_vpc(f: Boto3Foundation, vpc: str) -> bool:
    return f.find("DeleteVpc", patient(f.ec2.delete_vpc), VpcId=vpc) is not None


_DELETERS: dict[str, Callable[[Boto3Foundation, str], bool]] = {
    "instance-profile": _delete_instance_profile,
    "iam-role": _delete_role,
    "vpc-endpoint": _delete_endpoint,
    "security-group": _delete_group,
    "route-table": _delete_route_table,
    "subnet": _delete_subnet,
    "internet-gateway": _delete_gateway,
    "vpc": _delete_vpc,
}


def check_removed(spec: ClusterSpec, *, endpoint_url: str | None = None) -> None:
    """Raise `SparknetError` when any foundation resource of the cluster is still there (by tag
    in its region, IAM by name): what a clean-up checks before it says "removed"."""
    left = _tagged(Boto3Foundation(spec, endpoint_url))
    items = [f"{kind}:{ident}" for kind in DESTROY_ORDER for ident in left.get(kind, [])]
    if items:
        again = command_line("sparknet cluster down", spec.name, region=spec.region)
        raise SparknetError(
            f"cluster {spec.name} in {spec.region} still has {', '.join(items)} after the "
            f"destroy; run `{again}` again"
        )


#: how to look one resource up by its id: (action, client, method, id parameter, answer key)
_LOOKUPS: dict[str, tuple[str, str, str, str, str]] = {
    "instance-profile": ("GetInstanceProfile", "iam", "get_instance_profile",
                         "InstanceProfileName", "InstanceProfile"),
    "iam-role": ("GetRole", "iam", "get_role", "RoleName", "Role"),
    "vpc-endpoint": ("DescribeVpcEndpoints", "ec2", "describe_vpc_endpoints", "VpcEndpointIds",
                     "VpcEndpoints"),
    "security-group": ("DescribeSecurityGroups", "ec2", "describe_security_groups", "GroupIds",
                       "SecurityGroups"),
    "route-table": ("DescribeRouteTables", "ec2", "describe_route_tables", "RouteTableIds",
                    "RouteTables"),
    "subnet": ("DescribeSubnets", "ec2", "describe_subnets", "SubnetIds", "Subnets"),
    "internet-gateway": ("DescribeInternetGateways", "ec2", "describe_internet_gateways",
                         "InternetGatewayIds", "InternetGateways"),
    "vpc": ("DescribeVpcs", "ec2", "describe_vpcs", "VpcIds", "Vpcs"),
}  # fmt: skip


def still_there(f: Boto3Foundation, item: str) -> bool:
    """Whether the "kind:id" resource exists (an endpoint that is deleting counts as gone)."""
    kind, _, ident = item.partition(":")
    action, client, method, param, key = _LOOKUPS[kind]
    value: str | list[str] = ident if client == "iam" else [ident]
    found = f.find(action, getattr(getattr(f, client), method), **{param: value})
    if found is None:
        return False
    answer = found[key]
    if isinstance(answer, dict):
        return True
    return any(kind != "vpc-endpoint" or _deletable(kind, one) for one in answer)
