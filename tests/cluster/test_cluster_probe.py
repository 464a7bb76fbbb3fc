"""Cluster lifecycle defects a tester found after the first hardening round, against moto's
server: another principal's cluster of the same name, regions, stopped instances, names sparknet
no longer accepts, resources `list` missed, interrupted `down`, exit codes, free checks, and a
shrinking `up`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import boto3
import pytest

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import inventory, records, registry
from sparknet.cluster.spec import TAG_OWNER, ClusterSpec
from tests.cluster import test_lifecycle
from tests.cluster.test_lifecycle import REGION, _left, _settings_file, _up, cli
from tests.cluster.test_lifecycle_hardening import start_and_wait_for
from tests.conftest import SPARKNET
from tests.moto_server import amazon_ami

pytestmark = pytest.mark.integration

#: the same cluster fixture (a fresh name, SPARKNET_HOME in tmp_path, taken down afterwards)
spec = test_lifecycle.spec

BOB = "arn:aws:sts::123456789012:assumed-role/Dev/bob"


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def _retag_owner(spec: ClusterSpec, owner: str, endpoint: str) -> None:
    """Every tagged resource of the cluster (EC2 and IAM) now says `owner` made it."""
    ec2 = boto3.client("ec2", region_name=REGION)
    iam = boto3.client("iam", region_name=REGION)
    tag = {"Key": TAG_OWNER, "Value": owner}
    for item in inventory.tagged_clusters(REGION, endpoint_url=endpoint)[spec.name].items:
        kind, _, ident = item.partition(":")
        if kind == "iam-role":
            iam.tag_role(RoleName=ident, Tags=[tag])
        elif kind == "instance-profile":
            iam.tag_instance_profile(InstanceProfileName=ident, Tags=[tag])
        elif kind == "key-pair":  # tagged by its id, listed by its name
            (pair,) = ec2.describe_key_pairs(KeyNames=[ident])["KeyPairs"]
            ec2.create_tags(Resources=[pair["KeyPairId"]], Tags=[tag])
        else:
            ec2.create_tags(Resources=[ident], Tags=[tag])


def _ssh_sources(spec: ClusterSpec) -> list[str]:
    ec2 = boto3.client("ec2", region_name=REGION)
    groups = ec2.describe_security_groups(
        Filters=[{"Name": "tag:sparknet:cluster", "Values": [spec.name]}]
    )["SecurityGroups"]
    return sorted(
        r["CidrIp"] for g in groups for p in g["IpPermissions"] for r in p.get("IpRanges", [])
    )


# --- 1: another principal's cluster of the same name -------------------------------------------


def test_up_and_down_refuse_a_cluster_of_that_name_owned_by_another(spec, moto_endpoint, tmp_path):
    """bob's cluster has the name; this machine's registry does not know it. `up` must not
    rewrite bob's SSH rule or launch into bob's VPC, `down` must not delete it: both refuse in
    one line (exit 1) naming bob; `--any-owner` is the explicit way through."""
    _up(spec.model_copy(update={"workers": 1}), moto_endpoint)
    _retag_owner(spec, BOB, moto_endpoint)
    for path in registry.registry_dir().glob("*.json"):
        path.unlink()
    _settings_file(spec, tmp_path, instance_types=["g4dn.xlarge"])
    before = _left(spec)
    rules = _ssh_sources(spec)

    took = cli("up", spec.name, "--allowed-cidr", "192.0.2.9/32", "--workers", "4", cwd=tmp_path)
    assert took.returncode == 1, took.stderr
    line = _one_line(took.stderr)
    assert BOB in line and "--any-owner" in line
    assert _left(spec) == before and _ssh_sources(spec) == rules

    gone = cli("down", spec.name, cwd=tmp_path)
    assert gone.returncode == 1, gone.stderr
    assert BOB in _one_line(gone.stderr)
    assert _left(spec) == before == {"instances": 2, "vpcs": 1, "security_groups": 1, "roles": 1}

    forced = cli("down", spec.name, "--any-owner", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


# --- 2 and 5: one name in two regions -----------------------------------------------------------


def _fake_terraform_state(spec: ClusterSpec) -> Path:
    """A local Terraform state of `spec` that holds resources (as `up` leaves it), without
    applying anything: what `down` and `up` look for."""
    state_dir = inventory.terraform_state_dir(spec)
    state_dir.mkdir(parents=True)
    (state_dir / "terraform.tfstate").write_text(json.dumps({"resources": [{"type": "aws_vpc"}]}))
    (state_dir / "variables.tfvars.json").write_text(json.dumps({"region": spec.region}))
    return state_dir / "terraform.tfstate"


def test_terraform_state_is_kept_per_region_and_down_in_another_region_is_refused(
    spec, moto_endpoint, tmp_path
):
    """The Terraform state of a cluster in us-east-1 is not the state of the same name in
    us-west-2: `down --region us-west-2` refuses in one line naming us-east-1 and destroys
    nothing (it used to destroy the us-east-1 state, IAM role included)."""
    tf = spec.model_copy(update={"foundation": "terraform", "bucket": "probe-tf-data"})
    west = tf.model_copy(update={"region": "us-west-2"})
    assert inventory.terraform_state_dir(tf) != inventory.terraform_state_dir(west)
    state = _fake_terraform_state(tf)
    held = state.read_text()

    with pytest.raises(records.ClusterNotFound) as info:
        aws_provider.down(west, endpoint_url=moto_endpoint)
    assert "it is in us-east-1" in str(info.value) and "--region us-east-1" in str(info.value)
    gone = cli("down", tf.name, "--region", "us-west-2", cwd=tmp_path)
    assert gone.returncode == 1, gone.stderr
    assert "--region us-east-1" in _one_line(gone.stderr)
    assert state.read_text() == held
    state.unlink()


def test_up_of_a_name_running_in_another_region_is_refused(spec, moto_endpoint, tmp_path):
    """`up NAME --region B` while NAME runs in A (from this machine): refused in one line (exit
    1) before anything is made in B, and A's registry entry stays; `status` and `down` in B
    name A."""
    _up(spec.model_copy(update={"workers": 1}), moto_endpoint)
    _settings_file(spec, tmp_path, instance_types=["g4dn.xlarge"])

    took = cli("up", spec.name, "--region", "us-west-2", "--allowed-cidr", "192.0.2.9/32",
               cwd=tmp_path)  # fmt: skip
    assert took.returncode == 1, took.stderr
    assert "already runs in us-east-1" in _one_line(took.stderr)
    west = boto3.client("ec2", region_name="us-west-2")
    tag = [{"Name": "tag:sparknet:cluster", "Values": [spec.name]}]
    assert west.describe_vpcs(Filters=tag)["Vpcs"] == []
    assert registry.registered()[spec.name].region == REGION
    for command in ("status", "down"):
        done = cli(command, spec.name, "--region", "us-west-2", cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        assert "it is in us-east-1" in _one_line(done.stderr)
    assert _left(spec)["instances"] == 2


def test_status_of_an_unknown_name_names_the_clusters_there(spec, moto_endpoint, tmp_path):
    _up(spec.model_copy(update={"workers": 0}), moto_endpoint)
    done = cli("status", "nope", "--region", REGION, cwd=tmp_path)
    assert done.returncode == 1
    line = _one_line(done.stderr)
    assert "no cluster nope in us-east-1" in line and spec.name in line


# --- 10 and 11: signals during `down` and `up` --------------------------------------------------


def _signal_while_stopped(proc: subprocess.Popen, *signums: int) -> tuple[str, str]:
    """Deliver `signums` to `proc` at one point of its work: moto answers in milliseconds, so
    the process is held with SIGSTOP, the signals queued, and let go with SIGCONT."""
    proc.send_signal(signal.SIGSTOP)
    for signum in signums:
        proc.send_signal(signum)
    proc.send_signal(signal.SIGCONT)
    return proc.communicate(timeout=180)


def test_one_signal_during_down_is_acknowledged_and_down_finishes(spec, moto_endpoint, tmp_path):
    _up(spec, moto_endpoint)
    proc, _ = start_and_wait_for(
        [str(SPARKNET), "cluster", "down", spec.name], tmp_path, "terminating"
    )
    out, err = _signal_while_stopped(proc, signal.SIGTERM)
    assert proc.returncode == 0, err
    assert "to the end so nothing is left half-deleted" in err and f"{spec.name} is down" in out
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_two_signals_stop_down_with_one_line_that_says_how_to_finish(spec, moto_endpoint, tmp_path):
    _up(spec, moto_endpoint)
    proc, _ = start_and_wait_for(
        [str(SPARKNET), "cluster", "down", spec.name], tmp_path, "terminating"
    )
    _, err = _signal_while_stopped(proc, signal.SIGTERM, signal.SIGINT)
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: interrupted; run `sparknet cluster down {spec.name} --region {REGION}` to finish"
    ], err
    assert "Traceback" not in err
    again = cli("down", spec.name, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_ctrl_c_during_up_exits_130_after_removing_what_it_made(spec, moto_endpoint, tmp_path):
    """SIGTERM exits 143 (test_lifecycle); Ctrl-C 130, as a shell reports a process it killed."""
    _settings_file(spec, tmp_path, instance_types=["g4dn.xlarge"], allowed_cidr="203.0.113.9/32")
    proc, _ = start_and_wait_for(
        [str(SPARKNET), "cluster", "up", spec.name], tmp_path, "launching the master"
    )
    _, err = _signal_while_stopped(proc, signal.SIGINT)
    assert proc.returncode == 130, err
    assert "interrupted; everything this `up` created was removed again" in err
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


# --- 7: stopped instances -----------------------------------------------------------------------


def test_a_stopped_master_is_priced_at_its_volume_shown_stopped_and_started_by_up(
    spec, moto_endpoint, tmp_path
):
    """`up` used to wait 900 s for a stopped master to pass status checks; `status` priced it
    as running and did not say it was stopped."""
    info = _up(spec, moto_endpoint)
    ec2 = boto3.client("ec2", region_name=REGION)
    ec2.stop_instances(InstanceIds=[info.master.id])

    stopped = aws_provider.status(spec, endpoint_url=moto_endpoint)
    assert stopped.master.state == "stopped"
    assert stopped.cost.compute == pytest.approx(2 * 0.526)  # the two g4dn.xlarge workers only
    assert stopped.cost.ebs_gib == 3 * 120  # the master's volume still bills
    assert stopped.cost.public_ipv4 == 2
    shown = cli("status", spec.name, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert any(info.master.id in ln and "stopped" in ln for ln in shown.stdout.splitlines())

    again = aws_provider.up(spec, endpoint_url=moto_endpoint, wait_timeout_s=20, wait_delay_s=0.2)
    assert again.master.id == info.master.id and again.master.state == "running"
    assert _left(spec)["instances"] == 3


def test_status_no_ssh_shows_what_aws_says_and_asks_no_node(spec, moto_endpoint, tmp_path):
    """`--no-ssh`: the instances, their SSH addresses and the cost, exit 0, and no line of
    Spark's health or the autostop timer (which only the master, over SSH, can tell: its
    nodes here are moto's and answer nothing, so a plain `status` says they cannot be
    reached)."""
    info = _up(spec, moto_endpoint)
    plain = cli("status", spec.name, cwd=tmp_path)
    assert "Spark: the nodes cannot be reached" in plain.stdout, plain.stdout
    quick = cli("status", spec.name, "--no-ssh", cwd=tmp_path)
    assert quick.returncode == 0, quick.stderr
    assert info.master.id in quick.stdout and "estimated cost $" in quick.stdout
    assert not [ln for ln in quick.stdout.splitlines() if ln.startswith(("Spark", "autostop"))]


# --- 8, 9, 14b, 14c, 14h: what sweep, list and down find and say --------------------------------

#: what moto answers GetCallerIdentity with for its default credentials, as an owner tag
MOTO_USER = "arn:aws:sts::123456789012:user/moto"


def _foundation_tags(name: str) -> list[dict[str, str]]:
    return [
        {"Key": "sparknet:cluster", "Value": name},
        {"Key": "sparknet:role", "Value": "foundation"},
        {"Key": TAG_OWNER, "Value": MOTO_USER},
    ]


def _tagged_vpc(name: str) -> str:
    """A VPC tagged as cluster `name`'s foundation, made by the caller."""
    ec2 = boto3.client("ec2", region_name=REGION)
    return ec2.create_vpc(
        CidrBlock="10.77.0.0/16",
        TagSpecifications=[{"ResourceType": "vpc", "Tags": _foundation_tags(name)}],
    )["Vpc"]["VpcId"]


def _vpc_exists(vpc: str) -> bool:
    ec2 = boto3.client("ec2", region_name=REGION)
    return bool(ec2.describe_vpcs(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Vpcs"])


def test_sweep_goes_past_a_name_sparknet_no_longer_accepts_and_says_what_it_deleted(
    spec, moto_endpoint, tmp_path
):
    """An orphan tagged `Old_...` (not a valid name today) sorts first: sweep used to stop there
    with "invalid setting name" and never reach the next one. Both go, and for each the
    terminated instances, the deleted resources and the cost are printed."""
    old = f"Old_{spec.name}"
    vpc = _tagged_vpc(old)
    info = _up(spec.model_copy(update={"workers": 1}), moto_endpoint)
    for path in registry.registry_dir().glob("*.json"):
        path.unlink()

    swept = cli("sweep", "--region", REGION, "--yes", cwd=tmp_path)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    lines = swept.stdout.splitlines()
    assert f"took {old} down" in lines and f"took {spec.name} down" in lines
    assert f"deleted vpc:{vpc}" in lines and not _vpc_exists(vpc)
    assert {f"terminated instance:{i.id}" for i in info.instances} <= set(lines)
    assert any(ln.startswith(f"{spec.name}: its instances") and "$" in ln for ln in lines)
    assert any(ln.startswith(f"{spec.name}: ") and "deleted vpc:" for ln in lines)
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}


def test_down_of_a_tagged_name_sparknet_no_longer_accepts(moto_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    old = f"Old_Cluster_{os.getpid()}"
    vpc = _tagged_vpc(old)
    gone = cli("down", old, "--region", REGION, cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert f"deleted vpc:{vpc}" in gone.stdout and not _vpc_exists(vpc)
    assert f"{old}: no instances were running" in gone.stdout


def test_list_and_down_find_a_cluster_left_with_only_an_endpoint_or_a_profile(
    moto_endpoint, tmp_path, monkeypatch
):
    """A cluster whose only remains are its S3 gateway endpoint, or an instance profile whose
    role is gone: `list` shows it and `down` removes it (it used to say "no cluster")."""
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    ec2 = boto3.client("ec2", region_name=REGION)
    iam = boto3.client("iam", region_name=REGION)
    tag = f"e{os.getpid()}"
    vpc = ec2.create_vpc(CidrBlock="10.78.0.0/16")["Vpc"]["VpcId"]
    endpoint = ec2.create_vpc_endpoint(
        VpcId=vpc, ServiceName=f"com.amazonaws.{REGION}.s3", VpcEndpointType="Gateway",
        TagSpecifications=[{"ResourceType": "vpc-endpoint", "Tags": _foundation_tags(tag)}],
    )["VpcEndpoint"]["VpcEndpointId"]  # fmt: skip
    profile_only = f"p{os.getpid()}"
    profile = f"sparknet-{profile_only}-{REGION}"
    iam.create_instance_profile(InstanceProfileName=profile, Tags=_foundation_tags(profile_only))

    listed = cli("list", "--region", REGION, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {ln.split("\t")[0]: ln for ln in listed.stdout.splitlines()}
    assert tag in rows and profile_only in rows
    assert f"owner {MOTO_USER}" in rows[profile_only]

    gone = cli("down", tag, "--region", REGION, cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert f"deleted vpc-endpoint:{endpoint}" in gone.stdout
    gone = cli("down", profile_only, "--region", REGION, cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert f"deleted instance-profile:{profile}" in gone.stdout
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_instance_profile(InstanceProfileName=profile)
    found = inventory.tagged_clusters(REGION, endpoint_url=moto_endpoint)
    assert tag not in found and profile_only not in found
    ec2.delete_vpc(VpcId=vpc)


def test_list_shows_only_the_regions_clusters(spec, moto_endpoint, tmp_path):
    """A cluster registered here in us-west-2 is not one of us-east-1's ("0 instances ...
    registered")."""
    registry.save_entry(spec.model_copy(update={"region": "us-west-2"}), moto_endpoint)
    listed = cli("list", "--region", REGION, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert spec.name not in listed.stdout
    west = cli("list", "--region", "us-west-2", cwd=tmp_path)
    assert f"{spec.name}\t0 instances" in west.stdout and "\tregistered" in west.stdout
    for path in registry.registry_dir().glob("*.json"):
        path.unlink()


def test_down_in_an_unpriced_region_says_why_the_cost_is_unknown(spec, moto_endpoint, tmp_path):
    """prices.json holds us-east-1 only: elsewhere the cost is unknown, and says so (it used to
    read "cost about unknown")."""
    ami = amazon_ami("us-west-2")
    there = spec.model_copy(update={"region": "us-west-2", "ami": ami, "workers": 0})
    _up(there, moto_endpoint)
    gone = cli("down", spec.name, "--region", "us-west-2", cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert (
        f"{spec.name}: its instances (with their volumes and public addresses) cost an "
        "unknown amount (no price for us-west-2" in gone.stdout
    )
    assert "about unknown" not in gone.stdout


# --- 12: the free checks come before anything is made --------------------------------------------


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"availability_zones": ["us-east-1zz"]}, "us-east-1zz is not an AZ of us-east-1"),
        ({"availability_zones": ["eu-west-1a"]}, "eu-west-1a is not an AZ of us-east-1"),
        (
            {"key_name": "no-such-key", "key_file": "~/.ssh/no-such-key.pem"},
            "key pair 'no-such-key' does not exist in us-east-1",
        ),
    ],
)
def test_wrong_zones_or_key_pair_are_one_short_line_before_anything_is_made(
    spec, tmp_path, entry, says
):
    _settings_file(spec, tmp_path, instance_types=["g4dn.xlarge"], **entry)
    done = cli("up", spec.name, "--allowed-cidr", "203.0.113.9/32", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr)
    assert says in line and len(line) < 300, line
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
    assert not registry.registry_dir().exists() or not list(registry.registry_dir().iterdir())


# --- 4: `up` with fewer workers ------------------------------------------------------------------


def test_up_with_fewer_workers_terminates_the_newest_surplus(spec, moto_endpoint, tmp_path):
    first = _up(spec.model_copy(update={"workers": 1}), moto_endpoint)
    time.sleep(1.1)  # the later workers are newer by their LaunchTime (whole seconds)
    grown = _up(spec.model_copy(update={"workers": 3}), moto_endpoint)
    assert len(grown.workers) == 3
    _settings_file(spec, tmp_path, instance_types=["g4dn.xlarge"], allowed_cidr="203.0.113.9/32")

    done = cli("up", spec.name, "--workers", "1", "--no-bootstrap", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "terminating 2 surplus workers (newest first)" in done.stderr
    now = aws_provider.status(spec, endpoint_url=moto_endpoint)
    assert [w.id for w in now.workers] == [w.id for w in first.workers]
    assert now.master.id == first.master.id
    assert registry.registered()[spec.name].workers == 1


def test_sweep_goes_past_a_cluster_whose_down_fails_with_any_error(
    spec, moto_endpoint, tmp_path, monkeypatch
):
    """An AWS answer botocore cannot parse (moto's 500 on a malformed endpoint) raised past
    sweep's loop and left the orphans after it standing. Here `down` of the first orphan
    fails with such an error (stood in for: moto gives it only for resources sparknet never
    makes); the second still goes, and the sweep exits 1 naming the failure. In-process, so
    the stand-in reaches the command."""
    from botocore.parsers import ResponseParserError
    from typer.testing import CliRunner

    from sparknet.cli import app

    broken = f"a{spec.name}"
    vpc = _tagged_vpc(broken)
    _up(spec.model_copy(update={"workers": 0}), moto_endpoint)
    for path in registry.registry_dir().glob("*.json"):
        path.unlink()
    real_down = aws_provider.down

    def down(spec, **kw):
        if spec.name == broken:
            raise ResponseParserError("Unable to parse response, invalid XML received")
        return real_down(spec, **kw)

    monkeypatch.setattr(aws_provider, "down", down)
    monkeypatch.chdir(tmp_path)
    swept = CliRunner().invoke(app, ["cluster", "sweep", "--region", REGION, "--yes"])
    lines = swept.stdout.splitlines()
    assert swept.exit_code == 1, swept.stdout
    assert any(ln.startswith(f"failed {broken}: Unable to parse response") for ln in lines)
    assert f"took {spec.name} down" in lines
    assert _left(spec) == {"instances": 0, "vpcs": 0, "security_groups": 0, "roles": 0}
    boto3.client("ec2", region_name=REGION).delete_vpc(VpcId=vpc)  # the one left on purpose
