"""Cluster lifecycle against moto's server, as a demanding user found it: two `up`s of one
cluster at once, a failed `up`'s clean-up next to another `up`'s instances, `sweep` in an
account shared by several people, `down` of a name that does not exist, what the cluster costs
as it runs, `--ami`, and `status` written to a pipe."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import boto3
import pytest

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import inventory, registry
from sparknet.cluster.aws import instances, launcher, prices
from sparknet.cluster.aws.foundation import node_role_name
from sparknet.cluster.spec import TAG_CLUSTER, TAG_OWNER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError
from tests.cluster import test_lifecycle
from tests.cluster.test_lifecycle import REGION, _left, _settings_file, _up, another_ami, cli
from tests.conftest import SPARKNET
from tests.moto_server import amazon_ami

pytestmark = pytest.mark.integration

#: the same cluster fixture (a fresh name, SPARKNET_HOME in tmp_path, taken down afterwards)
spec = test_lifecycle.spec

#: what moto answers GetCallerIdentity with for its default credentials
MOTO_USER = "arn:aws:sts::123456789012:user/moto"
INTACT = {"instances": 3, "vpcs": 1, "security_groups": 1, "roles": 1}
GONE = {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def _up_cli(spec: ClusterSpec, *more: str) -> list[str]:
    """`sparknet cluster up` of the test cluster: 2 on-demand g4dn workers, fixed SSH source."""
    return [
        str(SPARKNET), "cluster", "up", spec.name, "--allowed-cidr", "203.0.113.9/32",
        "--instance-type", "g4dn.xlarge", "--workers", "2", "--no-bootstrap", *more,
    ]  # fmt: skip


def start_and_wait_for(args: list[str], cwd, needle: str) -> tuple[subprocess.Popen, str]:
    """Start a CLI process and return once its stderr shows `needle` (it is then mid-`up`)."""
    proc = subprocess.Popen(
        args, cwd=cwd, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    seen = ""
    for line in proc.stderr:
        seen += line
        if needle in line:
            return proc, seen
    proc.wait(timeout=60)
    raise AssertionError(f"never saw {needle!r}: rc {proc.returncode}\n{seen}")


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# --- point 3: one `up`/`down` of a cluster at a time, and clean-ups remove only their own ------


def test_a_second_concurrent_up_refuses_at_once_naming_the_first_and_deletes_nothing(
    spec, moto_endpoint, tmp_path
):
    """Two real `sparknet cluster up` processes of one cluster: while the first holds the
    cluster (its foundation made, its instances launching), the second refuses in one line that
    names the first's PID. The end state is one intact cluster and its registry entry.

    moto answers in milliseconds, so the first is held where it is with SIGSTOP (and let go
    with SIGCONT) to be sure the second starts while the first is still at work."""
    _settings_file(spec, tmp_path)
    first, _ = start_and_wait_for(_up_cli(spec), tmp_path, "foundation ready")
    first.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        second = subprocess.run(
            _up_cli(spec), cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        first.send_signal(signal.SIGCONT)
    refused_in = time.monotonic() - started
    out, err = first.communicate(timeout=180)

    assert second.returncode == 1, second.stderr
    line = _one_line(second.stderr)
    assert f"cluster {spec.name} is busy" in line and f"PID {first.pid}" in line
    assert refused_in < 30  # at once: no AWS call, only Python's start-up
    assert first.returncode == 0, err
    assert _left(spec) == INTACT
    assert spec.name in registry.registered()
    assert out.count("i-") == 3


def test_a_killed_up_leaves_no_stale_lock(spec, moto_endpoint, tmp_path):
    """kill -9 in the middle of `up`: the kernel drops the lock, so the next `up` runs (and,
    being idempotent, completes the cluster)."""
    _settings_file(spec, tmp_path)
    first, _ = start_and_wait_for(_up_cli(spec), tmp_path, "foundation ready")
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)

    again = subprocess.run(
        _up_cli(spec), cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert _left(spec) == INTACT


def test_the_lock_refuses_while_held_and_is_free_after_its_holder_is_killed(
    spec, moto_endpoint, tmp_path
):
    """The lock, held by another real process (which then dies by SIGKILL): `down` of the
    cluster meanwhile refuses and deletes nothing."""
    _up(spec, moto_endpoint)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom sparknet.cluster import registry\n"
         f"with registry.cluster_lock({spec.name!r}):\n    print('held', flush=True)\n"
         "    time.sleep(60)\n"],
        env=os.environ.copy(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(registry.ClusterBusy, match=f"PID {holder.pid}"):
        aws_provider.down(spec, endpoint_url=moto_endpoint)
    assert _left(spec) == INTACT
    with (
        pytest.raises(registry.ClusterBusy, match=f"PID {holder.pid}"),
        registry.cluster_lock(spec.name),
    ):
        pass
    holder.kill()
    holder.wait(timeout=30)
    with registry.cluster_lock(spec.name):
        pass  # free again


def test_a_failed_up_removes_only_what_it_made_not_what_another_up_added(
    spec, moto_endpoint, monkeypatch
):
    """While this `up` waits for its instances, another `up` of the same name (another machine:
    no shared lock) launches an instance and makes a security group of the cluster. This `up`
    then fails: it must remove its own instances and foundation, and leave the others'."""
    ec2 = boto3.client("ec2", region_name=REGION)
    image = amazon_ami(REGION)
    other: dict[str, str] = {}

    def tags(role: str) -> list[dict]:
        return [{"Key": TAG_CLUSTER, "Value": spec.name}, {"Key": TAG_ROLE, "Value": role}]

    def another_up_then_fail(*args, **kwargs):
        other["instance"] = ec2.run_instances(
            ImageId=image, InstanceType="g4dn.xlarge", MinCount=1, MaxCount=1,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags("worker")}],
        )["Instances"][0]["InstanceId"]  # fmt: skip
        other["group"] = ec2.create_security_group(
            GroupName=f"other-{spec.name}", Description="another up's",
            TagSpecifications=[{"ResourceType": "security-group", "Tags": tags("foundation")}],
        )["GroupId"]  # fmt: skip
        raise SparknetError("injected failure while waiting")

    monkeypatch.setattr(instances, "wait_ready", another_up_then_fail)
    with pytest.raises(SparknetError, match="injected failure"):
        _up(spec, moto_endpoint)

    live = [i.id for i in instances.find(instances.ec2_client(REGION, moto_endpoint), spec.name)]
    assert live == [other["instance"]]
    assert ec2.describe_security_groups(GroupIds=[other["group"]])["SecurityGroups"]
    tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    assert ec2.describe_vpcs(Filters=tag)["Vpcs"] == []  # this run's foundation went
    assert spec.name not in registry.registered()


def test_ctrl_c_after_a_launch_whose_answer_was_lost_still_removes_its_instances(
    spec, moto_endpoint, monkeypatch
):
    """Ctrl-C lands after RunInstances launched the workers but before `launch` returned their
    ids to `up`: the clean-up finds them by this run's own ClientToken prefix."""
    real_launch = launcher.launch

    def launch_then_interrupt(*args, **kwargs):
        launched = real_launch(*args, **kwargs)
        if kwargs["role"] == "worker":
            raise KeyboardInterrupt
        return launched

    monkeypatch.setattr(launcher, "launch", launch_then_interrupt)
    with pytest.raises(SparknetError, match="interrupted"):
        _up(spec, moto_endpoint)
    assert _left(spec) == GONE


# --- point 8: owners ---------------------------------------------------------------------------


def _tags(resource: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def test_up_tags_what_it_makes_with_the_callers_identity(spec, moto_endpoint):
    info = _up(spec, moto_endpoint)
    ec2 = boto3.client("ec2", region_name=REGION)
    ids = [i.id for i in info.instances]
    raws = [
        i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]
    ]
    volumes = ec2.describe_volumes(Filters=[{"Name": "attachment.instance-id", "Values": ids}])
    tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
    vpcs = ec2.describe_vpcs(Filters=tag)["Vpcs"]
    role = boto3.client("iam").list_role_tags(RoleName=node_role_name(spec))["Tags"]

    assert [_tags(r)[TAG_OWNER] for r in raws] == [MOTO_USER] * 3
    assert [_tags(v)[TAG_OWNER] for v in volumes["Volumes"]] == [MOTO_USER] * 3
    assert [_tags(v)[TAG_OWNER] for v in vpcs] == [MOTO_USER]
    assert _tags({"Tags": role})[TAG_OWNER] == MOTO_USER
    assert registry.registered()[spec.name].owner == MOTO_USER


def test_owner_in_the_clusters_section_is_refused(spec, tmp_path):
    _settings_file(spec, tmp_path, owner="arn:aws:iam::123456789012:user/someone")
    done = cli("up", spec.name, cwd=tmp_path)
    assert done.returncode == 2
    assert "`owner` is set by `up`" in _one_line(done.stderr)
    assert _left(spec) == GONE


@pytest.fixture
def colleague(moto_endpoint):
    """Credentials of another principal of the same account (an assumed role, as SSO users
    are): what moto's STS answers for them is that role session's ARN."""
    iam = boto3.client("iam", region_name=REGION)
    name = "sparknet-test-colleague"
    with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
        iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")
    creds = boto3.client("sts", region_name=REGION).assume_role(
        RoleArn=f"arn:aws:iam::123456789012:role/{name}", RoleSessionName="alice@example.com"
    )["Credentials"]
    return {
        "AWS_ACCESS_KEY_ID": creds["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
        "AWS_SESSION_TOKEN": creds["SessionToken"],
    }


def test_sweep_touches_only_the_callers_clusters_unless_all_owners(
    spec, moto_endpoint, tmp_path, monkeypatch, colleague
):
    """Three forgotten clusters in one account: a colleague's, the caller's, and one from a
    sparknet that did not tag owners. `sweep --yes` takes down only the caller's and says why
    it left the others; `--all-owners --yes` takes down the rest."""
    theirs = spec.model_copy(update={"name": f"{spec.name}-t"})
    with monkeypatch.context() as m:
        for key, value in colleague.items():
            m.setenv(key, value)
        _up(theirs, moto_endpoint)
    _up(spec, moto_endpoint)
    old = f"{spec.name}-o"
    ec2 = boto3.client("ec2", region_name=REGION)
    ec2.run_instances(
        ImageId=amazon_ami(REGION),
        InstanceType="g4dn.xlarge", MinCount=1, MaxCount=1,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [
            {"Key": TAG_CLUSTER, "Value": old}, {"Key": TAG_ROLE, "Value": "master"}]}],
    )  # fmt: skip
    for path in registry.registry_dir().glob("*.json"):
        path.unlink()  # all three forgotten here

    try:
        swept = cli("sweep", "--region", REGION, "--yes", cwd=tmp_path)
        assert swept.returncode == 0, swept.stderr
        lines = swept.stdout.splitlines()
        assert f"took {spec.name} down" in lines
        alice = "arn:aws:sts::123456789012:assumed-role/sparknet-test-colleague/alice@example.com"
        assert f"skipped {theirs.name}: owned by {alice}" in lines
        assert any(ln.startswith(f"skipped {old}: resources without an owner tag") for ln in lines)
        assert _left(spec) == GONE
        assert _left(theirs) == INTACT
        assert len(instances.find(ec2, old)) == 1

        listed = cli("list", "--region", REGION, cwd=tmp_path)
        assert f"owner {alice}" in next(
            ln for ln in listed.stdout.splitlines() if theirs.name in ln
        )

        swept = cli("sweep", "--region", REGION, "--yes", "--all-owners", cwd=tmp_path)
        assert swept.returncode == 0, swept.stderr
        assert f"took {theirs.name} down" in swept.stdout and f"took {old} down" in swept.stdout
        assert _left(theirs) == GONE
        assert instances.find(ec2, old) == []
    finally:
        for name in (theirs.name, old):
            if name in inventory.tagged_clusters(REGION, endpoint_url=moto_endpoint):
                aws_provider.down(
                    spec.model_copy(update={"name": name}), endpoint_url=moto_endpoint
                )


# --- point 9: `down` of a name that does not exist ---------------------------------------------


def test_down_of_an_unknown_name_exits_1_and_names_the_clusters_there(
    spec, moto_endpoint, tmp_path
):
    _up(spec, moto_endpoint)
    typo = f"{spec.name}x"

    gone = cli("down", typo, "--region", REGION, cwd=tmp_path)
    assert gone.returncode == 1, gone.stdout + gone.stderr
    line = _one_line(gone.stderr)
    assert (
        f"no cluster {typo} in {REGION}" in line and spec.name in line.split("clusters there:")[1]
    )
    assert "is down" not in gone.stdout

    elsewhere = cli("down", spec.name, "--region", "eu-west-3", cwd=tmp_path)
    assert elsewhere.returncode == 1
    assert "it is in us-east-1 (registered here): pass --region us-east-1" in _one_line(
        elsewhere.stderr
    )
    assert _left(spec) == INTACT  # the real cluster was not touched


# --- point 10: price what runs -----------------------------------------------------------------

#: g5.xlarge master and 2 g4dn.xlarge workers on demand (prices.json), 3 x 120 GiB gp3 at
#: $0.08/GB-month over 730 hours, 3 public IPv4 addresses at $0.005/hour
COMPUTE = 1.006 + 2 * 0.526
EBS = 3 * 120 * 0.08 / 730
IPV4 = 3 * 0.005


def test_up_and_status_price_the_running_instances_volumes_and_addresses(
    spec, moto_endpoint, tmp_path
):
    info = _up(spec, moto_endpoint)
    assert info.cost.compute == pytest.approx(COMPUTE)
    assert (info.cost.ebs_gib, info.cost.public_ipv4) == (360, 3)
    assert info.cost.ebs == pytest.approx(EBS)
    assert info.cost.ipv4 == pytest.approx(IPV4)
    assert info.hourly_usd == pytest.approx(COMPUTE + EBS + IPV4)  # 2.1124...

    # what runs, not what the spec now says
    changed = spec.model_copy(update={"workers": 8, "instance_types": ["p5.48xlarge"]})
    assert aws_provider.status(changed, endpoint_url=moto_endpoint).cost == info.cost

    shown = cli("status", spec.name, "--region", REGION, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert (
        "estimated cost $2.11/hour (instances $2.058, 360 GiB EBS $0.039, 3 public IPv4 $0.015)"
        in shown.stdout
    )


def test_down_prices_each_instances_life_from_what_ran(spec, moto_endpoint):
    info = _up(spec, moto_endpoint)
    ec2 = instances.ec2_client(REGION, moto_endpoint)
    found = instances.find(ec2, spec.name)
    two_hours_on = max(i.launched_at for i in found) + timedelta(hours=2)
    lives_h = [(two_hours_on - i.launched_at).total_seconds() / 3600 for i in found]
    per = prices.hourly_costs(ec2, found)
    expected = sum(per[i.id].total * h for i, h in zip(found, lives_h, strict=True))
    assert aws_provider.lifetime_cost(ec2, found, two_hours_on) == pytest.approx(expected)
    assert expected == pytest.approx(2 * (COMPUTE + EBS + IPV4), rel=0.01)

    started = min(i.launched_at for i in info.instances)
    report = aws_provider.down(spec, endpoint_url=moto_endpoint)
    elapsed_h = (time.time() - started.timestamp()) / 3600
    assert 0 < report.cost_usd <= (COMPUTE + EBS + IPV4) * elapsed_h


def test_an_unknown_price_makes_the_estimate_unknown_not_low(spec, moto_endpoint):
    """Workers of a type the price table lacks: the total is unknown, not the master's alone."""
    info = _up(spec.model_copy(update={"instance_types": ["c5.large"]}), moto_endpoint)
    assert [w.type for w in info.workers] == ["c5.large"] * 2
    assert info.cost.compute is None and info.hourly_usd is None
    assert info.cost.describe().startswith("unknown (instances unknown, 360 GiB EBS $0.039")


# --- point 12: --ami, and `status` into a pipe -------------------------------------------------


def test_up_ami_flag_and_status_into_a_pipe_keep_whole_instance_ids(spec, moto_endpoint, tmp_path):
    _settings_file(spec, tmp_path)
    ami = another_ami()
    done = subprocess.run(
        _up_cli(spec, "--ami", ami), cwd=tmp_path, env=os.environ.copy(), capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ec2 = boto3.client("ec2", region_name=REGION)
    found = instances.find(instances.ec2_client(REGION, moto_endpoint), spec.name)
    raws = ec2.describe_instances(InstanceIds=[i.id for i in found])["Reservations"]
    assert {i["ImageId"] for r in raws for i in r["Instances"]} == {ami}
    assert (
        json.loads((registry.registry_dir() / f"{spec.name}.json").read_text())["spec"]["ami"]
        == ami
    )

    env = {**os.environ, "COLUMNS": "80"}
    shown = subprocess.run(
        [str(SPARKNET), "cluster", "status", spec.name], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    for inst in found:
        assert len(inst.id) == 19  # i- and 17 hex digits, as AWS makes them
        row = next(ln for ln in shown.stdout.splitlines() if inst.id in ln)
        assert row.split("\t")[:4] == [inst.role, inst.id, "running", inst.type]
    assert all(inst.id in done.stdout for inst in found)


@pytest.mark.parametrize(
    ("ami", "says"),
    [("ami-0000000000000dead", "does not exist in us-east-1"), ("bogus", "is not an AMI id")],
)
def test_up_with_a_wrong_ami_is_one_line_and_creates_nothing(spec, tmp_path, ami, says):
    _settings_file(spec, tmp_path)
    done = subprocess.run(
        _up_cli(spec, "--ami", ami), cwd=tmp_path, env=os.environ.copy(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert ami in line and says in line
    assert _left(spec) == GONE
    assert spec.name not in registry.registered()


@pytest.mark.parametrize(
    "operation",
    [
        "CreateVpc", "CreateInternetGateway", "CreateSubnet", "CreateRouteTable",
        "CreateVpcEndpoint", "CreateSecurityGroup", "CreateRole", "CreateInstanceProfile",
    ],
)  # fmt: skip
def test_a_signal_right_after_a_create_call_leaves_nothing_behind(
    spec, moto_endpoint, monkeypatch, operation
):
    """SIGINT lands as the Create call's answer arrives, before its id is recorded: the record
    is made first (the CLI's handler holds the signal for that moment), so the clean-up knows
    the resource and removes it. A real signal to this process, through the CLI's handler."""
    import botocore.client

    from sparknet.cli.common import Caught, interrupts

    real = botocore.client.BaseClient._make_api_call
    sent = []

    def answer_then_signal(self, name, params):
        response = real(self, name, params)
        if name == operation and not sent:
            sent.append(name)
            os.kill(os.getpid(), signal.SIGINT)
        return response

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", answer_then_signal)
    caught = Caught()
    with pytest.raises(SparknetError, match="interrupted"), interrupts(caught):
        _up(spec, moto_endpoint)
    assert sent == [operation] and caught.signum == signal.SIGINT
    assert _left(spec) == GONE
    left = inventory.tagged_clusters(REGION, endpoint_url=moto_endpoint).get(spec.name)
    assert left is None or not left.items, left
