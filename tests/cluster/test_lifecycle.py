"""`up` / `down` against moto's server: exact resources, idempotence, and nothing left behind
after a failure or Ctrl-C in the middle of `up`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections import Counter

import boto3
import pytest
import yaml
from botocore.exceptions import ClientError

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import inventory, registry
from sparknet.cluster.aws import instances, preflight
from sparknet.cluster.aws.foundation import node_role_name
from sparknet.cluster.spec import TAG_CLUSTER, ClusterSpec
from sparknet.errors import SparknetError
from tests.cluster.moto_clusters import moto_spec
from tests.conftest import REPO, SPARKNET
from tests.moto_server import amazon_amis

pytestmark = pytest.mark.integration

REGION = "us-east-1"
AMI_PARAMETER = "/test/sparknet/lifecycle-ami"


@pytest.fixture
def spec(moto_endpoint, tmp_path, monkeypatch):
    with moto_spec(
        moto_endpoint, tmp_path, monkeypatch, prefix="l", ami_parameter=AMI_PARAMETER
    ) as spec:
        yield spec


def another_ami() -> str:
    """A moto AMI other than the one the test's SSM parameter names (`--ami`, `AMI=`)."""
    ssm = boto3.client("ssm", region_name=REGION)
    default = ssm.get_parameter(Name=AMI_PARAMETER)["Parameter"]["Value"]
    return next(i for i in amazon_amis(REGION) if i != default and preflight.AMI_ID.fullmatch(i))


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
    return aws_provider.up(spec, endpoint_url=endpoint, wait_timeout_s=60, wait_delay_s=0.2)


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
    assert spec.name in registry.registered()


def test_down_leaves_nothing_with_the_cluster_tag(spec, moto_endpoint):
    info = _up(spec, moto_endpoint)
    report = aws_provider.down(spec, endpoint_url=moto_endpoint)
    assert sorted(report.terminated) == sorted(i.id for i in info.instances)
    assert any(d.startswith("vpc:") for d in report.deleted)
    assert report.cost_usd is not None and report.cost_usd >= 0
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
    assert spec.name not in registry.registered()


def _failing_launches(monkeypatch, codes: dict[int, str]) -> list[dict]:
    """RunInstances call number n (from 1) fails with `codes[n]` (or `codes[0]`, any call not
    named, when given): a stub on the real client, because moto never fails a launch. Returns
    the list every call's parameters go to."""
    real = instances.ec2_client
    calls: list[dict] = []

    def failing_client(*args, **kwargs):
        ec2 = real(*args, **kwargs)
        run = ec2.run_instances

        def run_instances(**params):
            calls.append(params)
            code = codes.get(len(calls), codes.get(0) if len(calls) > 1 else None)
            if code is not None:
                error = {"Code": code, "Message": f"injected at launch {len(calls)}"}
                raise ClientError({"Error": error}, "RunInstances")
            return run(**params)

        ec2.run_instances = run_instances
        return ec2

    monkeypatch.setattr(instances, "ec2_client", failing_client)
    return calls


def test_an_error_at_the_third_launch_removes_everything_up_made(spec, moto_endpoint, monkeypatch):
    """RunInstances: 1st the master; 2nd the workers, refused for capacity in the first AZ; the
    3rd, the workers' fallback to the next AZ, fails with an error no fallback helps. The master
    must go, and the foundation."""
    calls = _failing_launches(monkeypatch, {2: "InsufficientInstanceCapacity", 3: "InternalError"})
    with pytest.raises(SparknetError, match="injected at launch 3"):
        _up(spec, moto_endpoint)
    assert len(calls) == 3
    subnets = [c["NetworkInterfaces"][0]["SubnetId"] for c in calls[1:]]
    assert subnets[0] != subnets[1]  # the third launch was the fallback to another AZ
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
    assert spec.name not in registry.registered()


@pytest.mark.parametrize(
    ("code", "says"),
    [("InsufficientInstanceCapacity", "no capacity for 2"), ("VcpuLimitExceeded", "quota")],
)
def test_workers_refused_on_every_fallback_leave_nothing(
    spec, moto_endpoint, monkeypatch, code, says
):
    """Every workers' launch, in every AZ, is refused: one line, and the master goes too."""
    calls = _failing_launches(monkeypatch, {0: code})
    with pytest.raises(SparknetError, match=says) as info:
        _up(spec, moto_endpoint)
    assert "\n" not in str(info.value)
    assert len(calls) >= 2
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_ctrl_c_during_up_removes_everything_up_made(spec, moto_endpoint, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(instances, "wait_ready", interrupted)
    with pytest.raises(SparknetError, match="interrupted"):
        _up(spec, moto_endpoint)
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def _kinds(items: list[str]) -> dict[str, int]:
    return dict(Counter(item.split(":", 1)[0] for item in items))


def test_orphans_list_every_tagged_resource_of_clusters_nobody_wants(spec, moto_endpoint):
    _up(spec, moto_endpoint)
    found = inventory.orphans(REGION, set(), endpoint_url=moto_endpoint)
    kinds = _kinds(found[spec.name].items)
    # every resource carries the owner tag: moto's default caller made them all
    assert found[spec.name].owners == {"arn:aws:sts::123456789012:user/moto"}
    assert kinds["instance"] == 3
    assert (kinds["vpc"], kinds["security-group"], kinds["internet-gateway"]) == (1, 1, 1)
    assert kinds["subnet"] >= 2 and kinds["route-table"] == 1
    assert (kinds["iam-role"], kinds["instance-profile"]) == (1, 1)
    assert spec.name not in inventory.orphans(REGION, {spec.name}, endpoint_url=moto_endpoint)


def cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SPARKNET), "cluster", *args], cwd=cwd, env=os.environ.copy(),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_down_works_from_tags_alone_after_the_registry_is_lost(spec, moto_endpoint, tmp_path):
    _up(spec, moto_endpoint)
    shutil.rmtree(registry.registry_dir())
    gone = cli("down", spec.name, "--region", REGION, cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout.count("terminated instance:") == 3 and "deleted vpc:" in gone.stdout
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_sweep_lists_then_deletes_a_forgotten_clusters_foundation(spec, moto_endpoint, tmp_path):
    """Instances already gone, registry lost: only the foundation is left to find, by tag."""
    _up(spec, moto_endpoint)
    ec2 = instances.ec2_client(REGION, moto_endpoint)
    instances.terminate_cluster(ec2, spec.name, delay_s=0.2)
    shutil.rmtree(registry.registry_dir())

    listed = cli("sweep", "--region", REGION, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    line = next(ln for ln in listed.stdout.splitlines() if ln.startswith(f"orphan {spec.name}:"))
    assert "instance:" not in line and "vpc:" in line and "iam-role:" in line
    assert "--yes" in listed.stdout
    assert _left(spec) == {"instances": 0, "vpcs": 1, "security_groups": 1, "roles": 1}

    swept = cli("sweep", "--region", REGION, "--yes", cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr
    assert f"took {spec.name} down" in swept.stdout
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
    assert spec.name not in inventory.orphans(REGION, set(), endpoint_url=moto_endpoint)


def _settings_file(spec: ClusterSpec, folder, **entry) -> str:
    """A sparknet.yaml in `folder` whose `clusters:` entry for `spec` holds `entry`, plus the
    region and the test's AMI parameter."""
    path = folder / "sparknet.yaml"
    entry = {"region": REGION, "ami_parameter": AMI_PARAMETER, **entry}
    path.write_text(yaml.safe_dump({"clusters": {spec.name: entry}}))
    return str(path)


def test_cli_up_status_down_from_a_clusters_section(spec, moto_endpoint, tmp_path):
    _settings_file(
        spec, tmp_path, workers=1, instance_types=["g4dn.xlarge"], allowed_cidr="203.0.113.9/32"
    )

    done = cli("up", spec.name, "--no-bootstrap", cwd=tmp_path)  # no SSH behind moto's nodes
    assert done.returncode == 0, done.stderr
    assert f"cluster {spec.name} is up" in done.stdout and "$" in done.stdout
    assert f"`sparknet cluster down {spec.name} --region {REGION}` ends it" in done.stdout
    assert _left(spec)["instances"] == 2
    shown = cli("status", spec.name, cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.count("i-") == 2
    assert "/hour" in shown.stdout
    gone = cli("down", spec.name, cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert "deleted vpc:" in gone.stdout and gone.stdout.count("terminated instance:") == 2
    after = cli("status", spec.name, cwd=tmp_path)
    assert after.returncode == 1 and f"no cluster {spec.name} in {REGION}" in after.stderr
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_cli_up_with_an_unoffered_type_is_one_line_and_creates_nothing(spec, tmp_path):
    # moto offers no p3.2xlarge in us-east-1
    done = cli(
        "up", spec.name, "--instance-type", "p3.2xlarge", "--allowed-cidr", "203.0.113.9/32",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "p3.2xlarge" in lines[0], done.stderr
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_sigterm_during_cli_up_removes_everything_and_a_second_one_does_not_cut_it_short(
    spec, moto_endpoint, tmp_path
):
    """`kill` (or a closed terminal) while `up` launches: the same clean-up as Ctrl-C. A second
    SIGTERM during that clean-up is acknowledged, not obeyed."""
    _settings_file(spec, tmp_path)
    proc = subprocess.Popen(
        [str(SPARKNET), "cluster", "up", spec.name, "--allowed-cidr", "203.0.113.9/32",
         "--instance-type", "g4dn.xlarge", "--workers", "2"],
        cwd=tmp_path, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "launching the master" in line:
            proc.send_signal(signal.SIGTERM)
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + rest
    assert "interrupted; everything this `up` created was removed again" in rest
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_make_cluster_up_and_down_with_settings_from_the_clusters_section(
    spec, moto_endpoint, tmp_path
):
    """The Makefile targets as a user runs them; unset variables leave `clusters:` in charge."""
    config = _settings_file(
        spec, tmp_path, workers=3, instance_types=["g4dn.xlarge"], allowed_cidr="203.0.113.9/32"
    )
    env = {**os.environ, "SPARKNET_CONFIG": config}

    def make(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["make", "-s", "-o", ".venv/.installed", *args, f"NAME={spec.name}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    ec2 = boto3.client("ec2", region_name=REGION)
    ami = another_ami()
    # BOOTSTRAP=0: moto's instances have no SSH behind them (and their public addresses are
    # not this machine's to connect to)
    done = make("cluster-up", "WORKERS=1", "SPOT=1", f"AMI={ami}", "BOOTSTRAP=0")
    assert done.returncode == 0, done.stderr
    found = instances.find(instances.ec2_client(REGION, moto_endpoint), spec.name)
    assert [(i.role, i.type, i.spot) for i in found] == [
        ("master", "g5.xlarge", False), ("worker", "g4dn.xlarge", True)
    ]  # fmt: skip
    raws = ec2.describe_instances(InstanceIds=[i.id for i in found])["Reservations"]
    assert {i["ImageId"] for r in raws for i in r["Instances"]} == {ami}
    gone = make("cluster-down")
    assert gone.returncode == 0, gone.stderr
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_a_failed_clean_up_says_what_is_left_and_down_removes_it(spec, moto_endpoint, monkeypatch):
    """The launch fails and then so does the clean-up's TerminateInstances: the one line names
    both and the command that ends what is left, and that command does."""
    real_client, real_terminate = instances.ec2_client, instances.terminate
    _failing_launches(monkeypatch, {2: "InternalError"})

    def refuse(*args, **kwargs):
        raise SparknetError("TerminateInstances in us-east-1 failed: RequestLimitExceeded: slow")

    monkeypatch.setattr(instances, "terminate", refuse)
    with pytest.raises(SparknetError) as info:
        _up(spec, moto_endpoint)
    text = str(info.value)
    assert "\n" not in text and "injected at launch 2" in text and "RequestLimitExceeded" in text
    assert f"sparknet cluster down {spec.name} --region {REGION}" in text
    assert _left(spec)["instances"] == 1  # the master

    monkeypatch.setattr(instances, "ec2_client", real_client)
    monkeypatch.setattr(instances, "terminate", real_terminate)
    aws_provider.down(spec, endpoint_url=moto_endpoint)
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
