"""The `static` provider end to end: two machines given by address (two real sshd on
127.0.0.1, their keys in a known_hosts of the user's), `cluster up` bootstraps a healthy Spark
standalone cluster on them, `status` checks it, `cluster ssh` reaches a node, `down` stops Spark
and leaves the machines (and their install) as they were. The CLI runs as a subprocess, as a
user runs it; no AWS is involved (no moto server is started).

As in test_cluster_bootstrap.py, the nodes run over the repo's .venv with 1 core and 1 GiB per
worker, and each node's private address and install prefix come from the seam's
`<cluster>/<node>/node` entries (two nodes on one host need their own).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from sparknet.cluster.node_endpoints import ENDPOINTS_ENV
from tests.conftest import SPARKNET
from tests.sshd import daemon_pids, static_cluster_entry

pytestmark = pytest.mark.integration

ADDRESSES = {"master": "127.0.0.2", "worker-1": "127.0.0.3"}


@pytest.fixture
def cluster(sshd_nodes, tmp_path, monkeypatch):
    """A static cluster's name in ./sparknet.yaml (cwd tmp_path) over two loopback sshd nodes,
    its registry under tmp_path; taken down at the end if a test left it up."""
    from sparknet.cluster import registry

    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    group = sshd_nodes(2)
    name = f"s{uuid.uuid4().hex[:8]}"
    entry = {"provider": "static", **static_cluster_entry(group, name, ADDRESSES, tmp_path)}
    monkeypatch.setenv(ENDPOINTS_ENV, str(tmp_path / "endpoints.json"))
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump({"clusters": {name: entry}}))
    yield name, group, entry
    if registry.registered().get(name) is not None:
        cli("down", name, cwd=tmp_path)


def cli(
    *args: str, cwd: Path, timeout: float = 240, home: Path | None = None
) -> subprocess.CompletedProcess:
    """The CLI as a user runs it; `home`: another registry (SPARKNET_HOME), as of another
    machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if home is not None:
        env["SPARKNET_HOME"] = str(home)
    env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # nothing listens: any AWS call would fail
    return subprocess.run(
        [str(SPARKNET), "cluster", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_up_status_and_down_of_a_static_cluster(cluster, tmp_path) -> None:
    from sparknet.cluster import registry

    name, group, entry = cluster
    master_url = f"spark://{ADDRESSES['master']}:{entry['bootstrap']['master_port']}"
    up = cli("up", name, cwd=tmp_path)
    assert up.returncode == 0, up.stderr[-3000:]
    assert (
        "master: applied dirs, python-env, sparknet, spark-conf, spark-master, spark-worker"
        in up.stderr
    )
    assert f"Spark master {master_url}: healthy" in up.stderr
    # no GPU count in the settings: nvidia-smi on each host counted none
    assert "worker-1 (127.0.0.3): ALIVE, 1 cores, 1024 MiB, 0 GPUs" in up.stderr
    first = group.servers[0]
    assert f"ssh master\t{first.user}@127.0.0.1:{first.port}\tssh -F none" in up.stdout
    assert f"cluster {name} is up;" in up.stdout
    pids = daemon_pids(tmp_path, ADDRESSES)
    assert sorted(pids) == ["master/master", "master/worker", "worker-1/worker"]
    assert registry.registered()[name].provider == "static"

    shown = cli("status", name, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"cluster {name} (static, 2 hosts)" in shown.stdout
    assert f"Spark master {master_url}: healthy" in shown.stdout
    assert "master (127.0.0.2): ALIVE, 1 cores, 1024 MiB, 0 GPUs" in shown.stdout

    # `cluster ssh` reaches a node with the cluster's pinned keys
    ran = cli("ssh", name, "worker-1", "--", "echo", "on-worker", cwd=tmp_path)
    assert ran.returncode == 0 and ran.stdout.strip() == "on-worker", ran.stderr

    # another registry (another machine, or SPARKNET_HOME) brings up another cluster on the
    # same hosts: refused before anything runs there, naming the cluster that holds them; the
    # first's daemons and secret stay as they are
    _second_registry_is_refused(name, group, entry, tmp_path, pids)

    # a second up applies nothing
    again = cli("up", name, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do: every step was already done on all 2 nodes" in again.stderr
    assert daemon_pids(tmp_path, ADDRESSES) == pids

    # a job still running on the master (a session of its own, as sparknet-submit's supervisor
    # runs: a stand-in process here) and one that ended: `down` ends the first, marked cancelled
    jobs = tmp_path / "master" / "jobs"
    running = subprocess.Popen(["sleep", "600"], start_new_session=True)
    for run, pid in (("R-running", running.pid), ("R-ended", 2**22 + 1)):
        (jobs / run).mkdir(parents=True)
        (jobs / run / "driver.pid").write_text(f"{pid}\n")
    down = cli("down", name, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert "stopped Spark on master, worker-1" in down.stdout
    assert f"cluster {name} is down (static: its hosts keep running)" in down.stdout
    assert "stopped Spark on 2 of 2 hosts" in down.stderr
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists()
    assert running.wait(timeout=30) == -15  # SIGTERM
    assert sorted(p.parent.name for p in jobs.glob("*/cancelled")) == ["R-running"]
    # the machines stay: sshd runs, the install is there; the secret is gone from them and here
    assert all(s.proc.poll() is None for s in group.servers)
    assert (tmp_path / "master" / "venv" / "bin" / "python").exists()
    assert not (tmp_path / "master" / "conf" / "spark-defaults.conf").exists()
    assert not registry.secret_file(name).exists()
    assert name not in registry.registered()
    assert not list(tmp_path.glob("*/owner.json"))  # the hosts are given back
    gone = cli("status", name, cwd=tmp_path)
    assert gone.returncode == 1
    assert f"error: static cluster {name} is not up here (not registered)" in gone.stderr


def _second_registry_is_refused(name: str, group, entry: dict, root: Path, pids: dict) -> None:
    other = f"o{uuid.uuid4().hex[:8]}"
    seam = json.loads((root / "endpoints.json").read_text())
    for node in ADDRESSES:  # the same machines: the same install prefixes
        seam[f"{other}/{node}/node"] = seam[f"{name}/{node}/node"]
    (root / "endpoints.json").write_text(json.dumps(seam))
    settings = yaml.safe_load((root / "sparknet.yaml").read_text())
    settings["clusters"][other] = entry
    (root / "sparknet.yaml").write_text(yaml.safe_dump(settings))
    conf = root / "master" / "conf" / "spark-defaults.conf"
    before = conf.read_bytes()
    refused = cli("up", other, cwd=root, home=root / "other-home")
    assert refused.returncode == 2, refused.stderr
    first = group.servers[0]
    assert refused.stderr.startswith(
        f"error: {first.user}@127.0.0.1:{first.port} (master) is held by static cluster {name} "
        "of the sparknet registry "
    ), refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert daemon_pids(root, ADDRESSES) == pids
    assert conf.read_bytes() == before
    assert sorted(p.parent.name for p in root.glob("*/owner.json")) == ["master", "worker-1"]


def test_an_unknown_host_is_refused_before_anything(cluster, tmp_path) -> None:
    """A host whose key the user's known_hosts lacks: one line naming it, exit 2, nothing
    registered, no connection made (the sshd logged none but the fixture's own)."""
    from sparknet.cluster import registry

    name, group, _entry = cluster
    lines = group.access.known_hosts.read_text().splitlines()
    group.access.known_hosts.write_text(lines[0] + "\n")  # the master's key only
    up = cli("up", name, cwd=tmp_path)
    assert up.returncode == 2, up.stderr
    worker = group.servers[1]
    assert up.stderr.startswith(
        f"error: no host key for worker-1 ({worker.user}@127.0.0.1:{worker.port}) in "
    )
    assert len(up.stderr.strip().splitlines()) == 1
    assert name not in registry.registered()
    log = group.servers[0].log.read_text()
    assert log.count("Connection from") == 0  # (the fixture reads sshd's log, connects not)


def test_a_dead_host_edited_hosts_and_forgetting_it(cluster, tmp_path) -> None:
    """`up --no-bootstrap` registers only. Then a host stops answering: `status` exits 1 (no
    master answers); the settings drop the host, but the registered hosts stay the truth:
    `up` refuses the edit and `down` still fails naming the host (exit 1, the cluster stays
    registered); `down --forget-unreachable` forgets it. `list` shows the static cluster with
    no AWS reachable."""
    from sparknet.cluster import registry

    name, group, entry = cluster
    up = cli("up", name, "--no-bootstrap", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    assert f"cluster {name} is registered (not bootstrapped)" in up.stdout
    listed = cli("list", cwd=tmp_path)  # AWS is unreachable here: the static line comes first
    assert listed.stdout.splitlines()[0] == f"{name}\tstatic, 2 hosts\t-\tregistered\towner -"
    assert listed.returncode == 2 and listed.stderr.startswith("error: ")

    group.servers[1].stop()
    shown = cli("status", name, cwd=tmp_path)
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert f"Spark master spark://{ADDRESSES['master']}:" in shown.stdout
    assert "UNHEALTHY" in shown.stdout

    settings = yaml.safe_load((tmp_path / "sparknet.yaml").read_text())
    settings["clusters"][name]["hosts"] = entry["hosts"][:1]
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump(settings))
    again = cli("up", name, cwd=tmp_path)
    assert again.returncode == 1, again.stderr
    assert again.stderr.startswith(
        f"error: static cluster {name} runs Spark on {entry['hosts'][0]}, "
    )
    assert "`sparknet cluster down" in again.stderr

    down = cli("down", name, cwd=tmp_path)
    assert down.returncode == 1, down.stderr
    assert "could not stop Spark on every host (1 of 2 nodes failed: worker-1" in down.stderr
    assert "--forget-unreachable" in down.stderr
    assert name in registry.registered()

    down = cli("down", name, "--forget-unreachable", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert "stopped Spark on master\n" in down.stdout
    assert "forgetting without stopping Spark there: 1 of 2 nodes failed: worker-1" in down.stderr
    assert name not in registry.registered()
