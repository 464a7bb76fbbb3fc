"""`up` / `down` against moto's server: exact resources, idempotence, and nothing left behind
after a failure or Ctrl-C in the middle of `up`."""

from __future__ import annotations

import uuid

import boto3
import pytest

from sparknet.cluster import instances, lifecycle
from sparknet.cluster.foundation import node_role_name
from sparknet.cluster.spec import TAG_CLUSTER, ClusterSpec
from sparknet.errors import SparknetError

REGION = "us-east-1"
AMI_PARAMETER = "/test/sparknet/lifecycle-ami"


@pytest.fixture
def spec(moto_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv(lifecycle.HOME_ENV, str(tmp_path / "home"))
    ec2 = boto3.client("ec2", region_name=REGION)
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    boto3.client("ssm", region_name=REGION).put_parameter(
        Name=AMI_PARAMETER, Value=ami, Type="String", Overwrite=True
    )
    spec = ClusterSpec(
        name=f"l{uuid.uuid4().hex[:8]}", region=REGION, workers=2, master_type="g5.xlarge",
        instance_types=["g4dn.xlarge"], ami_parameter=AMI_PARAMETER,
        allowed_cidr="203.0.113.9/32", root_volume_gb=120,
    )  # fmt: skip
    yield spec
    lifecycle.down(spec, endpoint_url=moto_endpoint)


def _left(spec: ClusterSpec) -> dict[str, int]:
    """What still exists with the cluster's tag (or its role name)."""
    ec2 = boto3.client("ec2", region_name=REGION)
    tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    live = [
        i
        for r in ec2.describe_instances(Filters=tag)["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] != "terminated"
    ]
    iam = boto3.client("iam", region_name=REGION)
    roles = [r for r in iam.list_roles()["Roles"] if r["RoleName"] == node_role_name(spec)]
    return {
        "instances": len(live),
        "vpcs": len(ec2.describe_vpcs(Filters=tag)["Vpcs"]),
        "security_groups": len(ec2.describe_security_groups(Filters=tag)["SecurityGroups"]),
        "roles": len(roles),
    }


def _up(spec, endpoint):
    return lifecycle.up(spec, endpoint_url=endpoint, wait_timeout_s=60, wait_delay_s=0.2)


def test_up_makes_master_and_workers_and_twice_changes_nothing(spec, moto_endpoint):
    info = _up(spec, moto_endpoint)
    assert info.master is not None and info.master.type == "g5.xlarge"
    assert [w.type for w in info.workers] == ["g4dn.xlarge"] * 2
    assert _left(spec) == {"instances": 3, "vpcs": 1, "security_groups": 1, "roles": 1}
    assert info.hourly_usd is not None and info.hourly_usd > 0
    ec2 = boto3.client("ec2", region_name=REGION)
    raws = [
        i
        for r in ec2.describe_instances(InstanceIds=[i.id for i in info.instances])["Reservations"]
        for i in r["Instances"]
    ]
    assert all(r["MetadataOptions"]["HttpTokens"] == "required" for r in raws)
    again = _up(spec, moto_endpoint)
    assert sorted(i.id for i in again.instances) == sorted(i.id for i in info.instances)
    assert spec.name in lifecycle.registered()


def test_down_leaves_nothing_with_the_cluster_tag(spec, moto_endpoint):
    info = _up(spec, moto_endpoint)
    report = lifecycle.down(spec, endpoint_url=moto_endpoint)
    assert sorted(report.terminated) == sorted(i.id for i in info.instances)
    assert any(d.startswith("vpc:") for d in report.deleted)
    assert report.cost_usd is not None and report.cost_usd >= 0
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
    assert spec.name not in lifecycle.registered()


def test_a_failed_worker_launch_removes_everything_up_made(spec, moto_endpoint, monkeypatch):
    """The workers' RunInstances fails with an error no fallback helps (a stub on the real
    client: moto never fails a launch); the master launched before it must go too."""
    real = instances.ec2_client

    def failing_client(*args, **kwargs):
        ec2 = real(*args, **kwargs)
        run = ec2.run_instances
        calls = []

        def run_instances(**params):
            calls.append(params)
            if len(calls) >= 2:
                from botocore.exceptions import ClientError

                raise ClientError(
                    {"Error": {"Code": "InternalError", "Message": "injected"}}, "RunInstances"
                )
            return run(**params)

        ec2.run_instances = run_instances
        return ec2

    monkeypatch.setattr(instances, "ec2_client", failing_client)
    with pytest.raises(SparknetError, match="injected"):
        _up(spec, moto_endpoint)
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
    assert spec.name not in lifecycle.registered()


def test_ctrl_c_during_up_removes_everything_up_made(spec, moto_endpoint, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(instances, "wait_ready", interrupted)
    with pytest.raises(SparknetError, match="interrupted"):
        _up(spec, moto_endpoint)
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_orphans_are_clusters_nobody_wants(spec, moto_endpoint):
    _up(spec, moto_endpoint)
    found = lifecycle.orphans(REGION, set(), endpoint_url=moto_endpoint)
    assert len(found[spec.name]) == 3
    assert spec.name not in lifecycle.orphans(REGION, {spec.name}, endpoint_url=moto_endpoint)


def test_cli_up_status_down_from_a_clusters_section(spec, moto_endpoint, tmp_path):
    import os
    import subprocess

    import yaml

    from tests.conftest import SPARKNET

    settings = {
        "clusters": {
            spec.name: {
                "region": REGION, "workers": 1, "instance_types": ["g4dn.xlarge"],
                "ami_parameter": AMI_PARAMETER, "allowed_cidr": "203.0.113.9/32",
            }
        }
    }  # fmt: skip
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump(settings))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SPARKNET), "cluster", *args], cwd=tmp_path, env=os.environ.copy(),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    done = cli("up", spec.name)
    assert done.returncode == 0, done.stderr
    assert f"cluster {spec.name} is up" in done.stdout and "$" in done.stdout
    assert _left(spec)["instances"] == 2
    shown = cli("status", spec.name)
    assert shown.returncode == 0 and shown.stdout.count("i-") == 2
    gone = cli("down", spec.name)
    assert gone.returncode == 0, gone.stderr
    assert "deleted vpc:" in gone.stdout and gone.stdout.count("terminated instance:") == 2
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_cli_up_with_an_unoffered_type_is_one_line_and_creates_nothing(spec, tmp_path):
    import os
    import subprocess

    from tests.conftest import SPARKNET

    done = subprocess.run(
        [str(SPARKNET), "cluster", "up", spec.name, "--instance-type", "p3.2xlarge",
         "--allowed-cidr", "203.0.113.9/32"],
        cwd=tmp_path, env=os.environ.copy(),  # moto offers no p3.2xlarge in us-east-1
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "p3.2xlarge" in lines[0], done.stderr
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
