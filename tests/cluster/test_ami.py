"""The AMI bake on moto: the builder instance is mapped to a loopback sshd node through the seam
of node_endpoints.py (`moto_nodes`, host key read back from the builder's user data), so the key
pair, the pinned host key and the install steps run over real SSH; moto's CreateImage is available
at once.

The node installs over the repo's .venv (`--python-env`, as a node over the Deep Learning AMI's
PyTorch env), into its own prefix. The clean-up runs against a fake root directory (`root=`),
not against the machine the tests run on: removing this machine's host keys and logs is not a
test. The failing bake goes through the CLI (in this process: the builder's name is fixed by
monkeypatch so `moto_nodes` can serve it before it launches).
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import uuid
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import boto3
import pytest
from typer.testing import CliRunner

from sparknet.cluster import ami, registry
from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster.address import Endpoint
from sparknet.cluster.aws import images
from sparknet.cluster.spark import bootstrap
from sparknet.cluster.spark.plan import Context, Node, Plan, node_facts
from sparknet.cluster.spark.wheel import Wheel, build_wheel
from sparknet.cluster.spec import TAG_CLUSTER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError
from tests.moto_server import amazon_ami

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
REGION = "us-east-1"


@dataclass(frozen=True)
class Bake:
    ec2: Any
    base: str
    #: the builder's cluster name
    name: str

    @property
    def parameter(self) -> str:
        """Where this test's bake records its AMI id."""
        return f"/test/sparknet/{self.name}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Wheel:
    """The sparknet wheel of this checkout, built once for the module."""
    return build_wheel(REPO, tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def moto_tags_snapshots(moto_endpoint, monkeypatch):
    """moto 5.2 answers CreateImage's `snapshot` TagSpecifications with NotImplementedError (a
    500), where AWS tags the image's new snapshots with them: taught to the moto server (it runs
    in this process) for the test, the snapshot tagged as AWS does. Everything else is moto's."""
    from moto.ec2.models import amis

    original = amis.AmiBackend.create_image

    def create_image(self, instance_id, name, description, tag_specifications):
        def of(kind: str) -> list[dict]:
            return [s for s in tag_specifications if s["ResourceType"] == kind]

        image = original(self, instance_id, name, description, of("image"))
        for tag in (t for s in of("snapshot") for t in s["Tags"]):
            image.ebs_snapshot.add_tag(tag["Key"], tag["Value"])
        return image

    monkeypatch.setattr(amis.AmiBackend, "create_image", create_image)


@pytest.fixture
def moto_bake(moto_endpoint, moto_nodes, moto_tags_snapshots, tmp_path, monkeypatch):
    """The bake's registry under tmp_path, its builder's name fixed and served by a loopback
    sshd while the block runs."""
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    name = f"bake-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(ami, "bake_name", lambda: name)
    ec2 = boto3.client("ec2", region_name=REGION)
    base = amazon_ami(REGION)
    with moto_nodes(name).watch(ec2):
        yield Bake(ec2, base, name)


def settings(bake: Bake, prefix: Path, endpoint: str) -> ami.BakeSettings:
    return ami.BakeSettings(
        region=REGION, base_ami=bake.base, instance_type="m5.large", root_volume_gb=120,
        allowed_cidr="203.0.113.9/32", python_env=str(REPO / ".venv"), prefix=str(prefix),
        record_parameter=bake.parameter, endpoint_url=endpoint,
    )  # fmt: skip


#: planted in root's home and a user's
IN_HOMES = (".aws/credentials", ".ssh/id_ed25519", ".cache/huggingface/token",
            ".cache/torch/kernels/k", ".python_history", ".viminfo")  # fmt: skip
#: what the clean-up must remove from the builder's root: keys, credentials, caches,
#: histories, logs, temporary files and per-machine state (issue 23 found the ones after
#: "apt log" surviving)
GONE = {
    "host key": "etc/ssh/ssh_host_ed25519_key",
    "login key": "home/ubuntu/.ssh/authorized_keys",
    "history": "root/.bash_history",
    "log": "var/log/syslog",
    "apt log": "var/log/apt/history.log",
    "cloud-init state": "var/lib/cloud/instances/i-0123/sem/config_ssh",
    **{f"{home} {rel}": f"{home}/{rel}" for home in ("root", "home/ubuntu") for rel in IN_HOMES},
    "tmp": "tmp/build-1/x",
    "tmp dotfile": "tmp/.lock",
    "var tmp": "var/tmp/y",
    "random seed": "var/lib/systemd/random-seed",
    "systemd credential secret": "var/lib/systemd/credential.secret",
}
#: what it must keep
KEPT = {
    "cloud-init seed": "var/lib/cloud/seed/nocloud/user-data",
    "ssh config": "etc/ssh/sshd_config",
}
#: the install prefix's own state, removed
PREFIX_GONE = ("work/app-1/0/stderr", "autostop/deadline", "autostop/autostop.log")


def fake_root(root: Path) -> dict[str, Path]:
    """A directory laid out like the builder's /, with what the clean-up must remove or keep."""
    out = {}
    for what, rel in {**GONE, **KEPT}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(what)
        out[what] = path
    return out


def torch_cuda() -> str | None:
    """`torch.version.cuda` of the repo's torch, read without importing torch (seconds)."""
    import importlib.util

    path = importlib.metadata.distribution("torch").locate_file("torch/version.py")
    spec = importlib.util.spec_from_file_location("torch_version_only", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cuda


def builder_states(ec2, name: str) -> list[str]:
    found = ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]}])
    return [i["State"]["Name"] for r in found["Reservations"] for i in r["Instances"]]


def assert_builder_gone(bake: Bake) -> None:
    """The builder is terminated, and its key pair, network and local key removed."""
    ec2, name = bake.ec2, bake.name
    assert builder_states(ec2, name) == ["terminated"]
    by_tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]}]
    assert ec2.describe_key_pairs(Filters=by_tag)["KeyPairs"] == []
    assert ec2.describe_security_groups(Filters=by_tag)["SecurityGroups"] == []
    assert ec2.describe_vpcs(Filters=by_tag)["Vpcs"] == []
    assert not (registry.registry_dir() / name / "id_ed25519").exists()


def test_bake_makes_a_tagged_image_with_the_steps_done_and_removes_the_builder(
    moto_bake, moto_endpoint, wheel, tmp_path
):
    ec2, base = moto_bake.ec2, moto_bake.base
    prefix = tmp_path / "prefix"
    root = fake_root(tmp_path / "root")
    for rel in PREFIX_GONE:  # as a cluster's run would leave them
        (prefix / rel).parent.mkdir(parents=True, exist_ok=True)
        (prefix / rel).write_text(rel)
    baked = ami.bake(
        settings(moto_bake, prefix, moto_endpoint), wheel=wheel, root=str(tmp_path / "root"),
        delay_s=0.2,
    )  # fmt: skip

    image = ec2.describe_images(ImageIds=[baked.image_id])["Images"][0]
    assert image["State"] == "available"
    tags = {t["Key"]: t["Value"] for t in image["Tags"]}
    assert tags[TAG_ROLE] == "ami"
    assert tags["sparknet:source-ami"] == base
    assert tags["sparknet:spark"] == importlib.metadata.version("pyspark")
    assert tags["sparknet:torch"] == importlib.metadata.version("torch")
    assert tags["sparknet:cuda"] == (torch_cuda() or "none")
    assert tags["sparknet:version"] == wheel.version
    (snapshot,) = [m["Ebs"]["SnapshotId"] for m in image["BlockDeviceMappings"]]
    assert tags_of(ec2.describe_snapshots(SnapshotIds=[snapshot])["Snapshots"][0]) == tags
    # recorded: what `cluster up` launches (ami_for) is the baked image
    ssm = boto3.client("ssm", region_name=REGION)
    assert ssm.get_parameter(Name=moto_bake.parameter)["Parameter"]["Value"] == baked.image_id
    assert images.baked_ami(ec2, ssm, moto_bake.parameter) == baked.image_id
    assert images.ami_for(ClusterSpec(name="c1"), ec2, ssm, moto_bake.parameter) == baked.image_id
    own = ClusterSpec(name="c1", ami=moto_bake.base)  # the spec's own AMI comes first
    assert images.ami_for(own, ec2, ssm, moto_bake.parameter) == moto_bake.base
    assert_builder_gone(moto_bake)

    # the clean-up: keys, credentials, caches, histories, logs, temporary files and state gone;
    # dirs and the rest kept
    assert [what for what in GONE if root[what].exists()] == []
    assert root["apt log"].parent.is_dir() and list((tmp_path / "root/tmp").iterdir()) == []
    assert root["cloud-init seed"].exists() and root["ssh config"].exists()
    assert list((prefix / "dist").iterdir()) == []
    assert [rel for rel in PREFIX_GONE if (prefix / rel).exists()] == []

    # a node from the image finds every step of the image done: `cluster up` skips them
    import invoke

    node = Node(Endpoint("master", "127.0.0.1"), prefix=str(prefix))
    conn = invoke.Context()  # in tmp_path: python -c finds no sparknet in the cwd there
    facts = node_facts(conn, node.prefix)
    plan = Plan((node,), wheel, "", python_env=str(REPO / ".venv"))
    ctx = Context(plan, node, facts)
    steps = [cls(ctx) for cls in ami.load_image().steps]
    with conn.cd(str(tmp_path)):
        report = bootstrap.run_steps("master", steps, conn)
    assert report.applied == () and len(report.skipped) == len(steps)


def test_a_failing_step_leaves_no_builder_and_no_image(
    moto_bake, moto_endpoint, wheel, tmp_path, monkeypatch
):
    from sparknet.cli import app

    ec2 = moto_bake.ec2
    # the module's wheel, not a second build of the same checkout (the one stand-in here)
    monkeypatch.setattr(ami, "build_wheel", lambda _checkout, _out: wheel)
    blocker = tmp_path / "a-file"
    blocker.write_text("the prefix cannot be made under a file")
    args = cli_args(moto_bake, blocker / "prefix", moto_endpoint)
    result = CliRunner().invoke(app, args)

    assert result.exit_code == 1, result.output  # a failed step: not bad input
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: bake failed on the builder i-")
    assert "step dirs failed (exited 1)" in lines[-1]
    assert_builder_gone(moto_bake)
    ours = ec2.describe_images(
        Owners=["self"], Filters=[{"Name": "tag:sparknet:builder", "Values": [moto_bake.name]}]
    )["Images"]
    assert ours == []
    ssm = boto3.client("ssm", region_name=REGION)
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name=moto_bake.parameter)


def test_the_bake_gives_the_builder_the_package_index_it_is_told(
    moto_bake, moto_endpoint, wheel, tmp_path, monkeypatch
):
    """`--package-index node` reaches the builder's plan (its pip then uses the builder's own
    configuration, a company mirror): the install is replaced by one that records the plan and
    fails, so the bake ends there and removes the builder."""
    from sparknet.cli import app

    monkeypatch.setattr(ami, "build_wheel", lambda _checkout, _out: wheel)
    seen: list[Plan] = []

    def install(plan: Plan, *_args: Any) -> None:
        seen.append(plan)
        raise SparknetError("stopped once the plan was seen")

    monkeypatch.setattr(ami, "_install", install)
    args = [*cli_args(moto_bake, tmp_path / "prefix", moto_endpoint), "--package-index", "node"]
    result = CliRunner().invoke(app, args)

    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1].endswith("stopped once the plan was seen")
    assert [p.package_index for p in seen] == ["node"]
    assert_builder_gone(moto_bake)


def test_a_bake_given_a_plain_http_index_exits_2_before_anything_is_made(tmp_path):
    from sparknet.cli import app

    url = "http://pypi.corp.example/simple"
    result = CliRunner().invoke(
        app, ["ami", "bake", "--base-ami", "ami-0123456789abcdef0", "--package-index", url]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: --package-index: a plain http:// index is refused (packages over plain http can "
        "be replaced in transit, and pip ignores such an index): serve the mirror over https://, "
        f"or set package_index: node and trust it in the nodes' own pip.conf (got '{url}')"
    ]


def no_steps(tmp_path: Path) -> dict[str, Any]:
    """`bake`'s arguments for a quick bake with no install steps: a venv whose python runs the
    repo's stands in ``tmp_path/prefix`` for one the steps made; nothing to clean; the clean-up
    under ``tmp_path/root``."""
    python = tmp_path / "prefix" / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {REPO / ".venv" / "bin" / "python"} "$@"\n')
    python.chmod(0o755)
    return {
        "image": ami.Image((), (), ()),
        "wheel": Wheel(tmp_path / "unused.whl", "0.0.0", "unused"),
        "root": str(tmp_path / "root"),
        "delay_s": 0.2,
    }


def cli_args(bake: Bake, prefix: Path, endpoint: str) -> list[str]:
    """`sparknet ami bake`'s arguments for `bake` (as `settings` gives them to `ami.bake`)."""
    return [
        "ami", "bake", "--region", REGION, "--base-ami", bake.base, "--instance-type", "m5.large",
        "--root-volume-gb", "120", "--allowed-cidr", "203.0.113.9/32",
        "--python-env", str(REPO / ".venv"), "--prefix", str(prefix),
        "--record-parameter", bake.parameter, "--endpoint-url", endpoint,
    ]  # fmt: skip


def test_a_bake_whose_final_clean_up_fails_prints_its_image_and_what_is_left(
    moto_bake, moto_endpoint, tmp_path, monkeypatch
):
    from sparknet.cli import app
    from sparknet.cluster.aws import instances

    ec2 = moto_bake.ec2
    real_terminate = instances.terminate
    calls = []

    def terminate_fails_once(*args, **kwargs):
        """A mock at this one call: moto cannot be made to refuse a TerminateInstances."""
        calls.append(args)
        if len(calls) == 1:
            raise SparknetError("TerminateInstances in us-east-1 failed: RequestLimitExceeded")
        return real_terminate(*args, **kwargs)

    monkeypatch.setattr(instances, "terminate", terminate_fails_once)
    monkeypatch.setattr(ami, "bake", partial(ami.bake, **no_steps(tmp_path)))
    result = CliRunner().invoke(app, cli_args(moto_bake, tmp_path / "prefix", moto_endpoint))

    assert result.exit_code == 1, result.output
    # the image is made, recorded and printed
    (baked,) = [ln.split()[1] for ln in result.stdout.splitlines() if ln.startswith("baked ")]
    assert ec2.describe_images(ImageIds=[baked])["Images"][0]["State"] == "available"
    ssm = boto3.client("ssm", region_name=REGION)
    assert ssm.get_parameter(Name=moto_bake.parameter)["Parameter"]["Value"] == baked
    # one line: what is left (the builder, and what could not go while it runs) and what ends it
    last = result.stderr.strip().splitlines()[-1]
    found = ec2.describe_instances(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [moto_bake.name]}]
    )
    (builder,) = [i["InstanceId"] for r in found["Reservations"] for i in r["Instances"]]
    assert last.startswith(f"error: the bake left the builder {builder} (TerminateInstances ")
    # the command carries the endpoint the bake was given: followed as it is, it reaches it
    finish = (
        f"sparknet cluster down {moto_bake.name} --region {REGION} --endpoint-url {moto_endpoint}"
    )
    assert last.endswith(f"`{finish}` removes the rest")
    assert builder_states(ec2, moto_bake.name) != ["terminated"]
    # and that command ends it, the image kept
    down = CliRunner().invoke(app, finish.split()[1:])
    assert down.exit_code == 0, down.output
    assert_builder_gone(moto_bake)
    assert ec2.describe_images(ImageIds=[baked])["Images"][0]["State"] == "available"


def test_a_key_left_where_the_clean_up_does_not_look_fails_the_bake_and_leaves_nothing(
    moto_bake, moto_endpoint, tmp_path, monkeypatch
):
    """The image's own clean-up and scan (no install steps) over a fake root where a PEM private
    key lies in /opt: the bake fails in one line naming it, before any image is made."""
    from sparknet.cli import app

    key = tmp_path / "root/opt/x/key.pem"
    key.parent.mkdir(parents=True)
    key.write_text("-----BEGIN " + "RSA PRIVATE KEY-----\nnotakey\n-----END RSA PRIVATE KEY-----\n")
    quick = {**no_steps(tmp_path), "image": replace(ami.load_image(), steps=())}
    monkeypatch.setattr(ami, "bake", partial(ami.bake, **quick))
    result = CliRunner().invoke(app, cli_args(moto_bake, tmp_path / "prefix", moto_endpoint))

    assert result.exit_code == 1, result.output
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert result.stderr.strip().splitlines()[-1] == line
    assert line.startswith("error: bake refused: after the clean-up the builder i-")
    assert "still holds what looks like a credential or private key: /opt/x/key.pem (a PEM " in line
    assert_builder_gone(moto_bake)
    ours = moto_bake.ec2.describe_images(
        Owners=["self"], Filters=[{"Name": "tag:sparknet:builder", "Values": [moto_bake.name]}]
    )["Images"]
    assert ours == []
    ssm = boto3.client("ssm", region_name=REGION)
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name=moto_bake.parameter)


def tags_of(resource: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def test_ctrl_c_after_create_image_leaves_image_and_snapshots_tagged_and_removes_both(
    moto_bake, moto_endpoint, tmp_path
):
    ec2 = moto_bake.ec2
    made: list[str] = []
    left: dict[str, dict[str, str]] = {}  # what a crash at this moment would leave: its tags

    def say(line: str) -> None:
        if line.startswith("creating image "):
            made.append(line.split()[2])
            image = ec2.describe_images(ImageIds=made)["Images"][0]
            left[made[0]] = tags_of(image)
            for m in image["BlockDeviceMappings"]:
                snapshot = m["Ebs"]["SnapshotId"]
                found = ec2.describe_snapshots(SnapshotIds=[snapshot])["Snapshots"][0]
                left[snapshot] = tags_of(found)
            raise KeyboardInterrupt  # as the CLI's handler raises on Ctrl-C

    with pytest.raises(KeyboardInterrupt):
        ami.bake(
            settings(moto_bake, tmp_path / "prefix", moto_endpoint), say=say,
            **no_steps(tmp_path),
        )  # fmt: skip

    # the image and its snapshot carried the bake's tags from CreateImage on
    assert len(left) == 2, left
    image_tags = left[made[0]]
    assert image_tags[TAG_ROLE] == "ami" and image_tags["sparknet:builder"] == moto_bake.name
    assert all(tags == image_tags for tags in left.values())
    # the clean-up removed both: the image deregistered, its snapshot deleted
    assert ec2.describe_images(ImageIds=made)["Images"] == []
    snapshots = [r for r in left if r.startswith("snap-")]
    by_id = ec2.describe_snapshots(Filters=[{"Name": "snapshot-id", "Values": snapshots}])
    assert by_id["Snapshots"] == []
    assert_builder_gone(moto_bake)


def bake_cli(*args: str, env: dict[str, str]) -> subprocess.Popen:
    """`sparknet ami bake ARGS` as a user runs it: its own process, stderr piped."""
    from tests.conftest import SPARKNET

    return subprocess.Popen(
        [str(SPARKNET), "ami", "bake", "--region", REGION, "--instance-type", "m5.large",
         "--root-volume-gb", "120", "--allowed-cidr", "203.0.113.9/32", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_cli_bake_exits_2_for_bad_input_and_1_for_an_aws_failure(moto_endpoint, tmp_path):
    from tests.sshd import free_port

    env = {**os.environ, registry.HOME_ENV: str(tmp_path / "home")}
    missing = bake_cli("--base-ami", "ami-0123456789abcdef0", "--endpoint-url", moto_endpoint,
                       env=env)  # fmt: skip
    _, err = missing.communicate(timeout=120)
    assert missing.returncode == 2, err
    assert err.strip().splitlines() == [
        "error: AMI ami-0123456789abcdef0 does not exist in us-east-1 (or is not shared with you)"
    ]
    # nothing listens there: AWS cannot be reached, which no option of the bake's fixes
    nowhere = f"http://127.0.0.1:{free_port()}"
    unreachable = bake_cli("--base-ami", "ami-0123456789abcdef0", "--endpoint-url", nowhere,
                           env=env)  # fmt: skip
    _, err = unreachable.communicate(timeout=120)
    assert unreachable.returncode == 1, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: cannot reach AWS at {nowhere} ")


def test_cli_bake_stopped_by_sigterm_exits_143_and_removes_what_it_made(
    moto_endpoint, moto_nodes, tmp_path
):
    """SIGTERM once the builder's network is being made; its node is mapped to a port where
    nothing listens, so a bake that got further would still reach nothing off this machine."""
    home = tmp_path / "home"
    ec2 = boto3.client("ec2", region_name=REGION)
    base = amazon_ami(REGION)
    env = {**os.environ, registry.HOME_ENV: str(home)}
    proc = bake_cli("--base-ami", base, "--endpoint-url", moto_endpoint, env=env)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("builder bake-"):  # "builder NAME: network and key pair"
                name = line.split()[1].rstrip(":")
                moto_nodes(name)  # the seam: NAME's master at a loopback port, no sshd there
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, "".join(lines) + rest
    assert rest.strip().splitlines()[-1].startswith("error: interrupted")
    by_tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]}]
    assert builder_states(ec2, name) in ([], ["terminated"])
    assert ec2.describe_vpcs(Filters=by_tag)["Vpcs"] == []
    assert ec2.describe_key_pairs(Filters=by_tag)["KeyPairs"] == []


def test_cluster_up_launches_the_recorded_baked_ami(moto_endpoint, tmp_path, monkeypatch):
    """`up` with the default ami_parameter launches the AMI the bake recorded (no bake here:
    its SSM record is written by hand), in a region no other test uses, so the record is this
    test's alone."""
    region = "ca-central-1"
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    ec2 = boto3.client("ec2", region_name=region)
    baked = amazon_ami(region, 1)
    images.record(boto3.client("ssm", region_name=region), baked)
    spec = ClusterSpec(
        name=f"b{uuid.uuid4().hex[:8]}", region=region, workers=0, master_type="m5.large",
        instance_types=["m5.large"], allowed_cidr="203.0.113.9/32", root_volume_gb=120,
    )  # fmt: skip
    try:
        aws_provider.up(spec, endpoint_url=moto_endpoint, wait_timeout_s=60, wait_delay_s=0.2)
        found = ec2.describe_instances(
            Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]}]
        )["Reservations"]
        assert [i["ImageId"] for r in found for i in r["Instances"]] == [baked]
    finally:
        aws_provider.down(spec, endpoint_url=moto_endpoint)
