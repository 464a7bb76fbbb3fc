"""The bootstrap over real SSH: two loopback "nodes" (two real sshd on 127.0.0.1, each with its
own install prefix and its own private address, 127.0.0.2 for the master and 127.0.0.3 for the
worker node) become a Spark standalone cluster with authentication and encryption on.

Nothing is installed: the nodes' venvs sit over the repo's .venv (`Plan.python_env`, the same
path a node takes over the Deep Learning AMI's PyTorch env), so only the sparknet wheel built
from this checkout goes into them. Java 17 is on this machine, so the Java step is skipped, and
the nodes have no GPU, so the driver step is too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparknet.cluster.nodes import Access
from sparknet.cluster.spark import bootstrap as b
from sparknet.cluster.spark.health import Expected, require_healthy
from sparknet.cluster.spark.plan import Node, Plan
from sparknet.cluster.spark.spark_conf import Ports
from sparknet.cluster.spark.steps import PRIVATE_DIRS
from sparknet.cluster.spark.wheel import Wheel
from sparknet.errors import SparknetError
from tests.relay import DowngradeRelay
from tests.sshd import SshNodes, free_port, start_nodes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: the private addresses the daemons' RPC binds (loopback has all of 127/8 on Linux)
ADDRESSES = ("127.0.0.2", "127.0.0.3")


@dataclass
class Cluster:
    plan: Plan
    access: Access
    first: b.BootstrapReport
    secret_file: Path


def nodes_of(group: SshNodes, root: Path) -> list[Node]:
    """The sshd nodes as the bootstrap sees them: each its own prefix and private address."""
    return [
        Node(ep, address=addr, prefix=str(root / f"prefix-{ep.name}"))
        for ep, addr in zip(group.endpoints, ADDRESSES, strict=True)
    ]


def settings() -> dict:
    """Free ports (several clusters on one host), the nodes' venvs over the repo's .venv, and
    1 core and 1 GiB per worker (two workers share this machine)."""
    ports = Ports(master=free_port(), master_ui=free_port(), worker_ui=0)
    return {"ports": ports, "python_env": str(REPO / ".venv"), "worker_cores": 1,
            "worker_memory_mb": 1024}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    root = tmp_path_factory.mktemp("bootstrap")
    group = start_nodes(root / "ssh", 2)
    secret_file = root / "registry" / "spark-secret"
    try:
        plan = b.prepare_plan(nodes_of(group, root), secret_file, root / "wheel", **settings())
        first = b.bootstrap(plan, group.access, health_wait_s=90)
        yield Cluster(plan, group.access, first, secret_file)
    finally:
        try:
            if "plan" in locals():
                b.stop_daemons(plan.nodes, group.access)
        finally:
            group.stop()


def daemon_pids(plan: Plan) -> dict[str, int]:
    out = {}
    for node in plan.nodes:
        for role in ("master", "worker"):
            pid = Path(node.path("run", f"{role}.pid"))
            if pid.exists():
                out[f"{node.name}/{role}"] = int(pid.read_text())
    return out


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def master_json(plan: Plan) -> dict:
    url = f"http://127.0.0.1:{plan.ports.master_ui}/json/"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_bootstrap_starts_a_master_and_a_worker_per_node_with_auth_on(cluster) -> None:
    plan, first = cluster.plan, cluster.first
    assert first.nodes["master"].applied == (
        "dirs", "python-env", "sparknet", "spark-conf", "spark-master", "spark-worker",
    )  # fmt: skip
    assert first.nodes["worker-1"].applied == (
        "dirs", "python-env", "sparknet", "spark-conf", "spark-worker",
    )  # fmt: skip
    # Python 3.11 and Java 17 are here, the nodes have no GPU; the pyspark is the submitter's
    assert set(first.nodes["worker-1"].skipped) == {"python", "java", "nvidia-driver", "pyspark"}
    assert first.health.ok
    assert [(w.node, w.address, w.state, w.cores) for w in first.health.workers] == [
        ("master", "127.0.0.2", "ALIVE", 1),
        ("worker-1", "127.0.0.3", "ALIVE", 1),
    ]
    assert sorted(daemon_pids(plan)) == ["master/master", "master/worker", "worker-1/worker"]
    for node in plan.nodes:  # the wheel of this checkout, in the node's venv, not the repo's
        where = subprocess.run(
            [node.python, "-c", "import sparknet; print(sparknet.__file__)"],
            capture_output=True, text=True, check=True, cwd="/",
        ).stdout  # fmt: skip
        assert where.startswith(node.venv + "/lib/")


def test_the_secret_is_in_0600_files_only(cluster) -> None:
    plan, secret = cluster.plan, cluster.plan.secret
    assert cluster.secret_file.stat().st_mode & 0o777 == 0o600
    for node in plan.nodes:
        conf = Path(node.path("conf", "spark-defaults.conf"))
        assert conf.stat().st_mode & 0o777 == 0o600
        assert Path(node.path("conf")).stat().st_mode & 0o777 == 0o700
        settings = dict(line.split(" ", 1) for line in conf.read_text().splitlines()[1:])
        assert settings["spark.authenticate.secret"] == secret
        for key in ("spark.authenticate", "spark.network.crypto.enabled",
                    "spark.io.encryption.enabled"):  # fmt: skip
            assert settings[key] == "true"
        assert settings["spark.master.rest.enabled"] == "false"
        for log in Path(node.path("logs")).iterdir():
            assert secret not in log.read_text()
    for pid in daemon_pids(plan).values():
        assert secret not in Path(f"/proc/{pid}/cmdline").read_text()
        assert secret not in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


def test_the_nodes_logs_work_and_jobs_are_its_users_alone(cluster) -> None:
    """Driver logs, executor stderr and the jobs' settings are nobody else's to read."""
    for node in cluster.plan.nodes:
        modes = {d: Path(node.path(d)).stat().st_mode & 0o777 for d in PRIVATE_DIRS}
        assert modes == dict.fromkeys(("conf", "logs", "work", "jobs"), 0o700)


def test_the_master_ui_listens_on_loopback_only_and_rpc_on_the_private_address(cluster) -> None:
    ports = cluster.plan.ports
    assert master_json(cluster.plan)["status"] == "ALIVE"
    # the master's RPC and UI only: no REST submission server (it takes jobs unauthenticated)
    assert listening_ports(daemon_pids(cluster.plan)["master/master"]) == {
        ports.master,
        ports.master_ui,
    }
    with pytest.raises(OSError):
        socket.create_connection((ADDRESSES[0], ports.master_ui), 2).close()
    socket.create_connection((ADDRESSES[0], ports.master), 2).close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", ports.master), 2).close()


#: a tiny job: the count of 100 numbers over 4 tasks, on the cluster's executors
JOB = """
import sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.master(sys.argv[1]).appName(sys.argv[2]).getOrCreate()
print("COUNT", spark.sparkContext.parallelize(range(100), 4).map(lambda x: x * 2).count())
spark.stop()
"""


def job_env() -> dict[str, str]:
    """This environment less any Spark setting (the driver binds loopback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    return dict(env, SPARK_LOCAL_IP="127.0.0.1")


def test_a_job_on_the_master_nodes_venv_runs_with_the_clusters_secret(cluster, tmp_path) -> None:
    """As a user on the master node runs it: the node venv's Python, no Spark setting given;
    the venv points Spark at the node's conf dir, which holds the secret."""
    plan = cluster.plan
    done = subprocess.run(
        [plan.master.python, "-c", JOB, plan.master_url, "with-secret"],
        env=job_env(), cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert "COUNT 100" in done.stdout, done.stderr[-3000:]
    apps = master_json(plan)["completedapps"]
    assert [a["name"] for a in apps if a["name"] == "with-secret"] == ["with-secret"]


def test_a_job_without_the_secret_is_refused(cluster, tmp_path) -> None:
    """A driver without the secret never registers: the master drops its connection at once
    (Spark's client would retry for a minute; the test stops it at the first refusal)."""
    plan = cluster.plan
    proc = subprocess.Popen(
        [sys.executable, "-c", JOB, plan.master_url, "no-secret"],
        env=job_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 90
        for line in proc.stdout:
            seen.append(line)
            if "Failed to connect to master" in line or time.monotonic() > deadline:
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert any("Failed to connect to master" in line for line in seen), "".join(seen[-20:])
    assert not any("COUNT" in line for line in seen)
    state = master_json(plan)
    names = [a["name"] for a in state["activeapps"] + state["completedapps"]]
    assert "no-secret" not in names


def test_a_relay_that_answers_the_first_auth_message_with_a_failure_gets_no_plaintext(
    cluster, tmp_path
) -> None:
    """A man in the middle answers the driver's first authentication message with an
    RpcFailure (Spark's default then falls back to SASL without encryption, and
    RegisterApplication crosses in plaintext): with no SASL fallback the driver gives up on
    that connection at once, and nothing readable crosses the relay."""
    plan = cluster.plan
    relay = DowngradeRelay((ADDRESSES[0], plan.ports.master))
    proc = subprocess.Popen(
        [plan.master.python, "-c", JOB, f"spark://127.0.0.1:{relay.port}", "downgraded"],
        env=job_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 90
        for line in proc.stdout:
            seen.append(line)
            if "Failed to connect to master" in line or "COUNT" in line:
                break
            if time.monotonic() > deadline:
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        relay.close()
    assert relay.downgrades >= 1, "".join(seen[-20:])
    assert any("Failed to connect to master" in line for line in seen), "".join(seen[-20:])
    assert b"RegisterApplication" not in relay.seen and b"downgraded" not in relay.seen
    state = master_json(plan)
    assert "downgraded" not in [a["name"] for a in state["activeapps"] + state["completedapps"]]


def test_a_second_bootstrap_applies_nothing_and_says_so(cluster) -> None:
    before = daemon_pids(cluster.plan)
    again = b.bootstrap(cluster.plan, cluster.access, health_wait_s=30)
    assert again.nothing_to_do
    assert again.lines() == ["nothing to do: every step was already done on all 2 nodes"]
    assert all(not r.applied and len(r.skipped) >= 8 for r in again.nodes.values())
    assert daemon_pids(cluster.plan) == before  # nothing restarted
    assert again.health.ok


def test_the_health_check_names_a_missing_worker(cluster) -> None:
    plan = cluster.plan
    expected = [Expected(n.name, n.rpc_host, 1) for n in plan.nodes]
    expected.append(Expected("worker-2", "127.0.0.9", 1))
    with pytest.raises(SparknetError) as caught:
        require_healthy(plan.master, plan.ports, expected, cluster.access)
    assert str(caught.value) == (
        "the Spark cluster is not healthy: worker-2's worker (127.0.0.9) is not registered "
        "with the master"
    )


def test_stopping_ends_every_daemon_by_its_pid(cluster) -> None:
    """Last of the cluster's tests: what `down` of a static cluster does (and the teardown)."""
    pids = daemon_pids(cluster.plan)
    assert len(pids) == 3
    b.stop_daemons(cluster.plan.nodes, cluster.access)
    assert daemon_pids(cluster.plan) == {}  # pid files gone
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists()
    b.stop_daemons(cluster.plan.nodes, cluster.access)  # nothing left to stop: no error


def test_a_failing_step_names_node_and_step(tmp_path) -> None:
    """Each node's prefix lies under a plain file: its first step (the prefix's directories)
    fails, and the one error names both nodes, the step and mkdir's own words."""
    group = start_nodes(tmp_path / "ssh", 2)
    try:
        nodes = nodes_of(group, tmp_path)
        for node in nodes:
            Path(node.prefix).write_text("not a directory")
        bad = [Node(n.endpoint, n.address, f"{n.prefix}/sub") for n in nodes]
        wheel = Wheel(tmp_path / "unused.whl", "0", "0")
        with pytest.raises(b.BootstrapFailed) as caught:
            b.bootstrap(Plan(tuple(bad), wheel, "ab" * 32, **settings()), group.access)
    finally:
        group.stop()
    first, *rest = str(caught.value).splitlines()
    assert first.startswith("bootstrap failed: master: step dirs failed (exited 1): mkdir: ")
    assert "; worker-1: step dirs failed (exited 1): mkdir: " in first
    assert "Not a directory" in first
    assert rest[0] == "--- master, step dirs, last output:"
    assert [f.node for f in caught.value.failures] == ["master", "worker-1"]
    assert "ab" * 32 not in str(caught.value)
