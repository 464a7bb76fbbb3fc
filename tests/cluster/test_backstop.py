"""The backstop on moto with loopback nodes: every instance `cluster up` launches powers itself
off `backstop_minutes` after it boots, and so terminates, unless a bootstrap got as far as the
master's autostop timer, which replaces it (that a finished `up` cancels every node's backstop is
checked on test_cluster_bootstrap.py's cluster).

The nodes are tests/sshd.py's MotoNodes: each node's first serve boots it from the user data
moto holds (its per-boot scripts run as cloud-init's `scripts_per_boot` runs them, with a
stand-in `shutdown` that records instead of acting on this machine), and `end_due` does what EC2
does when the power-off comes due, by the instance's InstanceInitiatedShutdownBehavior as moto
holds it. The clock is advanced (`skew`) instead of waited on: the backstop's default hour is
what the test runs under."""

from __future__ import annotations

import signal

import pytest

from sparknet.cluster.aws import keys
from tests.cluster.moto_clusters import loopback_cluster, moto_ec2, up_signalled_at_bootstrap
from tests.cluster.test_userdata import schema_errors

pytestmark = pytest.mark.integration

AMI_PARAMETER = "/test/sparknet/backstop-ami"


@pytest.fixture
def cluster(moto_endpoint, moto_nodes, tmp_path, monkeypatch):
    """A cluster of a master and one worker in ./sparknet.yaml (cwd tmp_path), its registry
    under tmp_path, its nodes loopback sshd nodes with their own addresses and prefixes; taken
    down at the end."""
    with loopback_cluster(
        moto_nodes, tmp_path, monkeypatch, prefix="s", ami_parameter=AMI_PARAMETER
    ) as (name, group, _entry):
        yield name, group


def states(name: str) -> dict[str, str]:
    """The cluster's instances in moto (by tag, whatever their state): id -> state."""
    found = moto_ec2().describe_instances(
        Filters=[{"Name": "tag:sparknet:cluster", "Values": [name]}]
    )
    return {
        i["InstanceId"]: i["State"]["Name"] for r in found["Reservations"] for i in r["Instances"]
    }


def test_a_bootstrap_killed_midway_leaves_each_instance_to_its_backstop(cluster, tmp_path):
    """`up` killed (SIGKILL: a laptop that dies) once the bootstrap runs: nothing of sparknet's
    is left to end the instances, and no timer was installed. An hour after each boot (the
    default `backstop_minutes`), not before, each powers itself off, and EC2 terminates it,
    as its launch asked."""
    name, group = cluster
    ec2 = moto_ec2()
    with group.watch(ec2):
        proc, seen = up_signalled_at_bootstrap(name, tmp_path, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, seen
    launched = states(name)
    assert sorted(launched.values()) == ["running", "running"]
    group.serve(ec2)  # every instance has booted, whether `up` reached it or not
    for instance in launched:  # what the instances got passes cloud-init's own schema
        assert schema_errors(keys.user_data_of(ec2, instance), tmp_path) == ""
    assert not (tmp_path / "master" / "autostop" / "deadline.json").exists()  # no timer

    group.skew = 50 * 60  # well within the hour: nothing is due
    assert group.end_due(ec2) == {}
    assert sorted(states(name).values()) == ["running", "running"]

    group.skew = 60 * 60 + 1
    ended = group.end_due(ec2)
    assert {node: how for node, (_id, how) in ended.items()} == {
        "master": "terminate", "worker-1": "terminate",
    }  # fmt: skip
    assert {i for i, _how in ended.values()} == set(launched)
    assert set(states(name).values()) <= {"shutting-down", "terminated"}
