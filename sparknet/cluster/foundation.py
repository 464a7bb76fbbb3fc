"""The long-lived resources a cluster stands on: network, security group, node role, bucket.

Two backends make the same resources from the same data files (`infra/rules`, `infra/policies`):
`terraform` (the module in `infra/`, through `terraform.py`) and `boto3` (here) for users
without Terraform. Both are idempotent: `ensure` finds what exists (by the cluster tag, or by
name where AWS has no tag lookup) and creates only what is missing, and reports what it created,
so a failed `up` can remove exactly that (`destroy_boto3(..., only=created)`). Without `only`,
`destroy` finds everything by tag and name alone, so it works without any local state.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import json
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import botocore.exceptions as bx

from sparknet import aws, interrupts
from sparknet.cluster import instances
from sparknet.cluster.rules import (
    NO_BUCKET,
    bucket_settings,
    network,
    policy_document,
    rule_description,
    security_group_rules,
    without_s3,
)
from sparknet.cluster.spec import (
    INFRA_DIR,
    TAG_CLUSTER,
    TAG_OWNER,
    TAG_ROLE,
    ClusterSpec,
    check_prefixes,
)
from sparknet.errors import SparknetError

if TYPE_CHECKING:
    from sparknet.cluster.terraform import TerraformRunner

NODE_POLICY = "sparknet-node"
#: what "not there" is called by IAM (get_role, get_instance_profile), S3 (head_bucket, a bucket
#: without tags) and EC2 (an id that is gone)
_ABSENT_CODES = frozenset(
    {
        "NoSuchEntity", "404", "NoSuchBucket", "NotFound", "NoSuchTagSet", "NoSuchTagSetError",
        "InvalidGroup.NotFound", "InvalidSubnetID.NotFound", "InvalidVpcID.NotFound",
        "InvalidRouteTableID.NotFound", "InvalidInternetGatewayID.NotFound",
        "InvalidVpcEndpointId.NotFound",
    }
)  # fmt: skip
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
#: where `foundation: terraform` takes providers from instead of the registry (init -plugin-dir)
PLUGIN_DIR_ENV = "SPARKNET_TF_PLUGIN_DIR"


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


def _tag_spec(spec: ClusterSpec, kind: str, name: str) -> list[dict[str, Any]]:
    return [{"ResourceType": kind, "Tags": tags(spec, name)}]


def _filters(spec: ClusterSpec, **more: str) -> list[dict[str, Any]]:
    out = [
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]},
        {"Name": f"tag:{TAG_ROLE}", "Values": ["foundation"]},
    ]
    out += [{"Name": k.replace("_", "-"), "Values": [v]} for k, v in more.items()]
    return out


def subnet_cidr(k: int) -> str:
    """The k-th AZ's subnet: Terraform's `cidrsubnet(vpc_cidr, <subnet - vpc prefix>, k)`."""
    settings = network()
    net = ipaddress.ip_network(settings["vpc_cidr"])
    subnets = net.subnets(new_prefix=settings["subnet_prefix"])
    return str(next(itertools.islice(subnets, k, None)))


class _Boto3Foundation:
    """The boto3 backend: one method per resource, each find-or-create.

    `created` collects "kind:id" of what this object made, in order, as it makes it: a caller
    that passed its own list still knows what was made when a later step fails.
    """

    def __init__(
        self, spec: ClusterSpec, endpoint_url: str | None, created: list[str] | None = None
    ) -> None:
        self.spec = spec
        self.endpoint_url = endpoint_url
        self.ec2 = instances.ec2_client(spec.region, endpoint_url)
        self.iam = aws.client("iam", spec.region, endpoint_url)
        self.s3 = aws.client("s3", spec.region, endpoint_url)
        self.created: list[str] = created if created is not None else []
        self.name = f"sparknet-{spec.name}"

    def _call(self, action: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        with aws.aws_call(action, self.spec.region):
            return fn(**kwargs)

    def _create(
        self, kind: str, pick: Callable[[Any], str], action: str, fn: Callable[..., Any],
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        """A Create call and the record of its id in `created`, which no signal may split: an
        interrupt in between would leave a resource the clean-up does not know."""
        with interrupts.deferred():
            response = self._call(action, fn, **kwargs)
            self.created.append(f"{kind}:{pick(response)}")
        return response

    def _find(
        self, action: str, fn: Callable[..., Any], denied: str | None = None, **kwargs: Any
    ) -> Any:
        """`_call`, but None when the thing is not there (IAM's NoSuchEntity, S3's 404, EC2's
        *.NotFound), and the `denied` message, when given, for an access-denied answer."""
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

    @functools.cached_property
    def account(self) -> str:
        """The caller's account id (STS): the node role may terminate instances of it only."""
        sts = aws.client("sts", self.spec.region, self.endpoint_url)
        return str(self._call("GetCallerIdentity", sts.get_caller_identity)["Account"])

    # -- network --------------------------------------------------------------------------

    def vpc(self) -> str:
        found = self._call("DescribeVpcs", self.ec2.describe_vpcs, Filters=_filters(self.spec))[
            "Vpcs"
        ]
        if found:
            return found[0]["VpcId"]
        vpc = self._create(
            "vpc", lambda r: r["Vpc"]["VpcId"],
            "CreateVpc", self.ec2.create_vpc, CidrBlock=network()["vpc_cidr"],
            TagSpecifications=_tag_spec(self.spec, "vpc", self.name),
        )["Vpc"]["VpcId"]  # fmt: skip
        for attribute in ("EnableDnsSupport", "EnableDnsHostnames"):  # as infra/network.tf
            self._call(
                "ModifyVpcAttribute", self.ec2.modify_vpc_attribute, VpcId=vpc,
                **{attribute: {"Value": True}},
            )  # fmt: skip
        return vpc

    def default_group(self, vpc: str) -> None:
        """Strip the VPC's `default` security group of every rule, as infra/network.tf's
        aws_default_security_group does: nothing launched without a group is reachable."""
        found = self._call(
            "DescribeSecurityGroups", self.ec2.describe_security_groups,
            Filters=[
                {"Name": "vpc-id", "Values": [vpc]},
                {"Name": "group-name", "Values": ["default"]},
            ],
        )["SecurityGroups"]  # fmt: skip
        for group in found:
            self._revoke(group["GroupId"], "ingress", _atoms(group.get("IpPermissions", [])))
            self._revoke(group["GroupId"], "egress", _atoms(group.get("IpPermissionsEgress", [])))

    def gateway(self, vpc: str) -> str:
        found = self._call(
            "DescribeInternetGateways", self.ec2.describe_internet_gateways,
            Filters=_filters(self.spec),
        )["InternetGateways"]  # fmt: skip
        if found:
            return found[0]["InternetGatewayId"]
        igw = self._create(
            "internet-gateway", lambda r: r["InternetGateway"]["InternetGatewayId"],
            "CreateInternetGateway", self.ec2.create_internet_gateway,
            TagSpecifications=_tag_spec(self.spec, "internet-gateway", self.name),
        )["InternetGateway"]["InternetGatewayId"]  # fmt: skip
        self._call(
            "AttachInternetGateway", self.ec2.attach_internet_gateway,
            InternetGatewayId=igw, VpcId=vpc,
        )  # fmt: skip
        return igw

    def zones(self) -> list[str]:
        """The spec's zones, else the region's first `az_count` regular zones (as infra/)."""
        if self.spec.availability_zones:
            return list(self.spec.availability_zones)
        settings = network()
        found = self._call(
            "DescribeAvailabilityZones", self.ec2.describe_availability_zones,
            Filters=[
                {"Name": "state", "Values": ["available"]},
                {"Name": "zone-type", "Values": [settings["zone_type"]]},
            ],
        )["AvailabilityZones"]  # fmt: skip
        names = sorted(z["ZoneName"] for z in found)
        if len(names) < 2:
            raise SparknetError(
                f"{self.spec.region} offers {len(names)} availability zone(s); the cluster needs 2"
            )
        return names[: settings["az_count"]]

    def subnets(self, vpc: str, zones: list[str]) -> dict[str, str]:
        found = self._call(
            "DescribeSubnets", self.ec2.describe_subnets, Filters=_filters(self.spec, vpc_id=vpc)
        )["Subnets"]
        by_az = {s["AvailabilityZone"]: s["SubnetId"] for s in found}
        for k, az in enumerate(zones):
            if az in by_az:
                continue
            subnet = self._create(  # no public IPs by default, as in infra/
                "subnet", lambda r: r["Subnet"]["SubnetId"],
                "CreateSubnet", self.ec2.create_subnet, VpcId=vpc, CidrBlock=subnet_cidr(k),
                AvailabilityZone=az,
                TagSpecifications=_tag_spec(self.spec, "subnet", f"{self.name}-{az}"),
            )["Subnet"]["SubnetId"]  # fmt: skip
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
            table = self._create(
                "route-table", lambda r: r["RouteTable"]["RouteTableId"],
                "CreateRouteTable", self.ec2.create_route_table, VpcId=vpc,
                TagSpecifications=_tag_spec(self.spec, "route-table", self.name),
            )["RouteTable"]["RouteTableId"]  # fmt: skip
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

    def s3_endpoint(self, vpc: str, table: str) -> str:
        """A gateway endpoint for S3 on the route table (free): S3 traffic stays inside AWS
        instead of going out through the internet gateway."""
        service = f"com.amazonaws.{self.spec.region}.s3"
        found = self._call(
            "DescribeVpcEndpoints", self.ec2.describe_vpc_endpoints,
            Filters=_filters(self.spec, vpc_id=vpc, service_name=service),
        )["VpcEndpoints"]  # fmt: skip
        live = [e for e in found if e.get("State", "").lower() not in ("deleting", "deleted")]
        if live:
            endpoint = live[0]
            if table not in endpoint.get("RouteTableIds", []):
                self._call(
                    "ModifyVpcEndpoint", self.ec2.modify_vpc_endpoint,
                    VpcEndpointId=endpoint["VpcEndpointId"], AddRouteTableIds=[table],
                )  # fmt: skip
            return endpoint["VpcEndpointId"]
        endpoint_id = self._create(
            "vpc-endpoint", lambda r: r["VpcEndpoint"]["VpcEndpointId"],
            "CreateVpcEndpoint", self.ec2.create_vpc_endpoint, VpcEndpointType="Gateway",
            VpcId=vpc, ServiceName=service, RouteTableIds=[table],
            TagSpecifications=_tag_spec(self.spec, "vpc-endpoint", f"{self.name}-s3"),
        )["VpcEndpoint"]["VpcEndpointId"]  # fmt: skip
        return endpoint_id

    # -- security group -------------------------------------------------------------------

    def security_group(self, vpc: str, allowed_cidr: str) -> str:
        name = security_group_name(self.spec)
        found = self._call(
            "DescribeSecurityGroups", self.ec2.describe_security_groups,
            Filters=_filters(self.spec, vpc_id=vpc, group_name=name),
        )["SecurityGroups"]  # fmt: skip
        if found:
            group = found[0]["GroupId"]
            have = {
                "ingress": found[0].get("IpPermissions", []),
                "egress": found[0].get("IpPermissionsEgress", []),
            }
        else:
            made = self._create(
                "security-group", lambda r: r["GroupId"],
                "CreateSecurityGroup", self.ec2.create_security_group, GroupName=name,
                Description=security_group_description(self.spec), VpcId=vpc,
                TagSpecifications=_tag_spec(self.spec, "security-group", name),
            )  # fmt: skip
            group = made["GroupId"]
            described = self._call(
                "DescribeSecurityGroups", self.ec2.describe_security_groups, GroupIds=[group]
            )["SecurityGroups"][0]
            have = {"ingress": [], "egress": described.get("IpPermissionsEgress", [])}
        # the group holds exactly the shared rules, both ways: a source left from an earlier
        # `up` (the caller's old address, a rule added by hand) is revoked, not left open, and
        # AWS's default allow-all egress gives way to the described one of the rules file
        for direction in ("ingress", "egress"):
            want = _atoms(permissions(direction, group, allowed_cidr))
            atoms = _atoms(have[direction])
            self._revoke(group, direction, {k: p for k, p in atoms.items() if k not in want})
            missing = [perm for key, perm in want.items() if key not in atoms]
            if missing:
                call = f"authorize_security_group_{direction}"
                self._call(
                    f"AuthorizeSecurityGroup{direction.title()}", getattr(self.ec2, call),
                    GroupId=group, IpPermissions=missing,
                )  # fmt: skip
        return group

    def _revoke(self, group: str, direction: str, atoms: dict[tuple[Any, ...], Any]) -> None:
        if not atoms:
            return
        # a revoke names only the source, not its description
        perms = [{**perm, key[3]: [{_SOURCES[key[3]]: key[4]}]} for key, perm in atoms.items()]
        self._call(
            f"RevokeSecurityGroup{direction.title()}",
            getattr(self.ec2, f"revoke_security_group_{direction}"),
            GroupId=group, IpPermissions=perms,
        )  # fmt: skip

    # -- IAM ------------------------------------------------------------------------------

    def node_role(self, bucket: str | None) -> tuple[str, str]:
        """The node role and its instance profile; the policy is (re)written every time so a
        changed prefix or bucket takes effect (and S3 access goes when the bucket does)."""
        name = node_role_name(self.spec)
        iam_tags = tags(self.spec)
        if self._find("GetRole", self.iam.get_role, RoleName=name) is None:
            self._create(
                "iam-role", lambda _: name,
                "CreateRole", self.iam.create_role, RoleName=name,
                AssumeRolePolicyDocument=json.dumps(policy_document("assume-role")),
                Description=node_role_description(self.spec), MaxSessionDuration=3600,
                Tags=iam_tags,
            )  # fmt: skip
        policy = node_policy(self.spec, bucket, self.account)
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
            profile = self._create(
                "instance-profile", lambda _: name,
                "CreateInstanceProfile", self.iam.create_instance_profile,
                InstanceProfileName=name, Tags=iam_tags,
            )["InstanceProfile"]  # fmt: skip
        if not any(r["RoleName"] == name for r in profile.get("Roles", [])):
            self._call(
                "AddRoleToInstanceProfile", self.iam.add_role_to_instance_profile,
                InstanceProfileName=name, RoleName=name,
            )  # fmt: skip
        return name, profile["Arn"]

    # -- bucket ---------------------------------------------------------------------------

    def bucket(self, name: str) -> None:
        """Create the data/runs bucket if it is missing, and hold a sparknet bucket (one made by
        sparknet: it carries the foundation tag) to `infra/rules/bucket.json` on every call, so
        a setting changed by hand is put back. A bucket of the user's own is left as it is: its
        policy and settings are theirs."""
        taken = (
            f"bucket {name} exists but this account may not use it (403); bucket names are "
            "global: choose another `bucket`, or use credentials that own it"
        )
        if self._find("HeadBucket", self.s3.head_bucket, taken, Bucket=name) is None:
            extra = (
                {}
                if self.spec.region == "us-east-1"
                else {"CreateBucketConfiguration": {"LocationConstraint": self.spec.region}}
            )
            self._create(
                "bucket", lambda _: name, "CreateBucket", self.s3.create_bucket, Bucket=name,
                **extra,
            )  # fmt: skip
            self._call(
                "PutBucketTagging", self.s3.put_bucket_tagging, Bucket=name,
                Tagging={"TagSet": tags(self.spec, name)},
            )  # fmt: skip
        elif not self._made_by_sparknet(name):
            return
        self.harden_bucket(name)

    def _made_by_sparknet(self, name: str) -> bool:
        found = self._find("GetBucketTagging", self.s3.get_bucket_tagging, Bucket=name)
        have = {t["Key"]: t["Value"] for t in (found or {}).get("TagSet", [])}
        return have.get(TAG_ROLE) == "foundation" and TAG_CLUSTER in have

    def harden_bucket(self, name: str) -> None:
        """Put `infra/rules/bucket.json` on the bucket (as infra/bucket.tf): never public,
        ownership enforced (no ACLs), KMS with a bucket key, versioned, TLS only, old versions
        and failed uploads expired."""
        want = bucket_settings()
        calls: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [
            ("PutPublicAccessBlock", self.s3.put_public_access_block, {
                "PublicAccessBlockConfiguration": {
                    "BlockPublicAcls": True, "IgnorePublicAcls": True,
                    "BlockPublicPolicy": True, "RestrictPublicBuckets": True,
                }}),
            ("PutBucketOwnershipControls", self.s3.put_bucket_ownership_controls, {
                "OwnershipControls": {"Rules": [{"ObjectOwnership": want["object_ownership"]}]}}),
            ("PutBucketEncryption", self.s3.put_bucket_encryption, {
                "ServerSideEncryptionConfiguration": {"Rules": [{
                    "ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": want["sse_algorithm"]},
                    "BucketKeyEnabled": want["bucket_key_enabled"],
                }]}}),
            ("PutBucketVersioning", self.s3.put_bucket_versioning, {
                "VersioningConfiguration": {"Status": want["versioning"]}}),
            ("PutBucketPolicy", self.s3.put_bucket_policy, {
                "Policy": json.dumps(policy_document(
                    "bucket-tls-only", partition=partition(self.spec.region), bucket=name))}),
            ("PutBucketLifecycleConfiguration", self.s3.put_bucket_lifecycle_configuration, {
                "LifecycleConfiguration": {"Rules": [bucket_lifecycle_rule(want)]}}),
        ]  # fmt: skip
        for action, fn, kwargs in calls:
            self._call(action, fn, Bucket=name, **kwargs)


def bucket_lifecycle_rule(settings: dict[str, Any]) -> dict[str, Any]:
    """The one lifecycle rule of a sparknet bucket (the rule infra/bucket.tf names the same)."""
    return {
        "ID": "expire-old-versions-and-failed-uploads",
        "Status": "Enabled",
        "Filter": {"Prefix": ""},  # every object; what Terraform's empty `filter {}` sends
        "NoncurrentVersionExpiration": {
            "NoncurrentDays": settings["noncurrent_version_expiration_days"]
        },
        "AbortIncompleteMultipartUpload": {
            "DaysAfterInitiation": settings["abort_incomplete_multipart_upload_days"]
        },
    }


def node_policy(spec: ClusterSpec, bucket: str | None, account: str) -> dict[str, Any]:
    """The node role's policy: data read, its own runs prefix read/write/delete (the driver on
    the master discards an incomplete checkpoint and releases the run's lock), and terminate only
    its own cluster's instances, in its region and account. Without a bucket it has no S3
    statement at all: a stand-in bucket name would grant access to a bucket anyone could
    create."""
    document = policy_document(
        "instance-role", partition=partition(spec.region), region=spec.region, account=account,
        bucket=bucket or NO_BUCKET, data_prefix=spec.data_prefix, runs_prefix=spec.runs_prefix,
        cluster=spec.name,
    )  # fmt: skip
    return document if bucket is not None else without_s3(document)


def permissions(direction: str, group_id: str, allowed_cidr: str) -> list[dict[str, Any]]:
    """The shared rules of one direction as EC2 IpPermissions for this group and SSH source."""
    out = []
    for rule in security_group_rules(direction):  # type: ignore[arg-type]
        perm: dict[str, Any] = {"IpProtocol": rule["protocol"]}
        if rule["protocol"] != "-1":
            perm.update(FromPort=rule["from_port"], ToPort=rule["to_port"])
        peer = rule.get("source") or rule.get("destination")
        description = rule_description(rule, allowed_cidr)
        if peer == "self":
            perm["UserIdGroupPairs"] = [{"GroupId": group_id, "Description": description}]
        else:
            cidr = allowed_cidr if peer == "allowed_cidr" else "0.0.0.0/0"
            perm["IpRanges"] = [{"CidrIp": cidr, "Description": description}]
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
    """Split IpPermissions into one permission per (protocol, ports, source, description), keyed
    by those, so the rules a group has and the rules it should have compare one source at a
    time; a changed description counts as a different rule (revoked, then authorized)."""
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
                key = (
                    proto, ports.get("FromPort"), ports.get("ToPort"), kind, source[id_key],
                    source.get("Description") or "",
                )  # fmt: skip
                out[key] = {"IpProtocol": proto, **ports, kind: [source]}
    return out


def check_spec_prefixes(spec: ClusterSpec) -> None:
    """`spec`'s bucket prefixes against the rule both foundations apply (`spec.check_prefixes`,
    as infra/variables.tf): checked again here, as a spec changed with `model_copy` skips its
    validators."""
    try:
        check_prefixes(spec.data_prefix, spec.runs_prefix)
    except ValueError as exc:
        raise SparknetError(f"cluster {spec.name}: {exc}") from exc


def ensure_boto3(
    spec: ClusterSpec,
    *,
    allowed_cidr: str,
    endpoint_url: str | None = None,
    created: list[str] | None = None,
) -> Foundation:
    """Find or create every foundation resource of `spec` with boto3.

    Args:
        created: a list this call appends "kind:id" to as it creates each resource, so a caller
            knows what was made even when a later step fails (then pass it to
            `destroy_boto3(..., only=created)`); the returned `Foundation.created` holds the same.
    """
    check_spec_prefixes(spec)
    f = _Boto3Foundation(spec, endpoint_url, created)
    try:
        if spec.vpc_id:
            vpc, subnets = spec.vpc_id, subnet_zones(f.ec2, spec)
        else:
            vpc = f.vpc()
            f.default_group(vpc)
            igw = f.gateway(vpc)
            subnets = f.subnets(vpc, f.zones())
            table = f.routes(vpc, igw, subnets)
            f.s3_endpoint(vpc, table)
        group = f.security_group(vpc, allowed_cidr)
        bucket = spec.bucket
        if bucket is not None:
            f.bucket(bucket)
        role, profile_arn = f.node_role(bucket)
    except BaseException as exc:
        exc.add_note(f"created before the failure: {', '.join(f.created) or 'nothing'}")
        raise
    return Foundation(vpc, subnets, group, role, profile_arn, role, bucket, tuple(f.created))


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
    f = _Boto3Foundation(spec, endpoint_url)
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


def _tagged(f: _Boto3Foundation) -> dict[str, list[str]]:
    """Everything of the cluster's foundation, by tag (EC2) and by name (IAM)."""
    spec, ec2, iam = f.spec, f.ec2, f.iam
    name = node_role_name(spec)
    out: dict[str, list[str]] = {}
    if f._find("GetInstanceProfile", iam.get_instance_profile, InstanceProfileName=name):
        out["instance-profile"] = [name]
    if f._find("GetRole", iam.get_role, RoleName=name):
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
        items = f._call(action, fn, Filters=_filters(spec))[key]
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
        deadline = time.monotonic() + DEPENDENCY_WAIT_S
        pause = 1.0
        while True:
            try:
                return fn(**kwargs)
            except bx.ClientError as exc:
                if aws.error_code(exc) not in _BUSY_CODES or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 15.0)

    return call


def _delete_instance_profile(f: _Boto3Foundation, name: str) -> bool:
    found = f._find("GetInstanceProfile", f.iam.get_instance_profile, InstanceProfileName=name)
    if found is None:
        return False
    for role in found["InstanceProfile"].get("Roles", []):
        f._call(
            "RemoveRoleFromInstanceProfile", f.iam.remove_role_from_instance_profile,
            InstanceProfileName=name, RoleName=role["RoleName"],
        )  # fmt: skip
    f._call("DeleteInstanceProfile", f.iam.delete_instance_profile, InstanceProfileName=name)
    return True


def _delete_role(f: _Boto3Foundation, name: str) -> bool:
    if f._find("GetRole", f.iam.get_role, RoleName=name) is None:
        return False
    profiles = f._call(
        "ListInstanceProfilesForRole", f.iam.list_instance_profiles_for_role, RoleName=name
    )["InstanceProfiles"]
    for profile in profiles:  # a profile this call did not create still holds the role
        f._call(
            "RemoveRoleFromInstanceProfile", f.iam.remove_role_from_instance_profile,
            InstanceProfileName=profile["InstanceProfileName"], RoleName=name,
        )  # fmt: skip
    policies = f._call("ListRolePolicies", f.iam.list_role_policies, RoleName=name)
    for policy in policies["PolicyNames"]:
        f._call("DeleteRolePolicy", f.iam.delete_role_policy, RoleName=name, PolicyName=policy)
    f._call("DeleteRole", f.iam.delete_role, RoleName=name)
    return True


def _delete_endpoint(f: _Boto3Foundation, endpoint: str) -> bool:
    answer = f._find("DeleteVpcEndpoints", f.ec2.delete_vpc_endpoints, VpcEndpointIds=[endpoint])
    return answer is not None and not answer.get("Unsuccessful")


def _delete_group(f: _Boto3Foundation, group: str) -> bool:
    found = f._find("DescribeSecurityGroups", f.ec2.describe_security_groups, GroupIds=[group])
    if not found or not _deletable("security-group", found["SecurityGroups"][0]):
        return False
    deleted = f._find("DeleteSecurityGroup", patient(f.ec2.delete_security_group), GroupId=group)
    return deleted is not None


def _delete_route_table(f: _Boto3Foundation, table: str) -> bool:
    found = f._find("DescribeRouteTables", f.ec2.describe_route_tables, RouteTableIds=[table])
    if not found or not _deletable("route-table", found["RouteTables"][0]):
        return False
    for assoc in found["RouteTables"][0].get("Associations", []):
        f._find(
            "DisassociateRouteTable", f.ec2.disassociate_route_table,
            AssociationId=assoc["RouteTableAssociationId"],
        )  # fmt: skip
    return f._find("DeleteRouteTable", f.ec2.delete_route_table, RouteTableId=table) is not None


def _delete_subnet(f: _Boto3Foundation, subnet: str) -> bool:
    return f._find("DeleteSubnet", patient(f.ec2.delete_subnet), SubnetId=subnet) is not None


def _delete_gateway(f: _Boto3Foundation, igw: str) -> bool:
    found = f._find(
        "DescribeInternetGateways", f.ec2.describe_internet_gateways, InternetGatewayIds=[igw]
    )
    if not found or not found["InternetGateways"]:
        return False
    for att in found["InternetGateways"][0].get("Attachments", []):
        f._find(
            "DetachInternetGateway", patient(f.ec2.detach_internet_gateway),
            InternetGatewayId=igw, VpcId=att["VpcId"],
        )  # fmt: skip
    deleted = f._find(
        "DeleteInternetGateway", patient(f.ec2.delete_internet_gateway), InternetGatewayId=igw
    )
    return deleted is not None


def _delete_vpc(f: _Boto3Foundation, vpc: str) -> bool:
    return f._find("DeleteVpc", patient(f.ec2.delete_vpc), VpcId=vpc) is not None


_DELETERS: dict[str, Callable[[_Boto3Foundation, str], bool]] = {
    "instance-profile": _delete_instance_profile,
    "iam-role": _delete_role,
    "vpc-endpoint": _delete_endpoint,
    "security-group": _delete_group,
    "route-table": _delete_route_table,
    "subnet": _delete_subnet,
    "internet-gateway": _delete_gateway,
    "vpc": _delete_vpc,
}


def subnet_zones(ec2: Any, spec: ClusterSpec, subnet_ids: list[str] | None = None) -> dict:
    """AZ -> subnet of the given subnets (the spec's existing ones by default)."""
    ids = list(subnet_ids if subnet_ids is not None else spec.subnet_ids)
    with aws.aws_call("DescribeSubnets", spec.region):
        found = ec2.describe_subnets(SubnetIds=ids)["Subnets"]
    return {s["AvailabilityZone"]: s["SubnetId"] for s in found}


def terraform_variables(spec: ClusterSpec, allowed_cidr: str) -> dict[str, Any]:
    """The `infra/` module's inputs for `spec`."""
    check_spec_prefixes(spec)
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
    if spec.owner:
        out["owner"] = spec.owner
    return out


def _runner(spec: ClusterSpec, state_dir: Path, module_dir: Path) -> TerraformRunner:
    """The cluster's Terraform runner; providers from `$SPARKNET_TF_PLUGIN_DIR` when set (a
    machine without the registry), else the registry through the plugin cache."""
    from sparknet.cluster.terraform import TerraformRunner

    return TerraformRunner(
        module_dir, state_dir, backend_config=spec.terraform_backend,
        plugin_dir=os.environ.get(PLUGIN_DIR_ENV) or None,
    )  # fmt: skip


def ensure_terraform(
    spec: ClusterSpec,
    *,
    allowed_cidr: str,
    state_dir: Path,
    endpoint_url: str | None = None,
    module_dir: Path = INFRA_DIR,
) -> Foundation:
    """Apply `infra/` for `spec` (state in `state_dir`) and read the foundation from its outputs."""
    runner = _runner(spec, state_dir, module_dir)
    runner.init()
    runner.apply(terraform_variables(spec, allowed_cidr))
    out = runner.output()
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    # the bucket outlives clusters, so it is not in a cluster's state: made and held to
    # infra/rules/bucket.json here, as the boto3 foundation does (infra/bucket.tf makes the same
    # bucket with create_bucket = true, for use by hand)
    made: list[str] = []
    if spec.bucket is not None:
        _Boto3Foundation(spec, endpoint_url, made).bucket(spec.bucket)
    return Foundation(
        vpc_id=out["vpc_id"],
        subnet_by_az=subnet_zones(ec2, spec, list(out["subnet_ids"])),
        security_group_id=out["security_group_id"],
        instance_profile_name=out["instance_profile_name"],
        instance_profile_arn=out["instance_profile_arn"],
        role_name=out["instance_profile_name"],
        bucket=out.get("bucket"),
        created=tuple(made),
    )


#: the Terraform resource types of infra/ that `destroy` reports, as the kinds `destroy_boto3`
#: names; each one's ``id`` is what boto3 calls it by (IAM: the name). The bucket is absent: it
#: is kept
TERRAFORM_KINDS = {
    "aws_iam_instance_profile": "instance-profile", "aws_iam_role": "iam-role",
    "aws_vpc_endpoint": "vpc-endpoint", "aws_security_group": "security-group",
    "aws_route_table": "route-table", "aws_subnet": "subnet",
    "aws_internet_gateway": "internet-gateway", "aws_vpc": "vpc",
}  # fmt: skip


def destroy_terraform(
    spec: ClusterSpec,
    *,
    state_dir: Path,
    module_dir: Path = INFRA_DIR,
    endpoint_url: str | None = None,
) -> list[str]:
    """`terraform destroy` of the cluster's state, then by tag (`destroy_boto3`) whatever of the
    cluster is still there in its region: what an interrupted apply made but never recorded, or
    what a boto3 `up` of the same name added. Returns "kind:id" of each resource that is gone
    now and was not before, never the bucket (kept) or an output's name.

    Raises `SparknetError` naming what is still tagged with the cluster afterwards, so nobody
    reports "removed" while something is left.
    """
    runner = _runner(spec, state_dir, module_dir)
    runner.init()
    recorded = [
        f"{TERRAFORM_KINDS[kind]}:{values['id']}"
        for kind, values in runner.resources()
        if kind in TERRAFORM_KINDS and values.get("id")
    ]
    # destroy only checks the inputs; a placeholder SSH source passes the module's validation
    runner.destroy(terraform_variables(spec, "127.0.0.1/32"))
    swept = destroy_boto3(spec, endpoint_url=endpoint_url)  # raises if anything is left
    f = _Boto3Foundation(spec, endpoint_url)
    gone = [item for item in recorded if not _still_there(f, item)]
    return gone + [item for item in swept if item not in gone]


def check_removed(spec: ClusterSpec, *, endpoint_url: str | None = None) -> None:
    """Raise `SparknetError` when any foundation resource of the cluster is still there (by tag
    in its region, IAM by name): what a clean-up checks before it says "removed"."""
    left = _tagged(_Boto3Foundation(spec, endpoint_url))
    items = [f"{kind}:{ident}" for kind in DESTROY_ORDER for ident in left.get(kind, [])]
    if items:
        raise SparknetError(
            f"cluster {spec.name} in {spec.region} still has {', '.join(items)} after the "
            f"destroy; run `sparknet cluster down {spec.name} --region {spec.region}` again"
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


def _still_there(f: _Boto3Foundation, item: str) -> bool:
    """Whether the "kind:id" resource exists (an endpoint that is deleting counts as gone)."""
    kind, _, ident = item.partition(":")
    action, client, method, param, key = _LOOKUPS[kind]
    value: str | list[str] = ident if client == "iam" else [ident]
    found = f._find(action, getattr(getattr(f, client), method), **{param: value})
    if found is None:
        return False
    answer = found[key]
    if isinstance(answer, dict):
        return True
    return any(kind != "vpc-endpoint" or _deletable(kind, one) for one in answer)
