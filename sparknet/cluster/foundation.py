"""The long-lived resources a cluster stands on: network, security group, node role, bucket.

Two backends make the same resources from the same data files (`infra/rules`, `infra/policies`):
`terraform` (the module in `infra/`, through `terraform.py`) and `boto3` (here) for users
without Terraform. Both are idempotent: `ensure` finds what exists (by the cluster tag, or by
name where AWS has no tag lookup) and creates only what is missing, and reports what it created,
so a failed `up` can remove exactly that. `destroy` finds everything by tag and name alone, so it
works without any local state.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster import instances
from sparknet.cluster.rules import policy_document, security_group_rules
from sparknet.cluster.spec import INFRA_DIR, TAG_CLUSTER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError

#: the network infra/ makes by default (`vpc_cidr` in infra/variables.tf; a test keeps them equal)
VPC_CIDR = "10.42.0.0/16"
#: subnets are /24s of the VPC, one per availability zone, in zone order (as infra/network.tf)
SUBNET_PREFIX = 24
MAX_AZS = 3
NODE_POLICY = "sparknet-node"
#: what "not there" is called by IAM (get_role, get_instance_profile) and S3 (head_bucket)
_ABSENT_CODES = frozenset({"NoSuchEntity", "404", "NoSuchBucket", "NotFound"})


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


def security_group_name(spec: ClusterSpec) -> str:
    return f"sparknet-{spec.name}"


def _tags(spec: ClusterSpec, name: str) -> list[dict[str, str]]:
    return [
        {"Key": TAG_CLUSTER, "Value": spec.name},
        {"Key": TAG_ROLE, "Value": "foundation"},
        {"Key": "Name", "Value": name},
    ]


def _tag_spec(spec: ClusterSpec, kind: str, name: str) -> list[dict[str, Any]]:
    return [{"ResourceType": kind, "Tags": _tags(spec, name)}]


def _filters(spec: ClusterSpec, **more: str) -> list[dict[str, Any]]:
    out = [
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]},
        {"Name": f"tag:{TAG_ROLE}", "Values": ["foundation"]},
    ]
    out += [{"Name": k.replace("_", "-"), "Values": [v]} for k, v in more.items()]
    return out


def subnet_cidr(k: int) -> str:
    """The k-th AZ's subnet: Terraform's `cidrsubnet(vpc_cidr, 24 - <vpc prefix>, k)`."""
    net = ipaddress.ip_network(VPC_CIDR)
    return str(next(itertools.islice(net.subnets(new_prefix=SUBNET_PREFIX), k, None)))


class _Boto3Foundation:
    """The boto3 backend: one method per resource, each find-or-create."""

    def __init__(self, spec: ClusterSpec, endpoint_url: str | None) -> None:
        self.spec = spec
        self.ec2 = instances.ec2_client(spec.region, endpoint_url)
        self.iam = aws.client("iam", spec.region, endpoint_url)
        self.s3 = aws.client("s3", spec.region, endpoint_url)
        self.created: list[str] = []
        self.name = f"sparknet-{spec.name}"

    def _call(self, action: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        with aws.aws_call(action, self.spec.region):
            return fn(**kwargs)

    def _find(
        self, action: str, fn: Callable[..., Any], denied: str | None = None, **kwargs: Any
    ) -> Any:
        """`_call`, but None when the thing is not there (IAM's NoSuchEntity, S3's 404), and
        the `denied` message, when given, for an access-denied answer."""
        try:
            return fn(**kwargs)
        except bx.ClientError as exc:
            code = aws.error_code(exc)
            if code in _ABSENT_CODES:
                return None
            if denied is not None and code in aws.DENIED_CODES:
                raise SparknetError(denied) from exc
            raise aws.describe_error(exc, f"{action} in {self.spec.region}") from exc
        except bx.BotoCoreError as exc:
            raise aws.describe_error(exc, f"{action} in {self.spec.region}") from exc

    # -- network --------------------------------------------------------------------------

    def vpc(self) -> str:
        found = self._call("DescribeVpcs", self.ec2.describe_vpcs, Filters=_filters(self.spec))[
            "Vpcs"
        ]
        if found:
            return found[0]["VpcId"]
        name = f"sparknet-{self.spec.name}"
        vpc = self._call(
            "CreateVpc", self.ec2.create_vpc, CidrBlock=VPC_CIDR,
            TagSpecifications=_tag_spec(self.spec, "vpc", name),
        )["Vpc"]["VpcId"]  # fmt: skip
        self.created.append(f"vpc:{vpc}")
        self._call(
            "ModifyVpcAttribute", self.ec2.modify_vpc_attribute, VpcId=vpc,
            EnableDnsHostnames={"Value": True},
        )  # fmt: skip
        return vpc

    def gateway(self, vpc: str) -> str:
        found = self._call(
            "DescribeInternetGateways", self.ec2.describe_internet_gateways,
            Filters=_filters(self.spec),
        )["InternetGateways"]  # fmt: skip
        if found:
            return found[0]["InternetGatewayId"]
        igw = self._call(
            "CreateInternetGateway", self.ec2.create_internet_gateway,
            TagSpecifications=_tag_spec(self.spec, "internet-gateway", self.name),
        )["InternetGateway"]["InternetGatewayId"]  # fmt: skip
        self.created.append(f"internet-gateway:{igw}")
        self._call(
            "AttachInternetGateway", self.ec2.attach_internet_gateway,
            InternetGatewayId=igw, VpcId=vpc,
        )  # fmt: skip
        return igw

    def zones(self) -> list[str]:
        if self.spec.availability_zones:
            return list(self.spec.availability_zones)
        found = self._call(
            "DescribeAvailabilityZones", self.ec2.describe_availability_zones,
            Filters=[{"Name": "state", "Values": ["available"]}],
        )["AvailabilityZones"]  # fmt: skip
        names = sorted(z["ZoneName"] for z in found)
        if len(names) < 2:
            raise SparknetError(
                f"{self.spec.region} offers {len(names)} availability zone(s); the cluster needs 2"
            )
        return names[:MAX_AZS]

    def subnets(self, vpc: str, zones: list[str]) -> dict[str, str]:
        found = self._call(
            "DescribeSubnets", self.ec2.describe_subnets, Filters=_filters(self.spec, vpc_id=vpc)
        )["Subnets"]
        by_az = {s["AvailabilityZone"]: s["SubnetId"] for s in found}
        for k, az in enumerate(zones):
            if az in by_az:
                continue
            cidr = subnet_cidr(k)
            subnet = self._call(
                "CreateSubnet", self.ec2.create_subnet, VpcId=vpc, CidrBlock=cidr,
                AvailabilityZone=az,
                TagSpecifications=_tag_spec(self.spec, "subnet", f"sparknet-{self.spec.name}-{az}"),
            )["Subnet"]["SubnetId"]  # fmt: skip
            self.created.append(f"subnet:{subnet}")  # no public IPs by default, as in infra/
            by_az[az] = subnet
        return {az: by_az[az] for az in zones}

    def routes(self, vpc: str, igw: str, subnets: dict[str, str]) -> str:
        found = self._call(
            "DescribeRouteTables", self.ec2.describe_route_tables,
            Filters=_filters(self.spec, vpc_id=vpc),
        )["RouteTables"]  # fmt: skip
        if found:
            table = found[0]["RouteTableId"]
            associated = {a.get("SubnetId") for a in found[0].get("Associations", [])}
        else:
            table = self._call(
                "CreateRouteTable", self.ec2.create_route_table, VpcId=vpc,
                TagSpecifications=_tag_spec(self.spec, "route-table", self.name),
            )["RouteTable"]["RouteTableId"]  # fmt: skip
            self.created.append(f"route-table:{table}")
            self._call(
                "CreateRoute", self.ec2.create_route, RouteTableId=table,
                DestinationCidrBlock="0.0.0.0/0", GatewayId=igw,
            )  # fmt: skip
            associated = set()
        for subnet in subnets.values():
            if subnet not in associated:
                self._call(
                    "AssociateRouteTable", self.ec2.associate_route_table,
                    RouteTableId=table, SubnetId=subnet,
                )  # fmt: skip
        return table

    # -- security group -------------------------------------------------------------------

    def security_group(self, vpc: str, allowed_cidr: str) -> str:
        name = security_group_name(self.spec)
        found = self._call(
            "DescribeSecurityGroups", self.ec2.describe_security_groups,
            Filters=_filters(self.spec, vpc_id=vpc, group_name=name),
        )["SecurityGroups"]  # fmt: skip
        if found:
            group = found[0]["GroupId"]
            have = found[0].get("IpPermissions", [])
        else:
            group = self._call(
                "CreateSecurityGroup", self.ec2.create_security_group, GroupName=name,
                Description=f"sparknet cluster {self.spec.name}: SSH from allowed_cidr, "
                "all traffic between members",
                VpcId=vpc, TagSpecifications=_tag_spec(self.spec, "security-group", name),
            )["GroupId"]  # fmt: skip
            self.created.append(f"security-group:{group}")
            have = []
        # the group holds exactly the shared rules: a source left from an earlier `up` (the
        # caller's old address, a rule added by hand) is revoked, not left open
        want, have_atoms = _atoms(ingress_permissions(group, allowed_cidr)), _atoms(have)
        stale = [
            {**perm, key[3]: [{_SOURCES[key[3]]: key[4]}]}  # a revoke names only the source
            for key, perm in have_atoms.items()
            if key not in want
        ]
        missing = [perm for key, perm in want.items() if key not in have_atoms]
        if stale:
            self._call(
                "RevokeSecurityGroupIngress", self.ec2.revoke_security_group_ingress,
                GroupId=group, IpPermissions=stale,
            )  # fmt: skip
        if missing:
            self._call(
                "AuthorizeSecurityGroupIngress", self.ec2.authorize_security_group_ingress,
                GroupId=group, IpPermissions=missing,
            )  # fmt: skip
        return group

    # -- IAM ------------------------------------------------------------------------------

    def node_role(self, bucket: str) -> tuple[str, str]:
        """The node role and its instance profile; the policy is (re)written every time so a
        changed prefix or bucket takes effect."""
        name = node_role_name(self.spec)
        iam_tags = [t for t in _tags(self.spec, name) if t["Key"] != "Name"]
        if self._find("GetRole", self.iam.get_role, RoleName=name) is None:
            self._call(
                "CreateRole", self.iam.create_role, RoleName=name,
                AssumeRolePolicyDocument=json.dumps(policy_document("assume-role")),
                Description=f"sparknet cluster {self.spec.name} nodes", Tags=iam_tags,
            )  # fmt: skip
            self.created.append(f"iam-role:{name}")
        policy = policy_document(
            "instance-role", bucket=bucket, data_prefix=self.spec.data_prefix,
            runs_prefix=self.spec.runs_prefix, cluster=self.spec.name,
        )  # fmt: skip
        self._call(
            "PutRolePolicy", self.iam.put_role_policy, RoleName=name, PolicyName=NODE_POLICY,
            PolicyDocument=json.dumps(policy),
        )  # fmt: skip
        found = self._find(
            "GetInstanceProfile", self.iam.get_instance_profile, InstanceProfileName=name
        )
        if found is not None:
            profile = found["InstanceProfile"]
        else:
            profile = self._call(
                "CreateInstanceProfile", self.iam.create_instance_profile,
                InstanceProfileName=name, Tags=iam_tags,
            )["InstanceProfile"]  # fmt: skip
            self.created.append(f"instance-profile:{name}")
        if not any(r["RoleName"] == name for r in profile.get("Roles", [])):
            self._call(
                "AddRoleToInstanceProfile", self.iam.add_role_to_instance_profile,
                InstanceProfileName=name, RoleName=name,
            )  # fmt: skip
        return name, profile["Arn"]

    # -- bucket ---------------------------------------------------------------------------

    def bucket(self, name: str) -> None:
        """Create the data/runs bucket if it is missing: encrypted, versioned, never public,
        TLS only (the same policy file infra/bucket.tf applies)."""
        taken = (
            f"bucket {name} exists but this account may not use it (403); bucket names are "
            "global: choose another `bucket`, or use credentials that own it"
        )
        if self._find("HeadBucket", self.s3.head_bucket, taken, Bucket=name) is not None:
            return
        extra = (
            {}
            if self.spec.region == "us-east-1"
            else {"CreateBucketConfiguration": {"LocationConstraint": self.spec.region}}
        )
        self._call("CreateBucket", self.s3.create_bucket, Bucket=name, **extra)
        self.created.append(f"bucket:{name}")
        self._call(
            "PutPublicAccessBlock", self.s3.put_public_access_block, Bucket=name,
            PublicAccessBlockConfiguration={
                "BlockPublicAcls": True, "IgnorePublicAcls": True,
                "BlockPublicPolicy": True, "RestrictPublicBuckets": True,
            },
        )  # fmt: skip
        self._call(
            "PutBucketEncryption", self.s3.put_bucket_encryption, Bucket=name,
            ServerSideEncryptionConfiguration={
                "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms"}}]
            },
        )  # fmt: skip
        self._call(
            "PutBucketVersioning", self.s3.put_bucket_versioning, Bucket=name,
            VersioningConfiguration={"Status": "Enabled"},
        )  # fmt: skip
        self._call(
            "PutBucketPolicy", self.s3.put_bucket_policy, Bucket=name,
            Policy=json.dumps(policy_document("bucket-tls-only", bucket=name)),
        )  # fmt: skip
        self._call(
            "PutBucketTagging", self.s3.put_bucket_tagging, Bucket=name,
            Tagging={"TagSet": _tags(self.spec, name)},
        )  # fmt: skip


def ingress_permissions(group_id: str, allowed_cidr: str) -> list[dict[str, Any]]:
    """The shared ingress rules as EC2 IpPermissions for this group and SSH source."""
    out = []
    for rule in security_group_rules("ingress"):
        perm: dict[str, Any] = {"IpProtocol": rule["protocol"]}
        if rule["protocol"] != "-1":
            perm.update(FromPort=rule["from_port"], ToPort=rule["to_port"])
        if rule["source"] == "allowed_cidr":
            perm["IpRanges"] = [{"CidrIp": allowed_cidr, "Description": rule["description"]}]
        else:
            perm["UserIdGroupPairs"] = [{"GroupId": group_id, "Description": rule["description"]}]
        out.append(perm)
    return out


#: the source lists of an IpPermission and the field that names each source
_SOURCES = {
    "IpRanges": "CidrIp",
    "Ipv6Ranges": "CidrIpv6",
    "UserIdGroupPairs": "GroupId",
    "PrefixListIds": "PrefixListId",
}


def _atoms(perms: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Split IpPermissions into one permission per (protocol, ports, source), keyed by those,
    so the rules a group has and the rules it should have compare one source at a time."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for perm in perms:
        proto = perm.get("IpProtocol")
        ports = (
            {}
            if proto == "-1"
            else {"FromPort": perm.get("FromPort"), "ToPort": perm.get("ToPort")}
        )
        for kind, id_key in _SOURCES.items():
            for source in perm.get(kind, []):
                key = (proto, ports.get("FromPort"), ports.get("ToPort"), kind, source[id_key])
                out[key] = {"IpProtocol": proto, **ports, kind: [source]}
    return out


def ensure_boto3(
    spec: ClusterSpec, *, allowed_cidr: str, endpoint_url: str | None = None
) -> Foundation:
    """Find or create every foundation resource of `spec` with boto3."""
    f = _Boto3Foundation(spec, endpoint_url)
    try:
        if spec.vpc_id:
            vpc, subnets = spec.vpc_id, subnet_zones(f.ec2, spec)
        else:
            vpc = f.vpc()
            igw = f.gateway(vpc)
            subnets = f.subnets(vpc, f.zones())
            f.routes(vpc, igw, subnets)
        group = f.security_group(vpc, allowed_cidr)
        bucket = spec.bucket
        if bucket is not None:
            f.bucket(bucket)
        role, profile_arn = f.node_role(bucket or f"sparknet-{spec.name}-unused")
    except BaseException as exc:
        exc.add_note(f"created before the failure: {', '.join(f.created) or 'nothing'}")
        raise
    return Foundation(vpc, subnets, group, role, profile_arn, role, bucket, tuple(f.created))


def destroy_boto3(spec: ClusterSpec, *, endpoint_url: str | None = None) -> list[str]:
    """Delete the cluster's foundation, found by tag and name alone; returns "kind:id" of each.

    The bucket is kept: it holds datasets and runs that outlive any cluster. Call after the
    cluster's instances are terminated (the security group is still in use until then).
    """
    f = _Boto3Foundation(spec, endpoint_url)
    ec2, iam, deleted = f.ec2, f.iam, []
    name = node_role_name(spec)
    found = f._find("GetInstanceProfile", iam.get_instance_profile, InstanceProfileName=name)
    if found is not None:
        for role in found["InstanceProfile"].get("Roles", []):
            f._call(
                "RemoveRoleFromInstanceProfile", iam.remove_role_from_instance_profile,
                InstanceProfileName=name, RoleName=role["RoleName"],
            )  # fmt: skip
        f._call("DeleteInstanceProfile", iam.delete_instance_profile, InstanceProfileName=name)
        deleted.append(f"instance-profile:{name}")
    if f._find("GetRole", iam.get_role, RoleName=name) is not None:
        for policy in f._call("ListRolePolicies", iam.list_role_policies, RoleName=name)[
            "PolicyNames"
        ]:
            f._call("DeleteRolePolicy", iam.delete_role_policy, RoleName=name, PolicyName=policy)
        f._call("DeleteRole", iam.delete_role, RoleName=name)
        deleted.append(f"iam-role:{name}")
    for group in f._call(
        "DescribeSecurityGroups", ec2.describe_security_groups, Filters=_filters(spec)
    )["SecurityGroups"]:
        f._call("DeleteSecurityGroup", ec2.delete_security_group, GroupId=group["GroupId"])
        deleted.append(f"security-group:{group['GroupId']}")
    for table in f._call("DescribeRouteTables", ec2.describe_route_tables, Filters=_filters(spec))[
        "RouteTables"
    ]:
        for assoc in table.get("Associations", []):
            if not assoc.get("Main"):
                f._call(
                    "DisassociateRouteTable", ec2.disassociate_route_table,
                    AssociationId=assoc["RouteTableAssociationId"],
                )  # fmt: skip
        f._call("DeleteRouteTable", ec2.delete_route_table, RouteTableId=table["RouteTableId"])
        deleted.append(f"route-table:{table['RouteTableId']}")
    for subnet in f._call("DescribeSubnets", ec2.describe_subnets, Filters=_filters(spec))[
        "Subnets"
    ]:
        f._call("DeleteSubnet", ec2.delete_subnet, SubnetId=subnet["SubnetId"])
        deleted.append(f"subnet:{subnet['SubnetId']}")
    for igw in f._call(
        "DescribeInternetGateways", ec2.describe_internet_gateways, Filters=_filters(spec)
    )["InternetGateways"]:
        for att in igw.get("Attachments", []):
            f._call(
                "DetachInternetGateway", ec2.detach_internet_gateway,
                InternetGatewayId=igw["InternetGatewayId"], VpcId=att["VpcId"],
            )  # fmt: skip
        f._call(
            "DeleteInternetGateway", ec2.delete_internet_gateway,
            InternetGatewayId=igw["InternetGatewayId"],
        )  # fmt: skip
        deleted.append(f"internet-gateway:{igw['InternetGatewayId']}")
    for vpc in f._call("DescribeVpcs", ec2.describe_vpcs, Filters=_filters(spec))["Vpcs"]:
        f._call("DeleteVpc", ec2.delete_vpc, VpcId=vpc["VpcId"])
        deleted.append(f"vpc:{vpc['VpcId']}")
    return deleted


def subnet_zones(ec2: Any, spec: ClusterSpec, subnet_ids: list[str] | None = None) -> dict:
    """AZ -> subnet of the given subnets (the spec's existing ones by default)."""
    ids = list(subnet_ids if subnet_ids is not None else spec.subnet_ids)
    with aws.aws_call("DescribeSubnets", spec.region):
        found = ec2.describe_subnets(SubnetIds=ids)["Subnets"]
    return {s["AvailabilityZone"]: s["SubnetId"] for s in found}


def terraform_variables(spec: ClusterSpec, allowed_cidr: str) -> dict[str, Any]:
    """The `infra/` module's inputs for `spec`."""
    if spec.bucket is None:
        raise SparknetError(
            f"cluster {spec.name}: foundation terraform needs `bucket` (the data and runs bucket)"
        )
    out: dict[str, Any] = {
        "cluster": spec.name, "region": spec.region, "allowed_cidr": allowed_cidr,
        "bucket": spec.bucket, "data_prefix": spec.data_prefix, "runs_prefix": spec.runs_prefix,
    }  # fmt: skip
    if spec.availability_zones:
        out["availability_zones"] = list(spec.availability_zones)
    if spec.vpc_id:
        out.update(vpc_id=spec.vpc_id, subnet_ids=list(spec.subnet_ids))
    return out


def ensure_terraform(
    spec: ClusterSpec,
    *,
    allowed_cidr: str,
    state_dir: Path,
    endpoint_url: str | None = None,
    module_dir: Path = INFRA_DIR,
) -> Foundation:
    """Apply `infra/` for `spec` (state in `state_dir`) and read the foundation from its outputs."""
    from sparknet.cluster.terraform import TerraformRunner

    runner = TerraformRunner(module_dir, state_dir, backend_config=spec.terraform_backend)
    runner.init()
    runner.apply(terraform_variables(spec, allowed_cidr))
    out = runner.output()
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    return Foundation(
        vpc_id=out["vpc_id"],
        subnet_by_az=subnet_zones(ec2, spec, list(out["subnet_ids"])),
        security_group_id=out["security_group_id"],
        instance_profile_name=out["instance_profile_name"],
        instance_profile_arn=out["instance_profile_arn"],
        role_name=out["instance_profile_name"],
        bucket=out.get("bucket"),
    )


def destroy_terraform(
    spec: ClusterSpec, *, state_dir: Path, module_dir: Path = INFRA_DIR
) -> list[str]:
    """`terraform destroy` of the cluster's state; returns the outputs that named what went."""
    from sparknet.cluster.terraform import TerraformRunner

    runner = TerraformRunner(module_dir, state_dir, backend_config=spec.terraform_backend)
    runner.init()
    out = runner.output()
    # destroy only checks the inputs; a placeholder SSH source passes the module's validation
    runner.destroy(terraform_variables(spec, "127.0.0.1/32"))
    return [f"{name}:{value}" for name, value in out.items() if isinstance(value, str)]
