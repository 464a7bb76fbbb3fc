"""The autostop timer's check against moto's server, run as on the master: the real
`python -m sparknet.cluster.aws.autostop check` as a subprocess over a state dir, with the
default credential chain and AWS_ENDPOINT_URL pointing at moto (on a node: the instance
role's credentials and AWS's endpoint). Idleness is made by setting mtimes, not by waiting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sparknet.cluster.aws import autostop
from sparknet.cluster.aws.autostop import Settings
from sparknet.cluster.spec import TAG_CLUSTER, TAG_ROLE
from tests.moto_server import amazon_ami

pytestmark = pytest.mark.integration

REGION = "us-east-1"


def _ec2():
    import boto3

    return boto3.client("ec2", region_name=REGION)


def launch(ec2, cluster: str, role: str, count: int = 1) -> list[str]:
    ami = amazon_ami(REGION)
    tags = [{"Key": TAG_CLUSTER, "Value": cluster}, {"Key": TAG_ROLE, "Value": role}]
    made = ec2.run_instances(
        ImageId=ami, InstanceType="t3.micro", MinCount=count, MaxCount=count,
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
    )  # fmt: skip
    return [i["InstanceId"] for i in made["Instances"]]


def states(ec2, ids: list[str]) -> dict[str, str]:
    found = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    return {i["InstanceId"]: i["State"]["Name"] for r in found for i in r["Instances"]}


def state_dir(tmp_path: Path, cluster: str, idle_s: float) -> Path:
    """A 1-minute timer's state dir whose newest activity was `idle_s` ago."""
    d = tmp_path / "autostop"
    (d / autostop.ACTIVITY).mkdir(parents=True)
    (d / autostop.SETTINGS).write_text(Settings(cluster, REGION, 1).to_json())
    then = time.time() - idle_s
    for path in (d / autostop.STARTED, d / autostop.ACTIVITY / "job-r1"):
        path.touch()
    for path in (d / autostop.STARTED, d / autostop.ACTIVITY / "job-r1", d / autostop.ACTIVITY):
        os.utime(path, (then - 3600, then - 3600))
    os.utime(d / autostop.ACTIVITY / "job-r1", (then, then))
    return d


def check(d: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sparknet.cluster.aws.autostop", "check", "--state", str(d)],
        env=os.environ.copy(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_past_its_deadline_the_check_terminates_its_cluster_only(moto_endpoint, tmp_path) -> None:
    ec2 = _ec2()
    name, other = f"a{uuid.uuid4().hex[:8]}", f"o{uuid.uuid4().hex[:8]}"
    ours = launch(ec2, name, "master") + launch(ec2, name, "worker", 2)
    ec2.stop_instances(InstanceIds=ours[2:])  # a stopped node costs its disk: it goes too
    theirs = launch(ec2, other, "master")
    d = state_dir(tmp_path, name, idle_s=90)

    done = check(d)
    assert done.returncode == 0, done.stderr
    assert set(states(ec2, ours).values()) <= {"shutting-down", "terminated"}
    assert states(ec2, theirs) == {theirs[0]: "running"}
    written = json.loads((d / autostop.DEADLINE).read_text())
    assert written["action"] == "terminate"
    assert abs(written["deadline"] - (time.time() - 30)) < 20
    line = (d / autostop.LOG).read_text().splitlines()[-1]
    assert line.split(" ", 2)[1] == "terminate:"
    said = line.split("; terminated ", 1)[1]
    assert said.endswith(f" of cluster {name} in {REGION}")
    assert sorted(said.split(" of cluster ")[0].split()) == sorted(ours)


def test_activity_within_the_minute_terminates_nothing(moto_endpoint, tmp_path) -> None:
    ec2 = _ec2()
    name = f"a{uuid.uuid4().hex[:8]}"
    ours = launch(ec2, name, "master")
    d = state_dir(tmp_path, name, idle_s=20)

    done = check(d)
    assert done.returncode == 0, done.stderr
    assert states(ec2, ours) == {ours[0]: "running"}
    written = json.loads((d / autostop.DEADLINE).read_text())
    assert written["action"] == "wait"
    assert abs(written["deadline"] - (time.time() + 40)) < 20
    assert autostop.status_line(json.dumps(written), time.time()).startswith("autostop: in 1 min (")
    assert (d / autostop.LOG).read_text().splitlines()[-1].split(" ", 2)[1] == "wait:"


def test_an_unreachable_aws_is_one_log_line_and_exit_1(moto_endpoint, tmp_path) -> None:
    """AWS that does not answer (a dead endpoint): logged in one line, nothing raised; the
    loop's next check retries."""
    name = f"a{uuid.uuid4().hex[:8]}"
    d = state_dir(tmp_path, name, idle_s=90)
    env = {**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    done = subprocess.run(
        [sys.executable, "-m", "sparknet.cluster.aws.autostop", "check", "--state", str(d)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = (d / autostop.LOG).read_text().splitlines()
    assert len(lines) == 1
    assert "failed: cannot reach AWS at http://127.0.0.1:9" in lines[0]
    assert lines[0].endswith("retrying at the next check")
