"""`cluster up` and `cluster down` through the CLI while moto answers as AWS does on a bad day
(tests/aws_faults.py): throttled calls, one AZ out of capacity, an instance profile EC2 does not
see yet, fresh instances not found by id or missing from tag-filtered describes, quota and spot
refusals. Each ends as it would without the fault, or with one line naming what AWS refused and a
non-zero exit; either way nothing of the cluster is left in moto (checked on moto directly, past
the front)."""

from __future__ import annotations

import boto3
import pytest
from botocore import xform_name
from botocore.config import Config
from botocore.exceptions import ClientError

from sparknet.cluster.aws.foundation import node_role_name
from sparknet.cluster.spec import TAG_CLUSTER, ClusterSpec
from tests.cluster import test_lifecycle
from tests.cluster.test_lifecycle import REGION, _settings_file, cli

pytestmark = pytest.mark.integration

#: the same cluster fixture (a fresh name, SPARKNET_HOME in tmp_path, taken down afterwards)
spec = test_lifecycle.spec

#: the AZs the test clusters may use, in their fallback order
AZS = ["us-east-1a", "us-east-1b"]
GONE = {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0, "profiles": 0}


def _left(spec: ClusterSpec, moto: str) -> dict[str, int]:
    """What still exists of the cluster, asked of moto itself (not through the front)."""
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto)
    iam = boto3.client("iam", region_name=REGION, endpoint_url=moto)
    tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    live = [
        i
        for r in ec2.describe_instances(Filters=tag)["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] != "terminated"
    ]
    name = node_role_name(spec)
    return {
        "instances": len(live),
        "vpcs": len(ec2.describe_vpcs(Filters=tag)["Vpcs"]),
        "security_groups": len(ec2.describe_security_groups(Filters=tag)["SecurityGroups"]),
        "roles": sum(r["RoleName"] == name for r in iam.list_roles()["Roles"]),
        "profiles": sum(
            p["InstanceProfileName"] == name
            for p in iam.list_instance_profiles()["InstanceProfiles"]
        ),
    }


def _azs(spec: ClusterSpec, moto: str) -> list[str]:
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto)
    tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    return sorted(
        i["Placement"]["AvailabilityZone"]
        for r in ec2.describe_instances(Filters=tag)["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] != "terminated"
    )


def _error_line(stderr: str) -> str:
    """The one error line of a failed CLI command (its progress lines aside)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_up_and_down_through_throttling_a_full_az_and_iam_propagation(
    aws_faults, spec, moto_endpoint, tmp_path
):
    """One cluster life under the faults a first `up` meets: EC2, IAM and S3 throttle bursts,
    us-east-1a has no capacity for anything, and the instance profile is invalid to
    RunInstances for its first seconds (fresh instances unseen: the tests below). `up` ends as
    without them (three instances, all in us-east-1b, the bucket made) and asks the full AZ
    once per role: EC2 answers InsufficientInstanceCapacity with a 500, which botocore retries
    like any 5xx unless told not to. `down`, throttled too, removes everything."""
    bucket = f"{spec.name}-data"
    settings = dict(workers=2, instance_types=["g4dn.xlarge"], allowed_cidr="203.0.113.9/32")
    _settings_file(spec, tmp_path, availability_zones=AZS, bucket=bucket, **settings)
    plan = aws_faults
    plan.fail("DescribeInstances", "RequestLimitExceeded", times=2)
    plan.fail("RunInstances", "RequestLimitExceeded", times=1)
    plan.fail("RunInstances", "InsufficientInstanceCapacity", times=None, when=plan.in_az(AZS[0]))
    plan.fail("iam:CreateRole", "Throttling", times=1)
    plan.fail("s3:CreateBucket", "SlowDown", times=2)
    plan.unseen_profiles_s = 5.0  # counted from AddRoleToInstanceProfile

    up = cli("up", spec.name, "--no-bootstrap", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    assert f"cluster {spec.name} is up" in up.stdout
    assert _azs(spec, moto_endpoint) == [AZS[1]] * 3
    refused = plan.codes()
    assert refused.count("InsufficientInstanceCapacity") == 2  # master's and workers' once each
    for code in ("RequestLimitExceeded", "Throttling", "SlowDown", "InvalidParameterValue"):
        assert code in refused, refused  # every fault met `up`, and `up` went through it
    boto3.client("s3", endpoint_url=moto_endpoint).head_bucket(Bucket=bucket)

    plan.clear()
    plan.fail("DescribeInstances", "RequestLimitExceeded", times=1)
    plan.fail("TerminateInstances", "RequestLimitExceeded", times=1)
    plan.fail("DeleteSecurityGroup", "RequestLimitExceeded", times=1)
    plan.fail("iam:DeleteRole", "Throttling", times=1)
    down = cli("down", spec.name, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert down.stdout.count("terminated instance:") == 3
    assert {"TerminateInstances", "DeleteSecurityGroup", "DeleteRole"} <= {
        action for action, _code in plan.injected
    }
    assert _left(spec, moto_endpoint) == GONE
    boto3.client("s3", endpoint_url=moto_endpoint).delete_bucket(Bucket=bucket)


@pytest.mark.parametrize(
    ("spot", "code", "named", "asked"),
    [
        # a quota is regional: one AZ asked, and no other AZ is tried
        (False, "VcpuLimitExceeded", "Running On-Demand G and VT instances", 1),
        (True, "MaxSpotInstanceCountExceeded", "All G and VT Spot Instance Requests", 1),
        # no spot capacity: each AZ asked once
        (True, "InsufficientInstanceCapacity", "try on-demand", len(AZS)),
    ],
)
def test_an_up_aws_refuses_says_so_in_one_line_and_leaves_nothing(
    aws_faults, spec, moto_endpoint, tmp_path, spot, code, named, asked
):
    """The workers' launch is refused in every AZ (a quota of 0 vCPUs, the spot request count,
    no spot capacity) seconds after the master's succeeded, while the master is still NotFound
    by id (EC2's eventual consistency): `up` exits non-zero with one line naming the refusal
    and what to do, and its clean-up still ends the master and the foundation."""
    settings = dict(workers=1, instance_types=["g4dn.xlarge"], allowed_cidr="203.0.113.9/32")
    _settings_file(spec, tmp_path, availability_zones=AZS, spot=spot, **settings)
    plan = aws_faults
    workers = plan.fail("RunInstances", code, times=None, skip=1)  # the master's goes through
    plan.unseen_instances_s = 3.0
    plan.lag_tag_filters = False

    up = cli("up", spec.name, "--no-bootstrap", cwd=tmp_path)
    assert up.returncode != 0, up.stderr
    line = _error_line(up.stderr)
    assert code in line and named in line, line
    assert workers.hit == asked  # a refusal is not retried as a 5xx
    assert _left(spec, moto_endpoint) == GONE


@pytest.mark.parametrize(
    ("service", "action", "kwargs", "code", "status"),
    [
        ("ec2", "DescribeVpcs", {}, "RequestLimitExceeded", 503),
        ("ec2", "DescribeVpcs", {}, "InsufficientInstanceCapacity", 500),
        ("iam", "ListRoles", {}, "Throttling", 400),
        ("ssm", "GetParameter", {"Name": "/x"}, "ThrottlingException", 400),
        ("s3", "ListBuckets", {}, "SlowDown", 503),
    ],
)
def test_the_front_answers_in_shapes_botocore_reads_as_awss(
    aws_faults, fault_front, service, action, kwargs, code, status
):
    """Each protocol's error body (EC2's `<Response><Errors>`, IAM's `<ErrorResponse>`, the
    JSON `__type`, S3's `<Error>`) reaches botocore as AWS's does: the code and the status."""
    aws_faults.fail(f"{service}:{action}", code)
    client = boto3.client(
        service, region_name=REGION, endpoint_url=fault_front.url,
        config=Config(retries={"total_max_attempts": 1}),
    )  # fmt: skip
    with pytest.raises(ClientError) as err:
        getattr(client, xform_name(action))(**kwargs)
    assert err.value.response["Error"]["Code"] == code
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
