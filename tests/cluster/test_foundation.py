"""The boto3 foundation against moto's server: what `ensure` makes, twice, and `destroy`."""

from __future__ import annotations

import json
import time
import urllib.parse
import uuid

import boto3
import botocore.exceptions
import pytest

from sparknet.cluster.aws import boto3_foundation, boto3_teardown, foundation
from sparknet.cluster.aws.boto3_foundation import ensure_boto3
from sparknet.cluster.aws.boto3_teardown import destroy_boto3
from sparknet.cluster.aws.foundation import node_role_name, security_group_name
from sparknet.cluster.spec import TAG_CLUSTER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError

pytestmark = pytest.mark.integration

REGION = "us-east-1"
CIDR = "203.0.113.7/32"


@pytest.fixture
def spec(moto_endpoint):
    name = f"f{uuid.uuid4().hex[:8]}"
    spec = ClusterSpec(name=name, region=REGION, bucket=f"{name}-data")
    yield spec
    destroy_boto3(spec, endpoint_url=moto_endpoint)


def _tagged(ec2, spec: ClusterSpec) -> dict[str, int]:
    """Counts of the cluster's tagged EC2 network resources."""
    filters = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    return {
        "vpc": len(ec2.describe_vpcs(Filters=filters)["Vpcs"]),
        "subnet": len(ec2.describe_subnets(Filters=filters)["Subnets"]),
        "internet-gateway": len(
            ec2.describe_internet_gateways(Filters=filters)["InternetGateways"]
        ),
        "route-table": len(ec2.describe_route_tables(Filters=filters)["RouteTables"]),
        "security-group": len(ec2.describe_security_groups(Filters=filters)["SecurityGroups"]),
    }


def test_ensure_makes_the_foundation_tagged_with_only_ssh_and_members_open(spec, moto_endpoint):
    f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    ec2 = boto3.client("ec2", region_name=REGION)
    assert _tagged(ec2, spec) == {
        "vpc": 1, "subnet": len(f.subnet_by_az), "internet-gateway": 1, "route-table": 1,
        "security-group": 1,
    }  # fmt: skip
    assert len(f.subnet_by_az) >= 2
    vpc = ec2.describe_vpcs(VpcIds=[f.vpc_id])["Vpcs"][0]
    tags = {t["Key"]: t["Value"] for t in vpc["Tags"]}
    assert tags[TAG_CLUSTER] == spec.name and tags[TAG_ROLE] == "foundation"

    group = ec2.describe_security_groups(GroupIds=[f.security_group_id])["SecurityGroups"][0]
    assert group["GroupName"] == security_group_name(spec)
    assert len(group["IpPermissions"]) == 2
    ingress = _ingress(ec2, f.security_group_id)
    assert ingress == [("-1", None, (), (f.security_group_id,)), ("tcp", 22, (CIDR,), ())]


def test_node_role_reads_data_writes_own_runs_and_terminates_only_its_cluster(spec, moto_endpoint):
    """Terminate only in the cluster's region and account, write only under runs/<cluster>/."""
    f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    iam = boto3.client("iam", region_name=REGION)
    account = boto3.client("sts", region_name=REGION).get_caller_identity()["Account"]
    name = node_role_name(spec)
    profile = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]
    assert [r["RoleName"] for r in profile["Roles"]] == [name]
    assert f.instance_profile_arn == profile["Arn"]
    doc = iam.get_role_policy(RoleName=name, PolicyName="sparknet-node")["PolicyDocument"]
    if isinstance(doc, str):
        doc = json.loads(urllib.parse.unquote(doc))
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    terminate = by_sid["TerminateOwnClusterOnly"]
    assert terminate["Action"] == "ec2:TerminateInstances"
    assert terminate["Resource"] == f"arn:aws:ec2:{REGION}:{account}:instance/*"
    assert terminate["Condition"]["StringEquals"] == {"aws:ResourceTag/sparknet:cluster": spec.name}
    assert by_sid["ReadDataPrefix"]["Resource"] == f"arn:aws:s3:::{spec.bucket}/datasets/*"
    runs = by_sid["ReadWriteOwnRunsPrefix"]
    assert runs["Resource"] == f"arn:aws:s3:::{spec.bucket}/runs/{spec.name}/*"
    assert spec.cluster_runs_prefix == f"runs/{spec.name}/"
    actions = [
        a
        for s in doc["Statement"]
        for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
    ]
    assert "ec2:TerminateInstances" in actions and not any("*" in a for a in actions)
    # deletes only in its own runs prefix (a restarted driver drops an incomplete checkpoint,
    # a run's lock is released)
    deleting = [
        s["Resource"]
        for s in doc["Statement"]
        if "s3:DeleteObject" in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
    ]
    assert deleting == [f"arn:aws:s3:::{spec.bucket}/runs/{spec.name}/*"]


def test_bucket_is_encrypted_versioned_and_private(spec, moto_endpoint):
    ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    s3 = boto3.client("s3", region_name=REGION)
    rules = s3.get_bucket_encryption(Bucket=spec.bucket)["ServerSideEncryptionConfiguration"]
    assert rules["Rules"][0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
    assert s3.get_bucket_versioning(Bucket=spec.bucket)["Status"] == "Enabled"
    block = s3.get_public_access_block(Bucket=spec.bucket)["PublicAccessBlockConfiguration"]
    assert all(block.values())
    policy = json.loads(s3.get_bucket_policy(Bucket=spec.bucket)["Policy"])
    (deny,) = policy["Statement"]
    assert deny["Effect"] == "Deny" and deny["Condition"] == {
        "Bool": {"aws:SecureTransport": "false"}
    }


def _ingress(ec2, group_id: str) -> list[tuple]:
    group = ec2.describe_security_groups(GroupIds=[group_id])["SecurityGroups"][0]
    return sorted(
        (
            p["IpProtocol"],
            p.get("FromPort"),
            tuple(r["CidrIp"] for r in p.get("IpRanges", [])),
            tuple(g["GroupId"] for g in p.get("UserIdGroupPairs", [])),
        )
        for p in group["IpPermissions"]
        if p.get("IpRanges") or p.get("UserIdGroupPairs")
    )


def test_a_new_ssh_source_replaces_the_old_one_and_stray_rules_go(spec, moto_endpoint):
    """The caller moved (a new /32) and someone opened a port by hand: the next ensure leaves
    exactly the shared rules for the new address."""
    f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    ec2 = boto3.client("ec2", region_name=REGION)
    ec2.authorize_security_group_ingress(
        GroupId=f.security_group_id, IpProtocol="tcp", FromPort=8080, ToPort=8080,
        CidrIp="0.0.0.0/0",
    )  # fmt: skip
    moved = "198.51.100.4/32"
    ensure_boto3(spec, allowed_cidr=moved, endpoint_url=moto_endpoint)
    group = f.security_group_id
    assert _ingress(ec2, group) == [("-1", None, (), (group,)), ("tcp", 22, (moved,), ())]


def test_ensure_twice_creates_nothing_new(spec, moto_endpoint):
    first = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    second = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    assert first.created and second.created == ()
    assert (second.vpc_id, second.security_group_id, second.subnet_by_az) == (
        first.vpc_id, first.security_group_id, first.subnet_by_az,
    )  # fmt: skip


def test_destroy_leaves_nothing_with_the_cluster_tag(spec, moto_endpoint):
    f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    deleted = destroy_boto3(spec, endpoint_url=moto_endpoint)
    assert f"vpc:{f.vpc_id}" in deleted and f"security-group:{f.security_group_id}" in deleted
    ec2 = boto3.client("ec2", region_name=REGION)
    assert set(_tagged(ec2, spec).values()) == {0}
    iam = boto3.client("iam", region_name=REGION)
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_role(RoleName=node_role_name(spec))
    assert destroy_boto3(spec, endpoint_url=moto_endpoint) == []


def test_terraform_path_maps_module_outputs_to_the_foundation(moto_endpoint, tmp_path):
    """The Terraform foundation for real, on a provider-free stand-in for infra/ (the AWS provider
    cannot be downloaded here) with infra/'s inputs and outputs; the network is moto's."""
    from sparknet.cluster.aws.terraform_foundation import destroy_terraform, ensure_terraform
    from tests.conftest import REPO

    ec2 = boto3.client("ec2", region_name=REGION)
    vpc = ec2.create_vpc(CidrBlock="10.90.0.0/16")["Vpc"]["VpcId"]
    zones = ["us-east-1a", "us-east-1b"]
    subnets = {
        az: ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.90.{k}.0/24", AvailabilityZone=az)[
            "Subnet"
        ]["SubnetId"]
        for k, az in enumerate(zones)
    }
    spec = ClusterSpec(
        name="tfpath", region=REGION, bucket="tfpath-data", vpc_id=vpc,
        subnet_ids=list(subnets.values()), foundation="terraform",
    )  # fmt: skip
    module, state = REPO / "tests" / "terraform_foundation", tmp_path / "state"
    f = ensure_terraform(
        spec, allowed_cidr=CIDR, state_dir=state, endpoint_url=moto_endpoint, module_dir=module
    )
    assert f.vpc_id == vpc and f.subnet_by_az == subnets
    assert f.instance_profile_name == "sparknet-tfpath-us-east-1" and f.bucket == "tfpath-data"
    # the bucket is not in the cluster's state: made and hardened as the boto3 foundation does
    assert f.created == ("bucket:tfpath-data",)
    s3 = boto3.client("s3", region_name=REGION)
    assert s3.get_bucket_versioning(Bucket="tfpath-data")["Status"] == "Enabled"
    assert (state / "terraform.tfstate").is_file()
    saved = json.loads((state / "variables.tfvars.json").read_text())
    assert saved["subnet_ids"] == list(subnets.values()) and saved["allowed_cidr"] == CIDR
    gone = destroy_terraform(spec, state_dir=state, module_dir=module)
    # the stand-in holds no AWS resource and the VPC is the user's own: nothing of AWS went, and
    # no output name (vpc_id:..., bucket:...) is passed off as something deleted
    assert gone == []
    assert ec2.describe_vpcs(VpcIds=[vpc])["Vpcs"]
    assert json.loads((state / "terraform.tfstate").read_text())["resources"] == []


def test_terraform_foundation_needs_a_bucket(tmp_path):
    from sparknet.cluster.aws.terraform_foundation import terraform_variables
    from sparknet.errors import SparknetError

    with pytest.raises(SparknetError, match="needs `bucket`"):
        terraform_variables(ClusterSpec(name="nob", foundation="terraform"), CIDR)


def test_terraform_backend_of_the_spec_holds_the_state(moto_endpoint, tmp_path):
    """`terraform_backend` settings go to `init -backend-config`: here the stand-in's local
    backend pointed at a path of the user's, so the cluster's own state dir stays empty."""
    from sparknet.cluster.aws.terraform_foundation import destroy_terraform, ensure_terraform
    from tests.conftest import REPO

    ec2 = boto3.client("ec2", region_name=REGION)
    vpc = ec2.create_vpc(CidrBlock="10.91.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.91.0.0/24", AvailabilityZone="us-east-1a")
    users = tmp_path / "team-state" / "tfuser.tfstate"
    users.parent.mkdir()
    spec = ClusterSpec(
        name="tfuser", region=REGION, bucket="tfuser-data", vpc_id=vpc,
        subnet_ids=[subnet["Subnet"]["SubnetId"]], foundation="terraform",
        terraform_backend={"path": str(users)},
    )  # fmt: skip
    module, state = REPO / "tests" / "terraform_foundation", tmp_path / "state"
    ensure_terraform(
        spec, allowed_cidr=CIDR, state_dir=state, endpoint_url=moto_endpoint, module_dir=module
    )
    assert json.loads(users.read_text())["resources"]
    assert not (state / "terraform.tfstate").exists()
    destroy_terraform(spec, state_dir=state, module_dir=module)
    assert json.loads(users.read_text())["resources"] == []


@pytest.mark.parametrize(
    ("code", "status", "says"),
    [
        ("403", 403, "exists but this account may not use it"),
        ("AccessDenied", 403, "exists but this account may not use it"),
        ("SlowDown", 503, "HeadBucket in us-east-1 failed: SlowDown"),
    ],
)
def test_a_bucket_name_taken_elsewhere_is_one_line(spec, moto_endpoint, code, status, says):
    """S3 names are global: HeadBucket answers 403 for another account's bucket. moto keeps one
    account here, so botocore's Stubber gives that answer on the real client."""
    from botocore.stub import Stubber

    from sparknet.cluster.aws.boto3_foundation import Boto3Foundation
    from sparknet.errors import SparknetError

    f = Boto3Foundation(spec, moto_endpoint)
    with Stubber(f.s3) as stub:
        stub.add_client_error("head_bucket", service_error_code=code, http_status_code=status)
        with pytest.raises(SparknetError) as info:
            f.bucket("someone-elses-bucket")
    assert says in str(info.value) and "\n" not in str(info.value)
    assert f.created == []


def _everything(ec2, iam, spec: ClusterSpec) -> dict[str, int]:
    """Counts of the cluster's EC2 resources (by tag) and IAM resources (by name)."""
    counts = _tagged(ec2, spec)
    filters = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    endpoints = ec2.describe_vpc_endpoints(Filters=filters)["VpcEndpoints"]
    counts["vpc-endpoint"] = sum(e["State"].lower() != "deleted" for e in endpoints)
    name = node_role_name(spec)
    counts["iam-role"] = _exists(iam.get_role, iam, RoleName=name)
    counts["instance-profile"] = _exists(iam.get_instance_profile, iam, InstanceProfileName=name)
    return counts


def _exists(call, iam, **kwargs) -> int:
    try:
        call(**kwargs)
    except iam.exceptions.NoSuchEntityException:
        return 0
    return 1


def test_destroy_only_removes_exactly_what_one_call_created(spec, moto_endpoint):
    """Two `up`s of one name: the second finds the first's network and makes only what was
    missing (here: the role, deleted by hand). Its clean-up with `only` removes that role and
    profile and leaves the first one's VPC, subnets, group and endpoint standing."""
    ec2 = boto3.client("ec2", region_name=REGION)
    iam = boto3.client("iam", region_name=REGION)
    first = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    kinds = {item.split(":")[0] for item in first.created}
    assert kinds == {
        "vpc", "internet-gateway", "subnet", "route-table", "vpc-endpoint", "security-group",
        "bucket", "iam-role", "instance-profile",
    }  # fmt: skip
    before = _everything(ec2, iam, spec)
    destroy_boto3(
        spec, endpoint_url=moto_endpoint,
        only=[f"instance-profile:{node_role_name(spec)}", f"iam-role:{node_role_name(spec)}"],
    )  # fmt: skip
    created: list[str] = []
    second = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint, created=created)
    name = node_role_name(spec)
    assert list(second.created) == created == [f"iam-role:{name}", f"instance-profile:{name}"]
    deleted = destroy_boto3(spec, endpoint_url=moto_endpoint, only=second.created)
    assert deleted == [f"instance-profile:{name}", f"iam-role:{name}"]
    after = _everything(ec2, iam, spec)
    assert after == {**before, "iam-role": 0, "instance-profile": 0}
    assert after["vpc"] == 1 and after["subnet"] == len(first.subnet_by_az)
    # the first call's whole list, in dependency order, even with the bucket in it (kept)
    gone = destroy_boto3(spec, endpoint_url=moto_endpoint, only=first.created)
    assert [g.split(":")[0] for g in gone][-1] == "vpc"
    assert _everything(ec2, iam, spec) == dict.fromkeys(before, 0)
    boto3.client("s3", region_name=REGION).head_bucket(Bucket=spec.bucket)


def test_a_failed_ensure_still_tells_the_caller_what_it_made(spec, moto_endpoint):
    """The caller's `created` list holds what was made before the failure (here the security
    group's name is taken by a group without the cluster's tags), so it can be removed."""
    from sparknet.errors import SparknetError

    ec2 = boto3.client("ec2", region_name=REGION)
    created: list[str] = []
    vpc_calls: list[str] = []

    def squat(**kwargs):  # a stranger's group of the same name in the new VPC
        vpc_calls.append(kwargs["params"]["VpcId"])
        ec2.create_security_group(
            GroupName=security_group_name(spec), Description="x", VpcId=kwargs["params"]["VpcId"]
        )

    real = boto3_foundation.Boto3Foundation.security_group

    def racing(self, vpc, allowed_cidr):
        squat(params={"VpcId": vpc})
        return real(self, vpc, allowed_cidr)

    boto3_foundation.Boto3Foundation.security_group = racing
    try:
        with pytest.raises(SparknetError, match="CreateSecurityGroup"):
            ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint, created=created)
    finally:
        boto3_foundation.Boto3Foundation.security_group = real
    assert [c.split(":")[0] for c in created] == [
        "vpc",
        "internet-gateway",
        "subnet",
        "subnet",
        "subnet",
        "route-table",
        "vpc-endpoint",
    ]
    stranger = ec2.describe_security_groups(
        Filters=[{"Name": "group-name", "Values": [security_group_name(spec)]},
                 {"Name": "vpc-id", "Values": vpc_calls}]
    )["SecurityGroups"][0]["GroupId"]  # fmt: skip
    ec2.delete_security_group(GroupId=stranger)
    destroy_boto3(spec, endpoint_url=moto_endpoint, only=created)
    assert set(_tagged(ec2, spec).values()) == {0}


def test_owner_tag_on_every_foundation_resource(moto_endpoint):
    """With `owner` (set by `up` from STS), every resource carries sparknet:owner; an ARN with
    a character IAM refuses in tags (a session name's comma) is made a valid tag value."""
    from sparknet.cluster.spec import TAG_OWNER

    name = f"o{uuid.uuid4().hex[:8]}"
    arn = "arn:aws:sts::123456789012:assumed-role/Dev/alice,ops@example.com"
    spec = ClusterSpec(name=name, region=REGION, bucket=f"{name}-data", owner=arn)
    owner = "arn:aws:sts::123456789012:assumed-role/Dev/alice_ops@example.com"
    assert spec.owner == owner
    try:
        f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
        ec2 = boto3.client("ec2", region_name=REGION)
        iam = boto3.client("iam", region_name=REGION)
        s3 = boto3.client("s3", region_name=REGION)
        filters = [{"Name": f"tag:{TAG_OWNER}", "Values": [owner]}]
        owned = {
            "vpc": ec2.describe_vpcs(Filters=filters)["Vpcs"],
            "subnet": ec2.describe_subnets(Filters=filters)["Subnets"],
            "internet-gateway": ec2.describe_internet_gateways(Filters=filters)["InternetGateways"],
            "route-table": ec2.describe_route_tables(Filters=filters)["RouteTables"],
            "security-group": ec2.describe_security_groups(Filters=filters)["SecurityGroups"],
            "vpc-endpoint": ec2.describe_vpc_endpoints(Filters=filters)["VpcEndpoints"],
        }
        made = {item.split(":")[0] for item in f.created} - {"bucket", "iam-role"}
        made -= {"instance-profile"}
        assert {kind for kind, found in owned.items() if found} == made
        role_tags = iam.list_role_tags(RoleName=node_role_name(spec))["Tags"]
        profile = iam.get_instance_profile(InstanceProfileName=node_role_name(spec))
        bucket_tags = s3.get_bucket_tagging(Bucket=spec.bucket)["TagSet"]
        for tag_set in (role_tags, profile["InstanceProfile"]["Tags"], bucket_tags):
            assert {"Key": TAG_OWNER, "Value": owner} in tag_set
    finally:
        destroy_boto3(spec, endpoint_url=moto_endpoint)


def _bucket_settings(s3, bucket: str) -> dict:
    """What a sparknet bucket is held to, read back (None where a setting is missing)."""

    def read(call, *keys):
        try:
            value = call(Bucket=bucket)
        except s3.exceptions.ClientError:
            return None
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return {
        "public": read(s3.get_public_access_block, "PublicAccessBlockConfiguration"),
        "ownership": read(s3.get_bucket_ownership_controls, "OwnershipControls", "Rules"),
        "encryption": read(s3.get_bucket_encryption, "ServerSideEncryptionConfiguration", "Rules"),
        "versioning": read(s3.get_bucket_versioning, "Status"),
        "policy": read(s3.get_bucket_policy, "Policy"),
        "lifecycle": read(s3.get_bucket_lifecycle_configuration, "Rules"),
    }


def test_every_ensure_puts_a_sparknet_buckets_settings_back(spec, moto_endpoint):
    """Hardening changed by hand (public access block and policy removed, versioning suspended,
    encryption, ownership and lifecycle gone) is restored by the next `up`."""
    ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    s3 = boto3.client("s3", region_name=REGION)
    hardened = _bucket_settings(s3, spec.bucket)
    assert all(hardened.values()), hardened
    assert hardened["ownership"] == [{"ObjectOwnership": "BucketOwnerEnforced"}]
    assert hardened["encryption"][0]["BucketKeyEnabled"] is True
    assert hardened["lifecycle"][0]["NoncurrentVersionExpiration"] == {"NoncurrentDays": 30}
    s3.delete_public_access_block(Bucket=spec.bucket)
    s3.delete_bucket_policy(Bucket=spec.bucket)
    s3.delete_bucket_encryption(Bucket=spec.bucket)
    s3.delete_bucket_ownership_controls(Bucket=spec.bucket)
    s3.delete_bucket_lifecycle(Bucket=spec.bucket)
    s3.put_bucket_versioning(Bucket=spec.bucket, VersioningConfiguration={"Status": "Suspended"})
    assert _bucket_settings(s3, spec.bucket)["versioning"] == "Suspended"
    ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    assert _bucket_settings(s3, spec.bucket) == hardened


def test_a_users_own_bucket_is_left_as_it_is(moto_endpoint):
    """A bucket without sparknet's tags is the user's: its policy and settings stay theirs."""
    name = f"u{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=f"{name}-own")
    spec = ClusterSpec(name=name, region=REGION, bucket=f"{name}-own")
    try:
        f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
        assert not [c for c in f.created if c.startswith("bucket:")]
        settings = _bucket_settings(s3, spec.bucket)
        assert settings["policy"] is None and settings["lifecycle"] is None
    finally:
        destroy_boto3(spec, endpoint_url=moto_endpoint)


def test_egress_is_the_shared_rule_and_stray_egress_goes(spec, moto_endpoint):
    """AWS's default allow-all egress gives way to the rules file's described rule, as
    Terraform's group has it; an egress rule added by hand is revoked by the next ensure."""
    from sparknet.cluster.aws.rules import security_group_rules

    f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    ec2 = boto3.client("ec2", region_name=REGION)
    ec2.authorize_security_group_egress(
        GroupId=f.security_group_id,
        IpPermissions=[{"IpProtocol": "tcp", "FromPort": 443, "ToPort": 443,
                        "IpRanges": [{"CidrIp": "198.51.100.9/32"}]}],
    )  # fmt: skip
    ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    group = ec2.describe_security_groups(GroupIds=[f.security_group_id])["SecurityGroups"][0]
    (rule,) = security_group_rules("egress")
    assert [
        (p["IpProtocol"], r["CidrIp"], r.get("Description"))
        for p in group["IpPermissionsEgress"]
        for r in p.get("IpRanges", [])
    ] == [("-1", "0.0.0.0/0", rule["description"])]


def test_network_has_the_shared_zone_count_and_an_s3_endpoint(spec, moto_endpoint):
    from sparknet.cluster.aws.rules import network

    f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    ec2 = boto3.client("ec2", region_name=REGION)
    zones = ec2.describe_availability_zones(
        Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}]
    )["AvailabilityZones"]
    first = sorted(z["ZoneName"] for z in zones)[: network()["az_count"]]
    assert sorted(f.subnet_by_az) == first and len(first) == 3
    (endpoint,) = ec2.describe_vpc_endpoints(Filters=[{"Name": "vpc-id", "Values": [f.vpc_id]}])[
        "VpcEndpoints"
    ]
    assert endpoint["ServiceName"] == f"com.amazonaws.{REGION}.s3"
    assert endpoint["VpcEndpointType"].lower() == "gateway"
    (table,) = ec2.describe_route_tables(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    )["RouteTables"]
    assert endpoint["RouteTableIds"] == [table["RouteTableId"]]


def test_the_vpcs_default_group_is_emptied_and_never_deleted(spec, moto_endpoint):
    """AWS refuses to delete a VPC's `default` group (moto does not): `down` must not try, even
    when the group carries the cluster's tags, as Terraform's aws_default_security_group gives
    it. Its rules are removed, as Terraform does, so nothing without a group is reachable."""
    f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    ec2 = boto3.client("ec2", region_name=REGION)
    in_vpc = [{"Name": "vpc-id", "Values": [f.vpc_id]}]
    (default,) = ec2.describe_security_groups(
        Filters=[*in_vpc, {"Name": "group-name", "Values": ["default"]}]
    )["SecurityGroups"]
    assert default["IpPermissions"] == [] and default["IpPermissionsEgress"] == []
    ec2.create_tags(
        Resources=[default["GroupId"]],
        Tags=[{"Key": TAG_CLUSTER, "Value": spec.name}, {"Key": TAG_ROLE, "Value": "foundation"}],
    )
    deleted = destroy_boto3(spec, endpoint_url=moto_endpoint)
    assert f"security-group:{f.security_group_id}" in deleted
    assert f"security-group:{default['GroupId']}" not in deleted
    assert (
        destroy_boto3(
            spec, endpoint_url=moto_endpoint, only=[f"security-group:{default['GroupId']}"]
        )
        == []
    )


def test_zones_are_asked_for_regular_zones_only(spec, moto_endpoint):
    """Local and wavelength zones lack most GPU types: the zone query asks for zone-type
    availability-zone, as infra/'s data source does. moto has no local zones, so the request
    the real client sends is what is checked."""
    from sparknet.cluster.aws.boto3_foundation import Boto3Foundation

    f = Boto3Foundation(spec, moto_endpoint)
    sent: list[dict] = []
    f.ec2.meta.events.register(
        "provide-client-params.ec2.DescribeAvailabilityZones",
        lambda params, **_: sent.append(params),
    )
    zones = f.zones()
    assert len(zones) == 3
    (params,) = sent
    assert {"Name": "zone-type", "Values": ["availability-zone"]} in params["Filters"]


# -- deletes wait for AWS to let go of dependencies ----------------------------------------------


def _vpc_with_subnet(ec2) -> tuple[str, str]:
    vpc = ec2.create_vpc(CidrBlock="10.93.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.93.0.0/24")["Subnet"]["SubnetId"]
    return vpc, subnet


def test_a_vpc_delete_waits_while_aws_answers_dependency_violation(moto_endpoint, monkeypatch):
    """moto refuses DeleteVpc with DependencyViolation while a subnet is in it, as AWS does for
    seconds after an endpoint or instance lets go: the delete is retried until it passes."""
    import threading

    monkeypatch.setattr(boto3_teardown, "DEPENDENCY_WAIT_S", 60.0)
    ec2 = boto3.client("ec2", region_name=REGION)
    vpc, subnet = _vpc_with_subnet(ec2)
    spec = ClusterSpec(name=f"d{uuid.uuid4().hex[:8]}", region=REGION)
    release = threading.Timer(1.5, lambda: ec2.delete_subnet(SubnetId=subnet))
    release.start()
    started = time.monotonic()
    try:
        assert destroy_boto3(spec, endpoint_url=moto_endpoint, only=[f"vpc:{vpc}"]) == [
            f"vpc:{vpc}"
        ]
    finally:
        release.cancel()
    assert time.monotonic() - started >= 1.5
    assert ec2.describe_vpcs(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Vpcs"] == []


def test_a_dependency_that_never_goes_fails_in_one_line_after_the_deadline(
    moto_endpoint, monkeypatch
):
    monkeypatch.setattr(boto3_teardown, "DEPENDENCY_WAIT_S", 1.0)
    ec2 = boto3.client("ec2", region_name=REGION)
    vpc, subnet = _vpc_with_subnet(ec2)
    spec = ClusterSpec(name=f"d{uuid.uuid4().hex[:8]}", region=REGION)
    with pytest.raises(SparknetError, match=r"DeleteVpc in us-east-1 .*DependencyViolation") as err:
        destroy_boto3(spec, endpoint_url=moto_endpoint, only=[f"vpc:{vpc}"])
    assert "\n" not in str(err.value)
    ec2.delete_subnet(SubnetId=subnet)
    ec2.delete_vpc(VpcId=vpc)


def test_a_security_group_still_in_use_is_retried(moto_endpoint, monkeypatch):
    """moto deletes a group at once even where AWS says "has a dependent object" for a while
    after its instances terminate, so this one answer is stubbed (the first DeleteSecurityGroup
    fails as AWS's does); the retry then deletes the real group on moto."""
    monkeypatch.setattr(boto3_teardown, "DEPENDENCY_WAIT_S", 30.0)
    ec2 = boto3.client("ec2", region_name=REGION)
    vpc, subnet = _vpc_with_subnet(ec2)
    group = ec2.create_security_group(GroupName="busy", Description="busy", VpcId=vpc)["GroupId"]
    real = boto3_foundation.Boto3Foundation.__init__
    refusals = []

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        delete = self.ec2.delete_security_group

        def busy_once(**call):
            if not refusals:
                refusals.append(call)
                raise botocore.exceptions.ClientError(
                    {"Error": {"Code": "DependencyViolation",
                               "Message": f"resource {group} has a dependent object"}},
                    "DeleteSecurityGroup",
                )  # fmt: skip
            return delete(**call)

        self.ec2.delete_security_group = busy_once

    monkeypatch.setattr(boto3_foundation.Boto3Foundation, "__init__", init)
    spec = ClusterSpec(name=f"d{uuid.uuid4().hex[:8]}", region=REGION)
    only = [f"security-group:{group}", f"subnet:{subnet}", f"vpc:{vpc}"]
    assert destroy_boto3(spec, endpoint_url=moto_endpoint, only=only) == only
    assert refusals == [{"GroupId": group}]


def test_without_a_bucket_the_node_role_has_no_s3_statement(moto_endpoint):
    """Issue 9 probe, point 13: no stand-in bucket (`sparknet-NAME-unused`, a name anyone could
    register) is granted; the role keeps only its EC2 statements."""
    spec = ClusterSpec(name=f"n{uuid.uuid4().hex[:8]}", region=REGION)
    f = ensure_boto3(spec, allowed_cidr=CIDR, endpoint_url=moto_endpoint)
    try:
        iam = boto3.client("iam", region_name=REGION)
        (policy,) = iam.list_role_policies(RoleName=f.role_name)["PolicyNames"]
        document = iam.get_role_policy(RoleName=f.role_name, PolicyName=policy)["PolicyDocument"]
        if isinstance(document, str):
            document = json.loads(urllib.parse.unquote(document))
        statements = document["Statement"]
        actions = {
            a
            for s in statements
            for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
        }
        assert actions == {"ec2:DescribeInstances", "ec2:TerminateInstances"}
        assert "s3" not in json.dumps(document)
    finally:
        destroy_boto3(spec, endpoint_url=moto_endpoint)


def test_check_removed_names_what_is_still_tagged(moto_endpoint):
    """What a clean-up asks before it says "removed": a tagged VPC left is named, in one line."""
    spec = ClusterSpec(name=f"r{uuid.uuid4().hex[:8]}", region=REGION)
    boto3_teardown.check_removed(spec, endpoint_url=moto_endpoint)  # nothing there: no complaint
    ec2 = boto3.client("ec2", region_name=REGION)
    vpc = ec2.create_vpc(
        CidrBlock="10.94.0.0/16",
        TagSpecifications=[{"ResourceType": "vpc", "Tags": foundation.tags(spec)}],
    )["Vpc"]["VpcId"]
    with pytest.raises(SparknetError, match=rf"still has vpc:{vpc} after the destroy") as err:
        boto3_teardown.check_removed(spec, endpoint_url=moto_endpoint)
    assert "\n" not in str(err.value)
    assert destroy_boto3(spec, endpoint_url=moto_endpoint) == [f"vpc:{vpc}"]
