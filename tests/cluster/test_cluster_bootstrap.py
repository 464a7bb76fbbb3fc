"""`sparknet cluster up` end to end: moto's instances are loopback sshd nodes (the seam of
`node_endpoints.py`, each sshd serving the host key sparknet put in its instance's user data), and
`up` ends with a real Spark standalone cluster on them, started over SSH, healthy as its master
tells it. The CLI runs as a subprocess, as a user runs it (the jobs run on such a cluster are
test_submit.py's and test_submit_detach.py's).

What the bootstrap itself does (each step, the secret's files, the ports the daemons listen on,
a refused job without the secret) is proved in test_bootstrap.py; here: that `up`, `status`,
`cluster bootstrap` and `down` drive it. The nodes run over the repo's .venv
(`bootstrap.python_env`) with 1 core and 1 GiB per worker, and offer no GPU
(`bootstrap.gpus_per_node: 0`: their g5.xlarge type has one on EC2, which `plan_nodes` is
checked to find). Each node's own private address and install prefix come from the seam's
`<cluster>/<node>/node` entries.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.moto_clusters import (
    ADDRESSES,
    REGION,
    cli,
    loopback_cluster,
    moto_ec2,
    up_signalled_at_bootstrap,
)
from tests.imds import ImdsStandIn
from tests.sshd import daemon_pids, scheduled_shutdown

pytestmark = pytest.mark.integration

AMI_PARAMETER = "/test/sparknet/bootstrap-ami"


@pytest.fixture
def cluster(moto_endpoint, moto_nodes, tmp_path, monkeypatch):
    """A cluster name with a `clusters:` entry in ./sparknet.yaml (cwd tmp_path), its registry
    under tmp_path, and its two nodes mapped to loopback sshd nodes with their own addresses
    and prefixes; its worker is a spot instance, and each node's metadata service is the
    stand-in of tests/imds.py (`group.imds`). Whatever is left is taken down at the end."""
    imds = ImdsStandIn()
    try:
        with loopback_cluster(
            moto_nodes, tmp_path, monkeypatch, prefix="b", ami_parameter=AMI_PARAMETER, spot=True
        ) as (name, group, entry):
            group.imds = imds
            yield name, group, entry
    finally:
        imds.close()


def _until(value, timeout: float = 60.0):
    """`value()` once it is truthy (polled every 0.5 s), else the test fails."""
    deadline = time.monotonic() + timeout
    while not (got := value()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)
    return got


def test_up_bootstraps_a_healthy_cluster_and_down_stops_it(cluster, tmp_path) -> None:
    from sparknet.cluster import registry, repair, spark_nodes
    from sparknet.cluster.aws import instances, keys
    from sparknet.cluster.spec import ClusterSpec

    name, group, entry = cluster
    master_url = f"spark://{ADDRESSES['master']}:{entry['bootstrap']['master_port']}"
    with group.watch(moto_ec2()):
        up = cli("up", name, cwd=tmp_path)
    assert up.returncode == 0, up.stderr[-3000:]
    out = up.stderr  # progress and the bootstrap's lines; stdout has the instances
    assert (
        "master: applied dirs, python-env, sparknet, spark-conf, spark-master, spark-worker, "
        "autostop" in out
    )
    assert "worker-1: applied dirs, python-env, sparknet, spark-conf, spark-worker (" in out
    assert f"Spark master {master_url}: healthy" in out
    assert "master (127.0.0.2): ALIVE, 1 cores, 1024 MiB, 0 GPUs" in out
    assert "worker-1 (127.0.0.3): ALIVE, 1 cores, 1024 MiB, 0 GPUs" in out
    pids = daemon_pids(tmp_path, ADDRESSES)
    assert sorted(pids) == ["master/master", "master/worker", "worker-1/worker"]
    # the cluster's secret: 0600 in the registry dir, the one the nodes' Spark runs with
    secret_file = registry.secret_file(name)
    assert secret_file.stat().st_mode & 0o777 == 0o600
    conf = (tmp_path / "master" / "conf" / "spark-defaults.conf").read_text()
    assert f"spark.authenticate.secret {secret_file.read_text().strip()}\n" in conf
    assert secret_file.read_text().strip() not in up.stdout + up.stderr
    # the autostop timer on the master only, with the default 30 minutes (far beyond this test)
    timer = _autostop_pid(tmp_path)
    assert timer is not None and not (tmp_path / "worker-1" / "run" / "autostop.pid").exists()
    state = tmp_path / "master" / "autostop"
    assert json.loads((state / "settings.json").read_text()) == {
        "cluster": name, "region": REGION, "minutes": 30,
    }  # fmt: skip
    assert json.loads((state / "deadline.json").read_text())["action"] == "wait"
    # the timer replaced every node's backstop (the power-off each instance's user data
    # schedules at boot: test_backstop.py): a day on, nothing powers off
    assert "master: backstop-off done" in out and "worker-1: backstop-off done" in out
    assert [scheduled_shutdown(group.workdir / node) for node in ADDRESSES] == [None, None]
    group.skew = 24 * 60 * 60
    assert group.end_due(moto_ec2()) == {}
    assert {i.state for i in instances.find(moto_ec2(), name)} == {"running"}
    group.skew = 0.0  # a node launched later (the repair's) has its backstop's hour

    # GPUs from the instance type where the spec does not say (g5.xlarge: one A10G)
    spec = ClusterSpec.model_validate({**entry, "name": name, "bootstrap": {}})
    ec2 = moto_ec2()
    assert [n.gpus for n in spark_nodes.plan_nodes(spec, ec2, instances.find(ec2, name))] == [1, 1]

    # where docs/clusters.md sends users for a job: the master node, whose venv's Python finds
    # the node's Spark conf dir, secret included (a job run that way is test_bootstrap.py's);
    # like ssh, `cluster ssh` hands the remote shell one command line
    conf_dir = cli(
        "ssh", name, "--", str(tmp_path / "master" / "venv" / "bin" / "python"), "-c",
        shlex.quote("import os; print(os.environ['SPARK_CONF_DIR'])"),
        cwd=tmp_path,
    )  # fmt: skip
    assert conf_dir.returncode == 0, (conf_dir.stdout + conf_dir.stderr)[-3000:]
    assert conf_dir.stdout.strip() == str(tmp_path / "master" / "conf")
    # and the cluster's region, for its S3 clients (a session's own region would win over it)
    from sparknet.cluster.spark.steps import CONF_PTH

    (pth,) = (tmp_path / "master" / "venv").glob(f"lib/python*/site-packages/{CONF_PTH}")
    assert f"os.environ.setdefault('AWS_DEFAULT_REGION', {REGION!r})" in pth.read_text()

    # status: the instances, then the health as the master tells it, then the autostop deadline
    shown = cli("status", name, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"Spark master {master_url}: healthy" in shown.stdout
    assert "worker-1 (127.0.0.3): ALIVE, 1 cores, 1024 MiB, 0 GPUs" in shown.stdout
    due = re.search(r"^autostop: in (\d+) min \(\d\d:\d\d UTC\)$", shown.stdout, re.M)
    assert due and 0 < int(due.group(1)) <= 30, shown.stdout

    # a second `up` launches nothing; with a changed setting it restarts the timer alone (every
    # other step on either node was done already; static clusters check a plain second `up`
    # saying "nothing to do"), and 0 turns the timer off, as status says
    off = cli("up", name, "--autostop", "0", cwd=tmp_path)
    assert off.returncode == 0, off.stderr[-3000:]
    assert "launching" not in off.stderr
    assert len(instances.find(ec2, name)) == 2
    assert "master: applied autostop (" in off.stderr
    assert "worker-1: applied nothing (" in off.stderr
    assert "backstop-off" not in off.stderr  # no node has a backstop left to cancel
    assert daemon_pids(tmp_path, ADDRESSES) == pids
    assert _autostop_pid(tmp_path) not in (None, timer)
    timer = _autostop_pid(tmp_path)
    shown = cli("status", name, cwd=tmp_path)
    assert "\nautostop: off\n" in shown.stdout

    # a worker's Spark daemon killed: a loss the repair sees, and `up`'s code restarts it alone
    # (the cluster as registered, its autostop off included)
    spec = registry.registered()[name]
    assert repair.losses(spec) == repair.Losses(False, ())
    os.kill(pids["worker-1/worker"], signal.SIGKILL)
    lost = _until(lambda: repair.losses(spec).lines)
    assert lost == ("worker-1's worker (127.0.0.3) is not registered with the master",)
    said: list[str] = []
    with group.watch(ec2):
        repair.Watch(spec, say=said.append, every_s=0)()  # as an attached submitter's follow
    assert said[0] == f"cluster {name} lost {lost[0]}: repairing", said
    assert "worker-1: applied spark-worker (" in "\n".join(said), said
    assert said[-1] == f"cluster {name} repaired; the job goes on", said
    assert not any(line.startswith("launching") for line in said)
    assert repair.losses(spec) == repair.Losses(False, ())
    restarted = daemon_pids(tmp_path, ADDRESSES)
    assert restarted["worker-1/worker"] != pids["worker-1/worker"]
    pids = restarted

    # the spot worker gets EC2's two-minute notice: a loss at once, and the repair terminates
    # it and launches, bootstraps and registers its replacement
    (old,) = [i for i in instances.find(ec2, name) if i.role == "worker"]
    assert old.spot
    group.imds.notices[old.id] = {"action": "terminate", "time": "2026-12-02T08:22:00Z"}
    notice = f"worker {old.id} has a spot interruption notice (terminate at 2026-12-02T08:22:00Z)"
    assert repair.losses(spec) == repair.Losses(False, (notice,), (old.id,))
    said = []

    def say(line: str) -> None:
        said.append(line)
        if line.startswith("terminating "):  # what EC2's termination does to the node
            group.gone("worker-1")
            os.kill(pids["worker-1/worker"], signal.SIGKILL)

    with group.watch(ec2):
        repair.Watch(spec, say=say, every_s=0)()
    assert said[:2] == [
        f"cluster {name} lost {notice}: repairing",
        f"terminating {old.id} before EC2 does: replacements launch now",
    ], said
    assert "launching 1 spot workers (g5.xlarge)" in said, said
    assert said[-1] == f"cluster {name} repaired; the job goes on", said
    (new,) = [i for i in instances.find(ec2, name) if i.role == "worker"]
    assert new.id != old.id and new.spot and new.state == "running"
    assert group.serving["worker-1"] == new.id
    assert repair.losses(spec) == repair.Losses(False, ())  # registered, and no notice of its own
    replaced = daemon_pids(tmp_path, ADDRESSES)
    assert replaced["worker-1/worker"] != pids["worker-1/worker"]
    assert replaced["master/worker"] == pids["master/worker"]
    pids = replaced

    down = cli("down", name, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert "stopped the Spark daemons on 2 nodes" in down.stderr
    for pid in [*pids.values(), timer]:
        assert not Path(f"/proc/{pid}").exists()
    assert _autostop_pid(tmp_path) is None
    assert not ec2.describe_key_pairs(
        Filters=[{"Name": "key-name", "Values": [keys.key_pair_name(name)]}]
    )["KeyPairs"]
    assert not secret_file.exists()


def _autostop_pid(root: Path) -> int | None:
    """The master's autostop timer's pid (its pid file under the master's prefix), if any."""
    pid = root / "master" / "run" / "autostop.pid"
    return int(pid.read_text()) if pid.exists() else None


def test_a_failed_bootstrap_keeps_the_instances_and_says_how_to_go_on(cluster, tmp_path) -> None:
    """The master's prefix lies under a plain file: its first step fails. The instances stay
    (and the registry entry), the error says so in its first line; a `cluster bootstrap` after
    the fix finishes the cluster."""
    from sparknet.cluster import registry
    from sparknet.cluster.aws import instances

    name, group, _entry = cluster
    (tmp_path / "master").write_text("not a directory")
    layout = json.loads(group.file.read_text())
    layout[f"{name}/master/node"]["prefix"] = str(tmp_path / "master" / "sub")
    group.file.write_text(json.dumps(layout))
    with group.watch(moto_ec2()):
        up = cli("up", name, cwd=tmp_path)
    assert up.returncode == 1, up.stderr
    first = next(ln for ln in up.stderr.splitlines() if ln.startswith("error: "))
    assert first.startswith("error: bootstrap failed: master: step dirs failed (exited 1): mkdir")
    assert (
        "the cluster's 2 instances stay up and registered (and are billed) until their "
        "backstop powers them off (terminates them) 60 minutes after their last boot: "
        f"`sparknet cluster bootstrap {name} --region {REGION}` before then finishes it" in first
    )
    lines = up.stderr.splitlines()
    # under it, the node's last output lines (`details`), never part of the one error line
    assert lines[lines.index(first) + 1] == "--- master, step dirs, last output:"
    assert "Traceback" not in up.stderr
    assert len(instances.find(moto_ec2(), name)) == 2
    assert name in registry.registered()
    # fixed: the bootstrap alone finishes the cluster
    (tmp_path / "master").unlink()
    group.serve(moto_ec2())
    done = cli("bootstrap", name, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "master: applied dirs, python-env" in done.stderr
    # the worker node's first round had passed: only its worker was left to start
    assert "worker-1: applied spark-worker" in done.stderr
    assert ": healthy" in done.stderr


def test_up_without_bootstrap_and_status_of_unreachable_nodes(cluster, tmp_path) -> None:
    """`--no-bootstrap` launches only (no node is served here, so any SSH would fail); `status`
    then says in one line that the nodes cannot be reached."""
    name, _group, _entry = cluster
    up = cli("up", name, "--no-bootstrap", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    assert "bootstrapping" not in up.stderr
    assert (  # the backstop still ends them: `up` says when
        "not bootstrapped: the instances power off (terminate) 60 minutes after their last boot "
        f"unless `sparknet cluster bootstrap {name} --region {REGION}` finishes them by then"
        in up.stdout
    )
    shown = cli("status", name, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    spark = [ln for ln in shown.stdout.splitlines() if ln.startswith("Spark")]
    assert len(spark) == 1 and spark[0].startswith("Spark: the nodes cannot be reached (")
    assert shown.stdout.endswith("\nautostop: unknown: the master does not answer\n")


def test_ctrl_c_during_the_bootstrap_keeps_the_cluster_registered(cluster, tmp_path) -> None:
    """Ctrl-C once the bootstrap runs: `up` removes nothing, exits 130 with a line saying the
    instances stay (billed) and how to go on, and `status` shows them."""
    import signal

    from sparknet.cluster import registry

    name, group, _entry = cluster
    with group.watch(moto_ec2()):
        proc, seen = up_signalled_at_bootstrap(name, tmp_path, signal.SIGINT)
        _out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, seen + err
    assert (
        "error: interrupted during the bootstrap; the cluster's 2 instances stay up and "
        "registered (and are billed)" in err
    )
    assert name in registry.registered()
    shown = cli("status", name, cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.count("\ti-") == 2, shown.stderr
