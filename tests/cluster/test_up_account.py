"""What `up` learns of the account before it makes anything, and what it trusts after the launch:
the EC2 vCPU quotas of the families it launches (Service Quotas), the bucket's region, and the
instances the launch answered even where a tag-filtered describe does not list them yet.

moto 5's Service Quotas knows only VPC quotas; the suite's moto server answers EC2's as a test
sets them (`ec2_quotas`, tests/moto_quotas.py), over HTTP and botocore's parser as AWS's. The
refusals AWS makes (AccessDeniedException, a lagging describe) come from the suite's fault front
(tests/aws_faults.py).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import yaml

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import ec2_up, registry
from sparknet.cluster.aws import instances, quotas
from sparknet.cluster.spec import TAG_CLUSTER, ClusterSpec
from sparknet.config import TrainConfig
from sparknet.errors import InputError, SparknetError
from sparknet.jobs import preflight as job_preflight
from tests.cluster.moto_clusters import moto_spec
from tests.conftest import SPARKNET
from tests.jobs.test_submit_parts import _dataset
from tests.moto_quotas import EC2_QUOTAS
from tests.moto_server import amazon_ami

pytestmark = pytest.mark.integration

REGION = "us-east-1"
AMI_PARAMETER = "/test/sparknet/account-ami"
G_ON_DEMAND, G_SPOT, STANDARD_SPOT = "L-DB2E81BA", "L-3819A6DF", "L-34B43A08"


@pytest.fixture
def ec2_quotas() -> Iterator[dict[str, float]]:
    """The EC2 quotas (code -> vCPUs) the moto server answers (tests/moto_quotas.py), for this
    test to set; put back afterwards."""
    saved = dict(EC2_QUOTAS)
    yield EC2_QUOTAS
    EC2_QUOTAS.clear()
    EC2_QUOTAS.update(saved)


@pytest.fixture
def spec(moto_endpoint, tmp_path, monkeypatch):
    with moto_spec(
        moto_endpoint, tmp_path, monkeypatch, prefix="q", ami_parameter=AMI_PARAMETER
    ) as spec:
        yield spec


def check(spec: ClusterSpec, endpoint: str, **changes: Any) -> list[str]:
    """`up`'s checks of `spec` (with `changes`); the lines they said."""
    spec = spec.model_copy(update=changes)
    said: list[str] = []
    ec2_up.check_before_up(
        spec,
        instances.ec2_client(REGION, endpoint),
        instances.ssm_client(REGION, endpoint),
        endpoint_url=endpoint,
        say=said.append,
    )
    return said


def in_use(spec: ClusterSpec, spot: bool = False, klass: str = "g") -> int:
    """vCPUs of the class other tests of this process left running in moto's region."""
    ec2 = instances.ec2_client(REGION)
    return quotas.vcpus_in_use(ec2, spec.name).get((spot, klass), 0)


def live(spec: ClusterSpec) -> int:
    ec2 = boto3.client("ec2", region_name=REGION)
    tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    return sum(
        i["State"]["Name"] != "terminated"
        for r in ec2.describe_instances(Filters=tag)["Reservations"]
        for i in r["Instances"]
    ) + len(ec2.describe_vpcs(Filters=tag)["Vpcs"])


# --- quotas ------------------------------------------------------------------------------------


def test_cli_up_past_the_g_quota_exits_2_in_one_line_and_makes_nothing(
    spec, moto_endpoint, ec2_quotas, tmp_path
):
    """A master (4 vCPUs) and 2 workers (4 each) against an on-demand G quota of 8."""
    ec2_quotas[G_ON_DEMAND] = 8 + in_use(spec)
    entry = {
        "region": REGION, "ami_parameter": AMI_PARAMETER, "workers": 2,
        "master_type": "g5.xlarge", "instance_types": ["g4dn.xlarge"],
        "allowed_cidr": "203.0.113.9/32",
    }  # fmt: skip
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump({"clusters": {spec.name: entry}}))
    done = subprocess.run(
        # --no-bootstrap: should the check let it through, nothing tries SSH to moto's addresses
        [str(SPARKNET), "cluster", "up", spec.name, "--no-bootstrap"], cwd=tmp_path,
        env=os.environ.copy(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    for part in (
        G_ON_DEMAND, "Running On-Demand G and VT instances", "needs 12 vCPUs",
        f"{in_use(spec)} are in use", f"quota is {8 + in_use(spec)}",
        f"request-service-quota-increase --region {REGION} --service-code ec2 "
        f"--quota-code {G_ON_DEMAND} --desired-value {12 + in_use(spec)}",
    ):  # fmt: skip
        assert part in lines[0], lines[0]
    assert live(spec) == 0
    assert spec.name not in registry.registered()


def test_other_instances_of_the_family_count_against_the_quota(spec, moto_endpoint, ec2_quotas):
    ec2 = boto3.client("ec2", region_name=REGION)
    before = in_use(spec)
    other = ec2.run_instances(
        ImageId=amazon_ami(REGION), InstanceType="g4dn.xlarge", MinCount=1, MaxCount=1
    )["Instances"][0]["InstanceId"]
    try:
        ec2_quotas[G_ON_DEMAND] = 12 + before
        with pytest.raises(InputError) as refused:
            check(spec, moto_endpoint)
        assert f"{before + 4} are in use" in str(refused.value)
        assert f"--desired-value {before + 16}" in str(refused.value)
        ec2_quotas[G_ON_DEMAND] = 16 + before
        assert check(spec, moto_endpoint) == []
    finally:
        ec2.terminate_instances(InstanceIds=[other])


def test_spot_workers_count_against_the_spot_quota_of_each_types_family(
    spec, moto_endpoint, ec2_quotas
):
    ec2_quotas.update({G_ON_DEMAND: 4 + in_use(spec), G_SPOT: in_use(spec, True), STANDARD_SPOT: 0})
    with pytest.raises(InputError, match=f"{G_SPOT} 'All G and VT Spot Instance Requests'"):
        check(spec, moto_endpoint, spot=True)
    # a fallback type of another family fits its own quota: the launch can use it
    ec2_quotas[STANDARD_SPOT] = 8 + in_use(spec, True, "standard")
    assert check(spec, moto_endpoint, spot=True, instance_types=["g4dn.xlarge", "m5.xlarge"]) == []
    # the master is on-demand whatever the workers are
    ec2_quotas[G_ON_DEMAND] = 3 + in_use(spec)
    with pytest.raises(InputError, match=f"needs 4 vCPUs of EC2 quota {G_ON_DEMAND}"):
        check(spec, moto_endpoint, spot=True, instance_types=["m5.xlarge"])


def test_every_worker_family_short_of_its_quota_is_named_with_its_amount(
    spec, moto_endpoint, ec2_quotas
):
    """Workers of a G and a P type, neither fitting: the one line names each family's quota
    code, the vCPUs it needs, and the command asking for them, not only the first type's."""
    P_ON_DEMAND = "L-417A185B"
    ec2_quotas.update({G_ON_DEMAND: 4 + in_use(spec), P_ON_DEMAND: in_use(spec, klass="p")})
    with pytest.raises(InputError) as refused:
        check(spec, moto_endpoint, instance_types=["g4dn.xlarge", "p4d.24xlarge"])
    line = str(refused.value)
    assert "\n" not in line
    assert f"needs 12 vCPUs of EC2 quota {G_ON_DEMAND}" in line  # 2 x 4 beside the master's 4
    assert f"--quota-code {G_ON_DEMAND} --desired-value {12 + in_use(spec)}" in line
    assert f"p4d.24xlarge needs 192 vCPUs of EC2 quota {P_ON_DEMAND} 'Running On-Demand P" in line
    assert f"--quota-code {P_ON_DEMAND} --desired-value {192 + in_use(spec, klass='p')}" in line


def test_unreadable_quotas_warn_in_one_line_and_go_on(spec, moto_endpoint, aws_faults):
    aws_faults.fail("GetServiceQuota", "AccessDeniedException", times=None)
    said = check(spec, aws_faults_url(), spot=False)
    assert len(said) == 1 and "AccessDeniedException" in said[0]
    assert "servicequotas:GetServiceQuota" in said[0]


def test_quotas_the_endpoint_does_not_know_warn_and_go_on(spec, moto_endpoint, ec2_quotas):
    """moto's own answer for an EC2 quota (NoSuchResourceException, then a 500 for the default
    value): no permission is missing, so the line asks for none."""
    del ec2_quotas[G_ON_DEMAND]
    said = check(spec, moto_endpoint)
    assert len(said) == 1 and "without checking them" in said[0]
    assert "servicequotas:" not in said[0]


def aws_faults_url() -> str:
    return os.environ["AWS_ENDPOINT_URL"]  # the fault front, set by the aws_faults fixture


# --- the bucket's region -----------------------------------------------------------------------


@pytest.fixture
def eu_bucket(moto_endpoint) -> str:
    name = f"eu-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", region_name=REGION).create_bucket(
        Bucket=name, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"}
    )
    return name


def test_a_bucket_in_another_region_is_refused_unless_accepted(
    spec, moto_endpoint, eu_bucket, bucket, ec2_quotas
):
    ec2_quotas.update({G_ON_DEMAND: 10_000})
    with pytest.raises(InputError) as refused:
        check(spec, moto_endpoint, bucket=eu_bucket)
    line = str(refused.value)
    assert "\n" not in line and "eu-west-1" in line and REGION in line
    assert "per GB" in line and "cross_region_data: true" in line
    assert check(spec, moto_endpoint, bucket=eu_bucket, cross_region_data=True) == []
    assert check(spec, moto_endpoint, bucket=bucket) == []


def test_a_throttled_headbucket_warns_instead_of_passing_as_no_bucket(
    spec, moto_endpoint, eu_bucket, ec2_quotas, aws_faults
):
    """HeadBucket throttled past its retries: where the bucket is stays unknown, which `up`
    says in one line (and goes on) instead of reading it as a bucket yet to be made."""
    ec2_quotas.update({G_ON_DEMAND: 10_000})
    aws_faults.fail("s3:HeadBucket", "SlowDown", times=None)
    said = check(spec, aws_faults_url(), bucket=eu_bucket)
    assert len(said) == 1 and f"region of bucket {eu_bucket} is unknown" in said[0], said
    assert "503" in said[0] and "\n" not in said[0]


def test_submit_refuses_a_dataset_in_another_region(spec, moto_endpoint, eu_bucket):
    job = job_preflight.Job(
        spec=spec, reused=True, keep=True,
        dataset=job_preflight.Dataset(_dataset(boto3.client("s3"), eu_bucket), moto_endpoint),
        cfg=TrainConfig(),
    )  # fmt: skip
    with pytest.raises(job_preflight.PreflightFailed) as refused:
        job_preflight.preflight(job)
    assert f"bucket {eu_bucket} is in eu-west-1 and cluster {spec.name} in {REGION}" in str(
        refused.value
    )
    # accepted: the preflight goes on, to the reused cluster (none runs)
    accepted = dataclasses.replace(job, spec=spec.model_copy(update={"cross_region_data": True}))
    with pytest.raises(job_preflight.PreflightFailed) as refused:
        job_preflight.preflight(accepted)
    assert "eu-west-1" not in str(refused.value) and f"--cluster {spec.name}" in str(refused.value)


# --- what the launch answered counts ----------------------------------------------------------


def test_up_keeps_instances_a_lagging_describe_does_not_list(spec, moto_endpoint, aws_faults):
    """For 3 s after RunInstances, EC2 leaves its instances out of a tag-filtered describe and
    answers their ids with InvalidInstanceID.NotFound (the fault front): `up` still waits for,
    pins and returns every instance it launched."""
    aws_faults.unseen_instances_s = 3.0
    info = aws_provider.up(spec, endpoint_url=aws_faults_url(), wait_timeout_s=60, wait_delay_s=0.2)

    assert info.master is not None and len(info.workers) == 2
    assert ("DescribeInstances", "lagging") in aws_faults.injected
    assert ("DescribeInstances", "InvalidInstanceID.NotFound") in aws_faults.injected
    ec2 = boto3.client("ec2", region_name=REGION)
    tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    ids = {i["InstanceId"] for r in ec2.describe_instances(Filters=tag)["Reservations"]
           for i in r["Instances"]}  # fmt: skip
    assert {i.id for i in info.instances} == ids
    assert all(i.public_ip for i in info.instances)


def test_a_launch_refused_for_quota_names_the_quota_not_capacity(spec, moto_endpoint, aws_faults):
    """Service Quotas said yes (or could not be read), RunInstances says VcpuLimitExceeded for
    every type: the line names the quota to raise, and `up` leaves nothing."""
    aws_faults.fail("RunInstances", "VcpuLimitExceeded", times=None)
    with pytest.raises(SparknetError) as refused:
        aws_provider.up(spec, endpoint_url=aws_faults_url(), wait_timeout_s=60, wait_delay_s=0.2)

    line = str(refused.value)
    assert "\n" not in line and "no capacity" not in line
    assert f"quota {G_ON_DEMAND} 'Running On-Demand G and VT instances' in {REGION}" in line
    assert "request-service-quota-increase" in line
    # the command asks for an amount, in the cluster's region: no placeholders to fill in
    asked = f"--region {REGION} --service-code ec2 --quota-code {G_ON_DEMAND} --desired-value "
    assert asked in line
    assert "VCPUS" not in line and "CODE" not in line
    assert live(spec) == 0
