"""The boto3 foundation, for users without Terraform.

Every resource of `foundation.py` found or made with plain API calls.

Separate from `terraform_foundation.py` (the other backend, behind the same `Foundation`) and
from `boto3_teardown.py`: making is one method per resource on `Boto3Foundation`, which the
Terraform backend also uses for the bucket (kept out of a cluster's Terraform state), while
taking apart serves both backends.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bx

from sparknet import aws, interrupts
from sparknet.cluster.aws import instances
from sparknet.cluster.aws.foundation import (
    NODE_POLICY,
    Foundation,
    check_spec_prefixes,
    node_role_description,
    node_role_name,
    partition,
    region_zones,
    security_group_description,
    security_group_name,
    subnet_cidr,
    subnet_zones,
    tags,
)
from sparknet.cluster.aws.rules import (
    NO_BUCKET,
    bucket_settings,
    network,
    policy_document,
    rule_description,
    security_group_rules,
    without_s3,
)
from sparknet.cluster.spec import TAG_CLUSTER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError

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


#: how long a bucket made a moment ago may be unknown to S3's other calls (NoSuchBucket)
NEW_BUCKET_WAIT_S = 30.0


@dataclass(frozen=True)
class BucketState:
    """What `Boto3Foundation.bucket` found: whether this call made the bucket, whether it is
    sparknet's (tagged so, hence held to the foundation's settings), and its region (None where
    the store does not say)."""

    made: bool
    sparknet: bool
    region: str | None


def _tag_spec(spec: ClusterSpec, kind: str, name: str) -> list[dict[str, Any]]:
    return [{"ResourceType": kind, "Tags": tags(spec, name)}]


def filters(spec: ClusterSpec, **more: str) -> list[dict[str, Any]]:
    out = [
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]},
        {"Name": f"tag:{TAG_ROLE}", "Values": ["foundation"]},
    ]
    out += [{"Name": k.replace("_", "-"), "Values": [v]} for k, v in more.items()]
    return out


class Boto3Foundation:
    """The boto3 backend: one method per resource, each find-or-create.

    `created` collects "kind:id" of what this object made, in order, as it makes it: a caller
    that passed its own list still knows what was made when a later step fails.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        endpoint_url: str | None,
        created: list[str] | None = None,
        *,
        tls_only: bool = True,
    ) -> None:
        self.spec = spec
        self.endpoint_url = endpoint_url
        #: False: a sparknet bucket gets every setting but the TLS-only policy (which it loses),
        #: for a store reached over plain http (`data upload` to MinIO), where that policy
        #: would deny every request of the tool that made the bucket
        self.tls_only = tls_only
        self.ec2 = instances.ec2_client(spec.region, endpoint_url)
        self.iam = aws.client("iam", spec.region, endpoint_url)
        self.s3 = aws.client("s3", spec.region, endpoint_url)
        self.created: list[str] = created if created is not None else []
        self.name = f"sparknet-{spec.name}"

    @property
    def plain_http(self) -> bool:
        """Whether S3 is reached over plain http (a local MinIO or moto; AWS is https), from the
        endpoint its client uses: the one given, else AWS_ENDPOINT_URL(_S3)."""
        return str(self.s3.meta.endpoint_url).lower().startswith("http://")

    def call(self, action: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        with aws.aws_call(action, self.spec.region):
            return fn(**kwargs)

    def _create(
        self, kind: str, pick: Callable[[Any], str], action: str, fn: Callable[..., Any],
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        """A Create call and the record of its id in `created`, which no signal may split: an
        interrupt in between would leave a resource the clean-up does not know."""
        with interrupts.deferred():
            response = self.call(action, fn, **kwargs)
            self.created.append(f"{kind}:{pick(response)}")
        return response

    def find(
        self, action: str, fn: Callable[..., Any], denied: str | None = None, **kwargs: Any
    ) -> Any:
        """`call`, but None when the thing is not there (IAM's NoSuchEntity, S3's 404, EC2's
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
        return str(self.call("GetCallerIdentity", sts.get_caller_identity)["Account"])

    # -- network --------------------------------------------------------------------------

    def vpc(self) -> str:
        found = self.call("DescribeVpcs", self.ec2.describe_vpcs, Filters=filters(self.spec))[
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
            self.call(
                "ModifyVpcAttribute", self.ec2.modify_vpc_attribute, VpcId=vpc,
                **{attribute: {"Value": True}},
            )  # fmt: skip
        return vpc

    def default_group(self, vpc: str) -> None:
        """Strip the VPC's `default` security group of every rule, as infra/network.tf's
        aws_default_security_group does: nothing launched without a group is reachable."""
        found = self.call(
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
        found = self.call(
            "DescribeInternetGateways", self.ec2.describe_internet_gateways,
            Filters=filters(self.spec),
        )["InternetGateways"]  # fmt: skip
        if found:
            return found[0]["InternetGatewayId"]
        igw = self._create(
            "internet-gateway", lambda r: r["InternetGateway"]["InternetGatewayId"],
            "CreateInternetGateway", self.ec2.create_internet_gateway,
            TagSpecifications=_tag_spec(self.spec, "internet-gateway", self.name),
        )["InternetGateway"]["InternetGatewayId"]  # fmt: skip
        self.call(
            "AttachInternetGateway", self.ec2.attach_internet_gateway,
            InternetGatewayId=igw, VpcId=vpc,
        )  # fmt: skip
        return igw

    def zones(self) -> list[str]:
        """The spec's zones, else the region's first `az_count` regular zones (as infra/)."""
        if self.spec.availability_zones:
            return list(self.spec.availability_zones)
        return region_zones(self.ec2, self.spec.region)

    def subnets(self, vpc: str, zones: list[str]) -> dict[str, str]:
        found = self.call(
            "DescribeSubnets", self.ec2.describe_subnets, Filters=filters(self.spec, vpc_id=vpc)
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
        found = self.call(
            "DescribeRouteTables", self.ec2.describe_route_tables,
            Filters=filters(self.spec, vpc_id=vpc),
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
            self.call(
                "CreateRoute", self.ec2.create_route, RouteTableId=table,
                DestinationCidrBlock="0.0.0.0/0", GatewayId=igw,
            )  # fmt: skip
            associated = set()
        for subnet in subnets.values():
            if subnet not in associated:
                self.call(
                    "AssociateRouteTable", self.ec2.associate_route_table,
                    RouteTableId=table, SubnetId=subnet,
                )  # fmt: skip
        return table

    def s3_endpoint(self, vpc: str, table: str) -> str:
        """A gateway endpoint for S3 on the route table (free): S3 traffic stays inside AWS
        instead of going out through the internet gateway."""
        service = f"com.amazonaws.{self.spec.region}.s3"
        found = self.call(
            "DescribeVpcEndpoints", self.ec2.describe_vpc_endpoints,
            Filters=filters(self.spec, vpc_id=vpc, service_name=service),
        )["VpcEndpoints"]  # fmt: skip
        live = [e for e in found if e.get("State", "").lower() not in ("deleting", "deleted")]
        if live:
            endpoint = live[0]
            if table not in endpoint.get("RouteTableIds", []):
                self.call(
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
        found = self.call(
            "DescribeSecurityGroups", self.ec2.describe_security_groups,
            Filters=filters(self.spec, vpc_id=vpc, group_name=name),
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
            described = self.call(
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
                self.call(
                    f"AuthorizeSecurityGroup{direction.title()}", getattr(self.ec2, call),
                    GroupId=group, IpPermissions=missing,
                )  # fmt: skip
        return group

    def _revoke(self, group: str, direction: str, atoms: dict[tuple[Any, ...], Any]) -> None:
        if not atoms:
            return
        # a revoke names only the source, not its description
        perms = [{**perm, key[3]: [{_SOURCES[key[3]]: key[4]}]} for key, perm in atoms.items()]
        self.call(
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
        if self.find("GetRole", self.iam.get_role, RoleName=name) is None:
            self._create(
                "iam-role", lambda _: name,
                "CreateRole", self.iam.create_role, RoleName=name,
                AssumeRolePolicyDocument=json.dumps(policy_document("assume-role")),
                Description=node_role_description(self.spec), MaxSessionDuration=3600,
                Tags=iam_tags,
            )  # fmt: skip
        policy = node_policy(self.spec, bucket, self.account)
        self.call(
            "PutRolePolicy", self.iam.put_role_policy, RoleName=name, PolicyName=NODE_POLICY,
            PolicyDocument=json.dumps(policy),
        )  # fmt: skip
        found = self.find(
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
            self.call(
                "AddRoleToInstanceProfile", self.iam.add_role_to_instance_profile,
                InstanceProfileName=name, RoleName=name,
            )  # fmt: skip
        return name, profile["Arn"]

    # -- bucket ---------------------------------------------------------------------------

    def bucket(self, name: str) -> BucketState:
        """Create the data/runs bucket if it is missing, and hold a sparknet bucket (one made by
        sparknet: it carries the foundation tag) to `infra/rules/bucket.json` on every call, so
        a setting changed by hand, or one a stopped run never put, is put (back) on it. A bucket
        of the user's own is left as it is: its policy and settings are theirs.

        A new bucket is tagged in the same signal-deferred section as it is made, and deleted
        again (it is empty) when the tag cannot be put: no bucket of ours is ever left untagged,
        which every later call would take for the user's own and never harden. A CreateBucket
        that answers BucketAlreadyOwnedByYou (another run made it between our look and our
        create, outside us-east-1) is "there already"."""
        taken = (
            f"bucket {name} exists but this account may not use it (403); bucket names are "
            "global: choose another `bucket`, or use credentials that own it"
        )
        head = self.find("HeadBucket", self.s3.head_bucket, taken, Bucket=name)
        made = head is None and self._make_tagged(name)
        if made:
            region: str | None = self.spec.region
        else:
            head = head or self.find("HeadBucket", self.s3.head_bucket, taken, Bucket=name)
            region = (head or {}).get("BucketRegion")
        ours = made or self._made_by_sparknet(name)
        if ours:
            self.harden_bucket(name)
        return BucketState(made=made, sparknet=ours, region=region)

    def _make_tagged(self, name: str) -> bool:
        """CreateBucket and its foundation tag, no signal between them; False when the bucket
        turns out to be ours already (BucketAlreadyOwnedByYou)."""
        extra = (
            {}
            if self.spec.region == "us-east-1"
            else {"CreateBucketConfiguration": {"LocationConstraint": self.spec.region}}
        )
        with interrupts.deferred():
            try:
                self.s3.create_bucket(Bucket=name, **extra)
            except bx.ClientError as exc:
                if aws.error_code(exc) == "BucketAlreadyOwnedByYou":
                    return False
                raise aws.describe_error(exc, f"CreateBucket in {self.spec.region}") from exc
            except bx.BotoCoreError as exc:
                raise aws.describe_error(exc, f"CreateBucket in {self.spec.region}") from exc
            self.created.append(f"bucket:{name}")
            try:
                self._on_new_bucket(
                    "PutBucketTagging", self.s3.put_bucket_tagging, Bucket=name,
                    Tagging={"TagSet": tags(self.spec, name)},
                )  # fmt: skip
            except BaseException as exc:
                self._unmake(name, exc)
                raise
        return True

    def _unmake(self, name: str, exc: BaseException) -> None:
        """Delete the empty bucket this object just made and could not tag, so a re-run makes
        it again, tagged; a note on `exc` says whether that worked."""
        try:
            self.s3.delete_bucket(Bucket=name)
        except (bx.ClientError, bx.BotoCoreError) as gone:
            exc.add_note(
                f"bucket {name} was made but could not be tagged or deleted ({gone}): delete it, "
                "then run again"
            )
            return
        self.created.remove(f"bucket:{name}")
        exc.add_note(f"bucket {name} was made but could not be tagged, and was deleted again")

    def _on_new_bucket(self, action: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """`call` on a bucket made a moment ago, which S3 may not show yet (NoSuchBucket, its
        eventual consistency): asked again for up to NEW_BUCKET_WAIT_S."""

        def unseen(exc: bx.ClientError) -> bool:
            return aws.error_code(exc) == "NoSuchBucket"

        with aws.aws_call(action, self.spec.region):
            return aws.retrying(
                lambda: fn(**kwargs), unseen, within_s=NEW_BUCKET_WAIT_S, pause_s=0.5
            )

    def _made_by_sparknet(self, name: str) -> bool:
        found = self.find("GetBucketTagging", self.s3.get_bucket_tagging, Bucket=name)
        have = {t["Key"]: t["Value"] for t in (found or {}).get("TagSet", [])}
        return have.get(TAG_ROLE) == "foundation" and TAG_CLUSTER in have

    def harden_bucket(self, name: str) -> None:
        """Put `infra/rules/bucket.json` on the bucket (as infra/bucket.tf): never public,
        ownership enforced (no ACLs), KMS with a bucket key, versioned, TLS only, old versions
        and failed uploads expired; without `tls_only`, no bucket policy (see `__init__`).
        Each call is asked again while S3 does not show a new bucket yet."""
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
        if not self.tls_only:  # over plain http the TLS-only statement denies this very tool
            calls = [c for c in calls if c[0] != "PutBucketPolicy"]
            calls.append(("DeleteBucketPolicy", self._delete_policy, {}))
        for action, fn, kwargs in calls:
            self._on_new_bucket(action, fn, Bucket=name, **kwargs)

    def _delete_policy(self, Bucket: str) -> None:  # Bucket: as boto3 names it, for the loop
        """DeleteBucketPolicy; a bucket without one is as wanted."""
        try:
            self.s3.delete_bucket_policy(Bucket=Bucket)
        except bx.ClientError as exc:
            if aws.error_code(exc) != "NoSuchBucketPolicy":
                raise


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
    f = Boto3Foundation(spec, endpoint_url, created)
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
