"""A static cluster on bare nodes (tests/bare_node.py): two fresh Debian 12 roots, each with
its own sshd inside `chroot` on its own loopback address, that share nothing with the test's
environment: no Java, no venv, no pyspark, no sparknet, only Debian's python3, the Debian
mirror and a read-only pip mirror (this machine's local package dirs), as on a company's
machines. `cluster up` applies every bootstrap step there for real (apt installs Java, the venv
is made, torch and pyspark and sparknet's dependencies come from the mirrors), the documented
`cluster ssh NAME master -- /opt/sparknet/venv/bin/sparknet train ...` runs two rounds of
digits on both nodes' executors, and `cluster down` stops Spark.

The first run on a machine makes the root (debootstrap: ~45 s) and the pyspark wheel (~20 s),
both cached per machine (tests/bare_node.py); later runs reuse them.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.bare_node import NODE_SHARED, start_nodes
from tests.conftest import SPARKNET
from tests.sshd import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADDRESSES = {"master": "127.0.0.41", "worker-1": "127.0.0.42"}
#: `cluster up` on bare nodes: apt, a venv with torch, pyspark and sparknet's dependencies
UP_TIMEOUT_S = 1800


@pytest.fixture
def bare_cluster(tmp_path, monkeypatch):
    """A static cluster's name in ./sparknet.yaml (cwd tmp_path) over two bare nodes, its
    registry under tmp_path; at the end taken down if still up, the nodes' processes killed
    (their mounts go with them) and their roots removed."""
    from sparknet.cluster import registry

    if os.geteuid() != 0:  # a missing debootstrap or zstd fails instead: .ci/run installs them
        pytest.skip("bare nodes need root (chroot, a mount namespace per node)")
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    group = start_nodes(tmp_path / "bare", ADDRESSES)
    name = f"b{uuid.uuid4().hex[:8]}"
    entry = {
        "provider": "static",
        "hosts": [n.address for n in group.nodes],
        "key_file": str(group.access.key_file),
        "known_hosts": str(group.access.known_hosts),
        # two nodes on one loopback: the ports must differ from every other listener here;
        # every package from the node's own pip configuration (its mirror): PyTorch's index
        # cannot be reached from it
        "bootstrap": {
            "package_index": "node", "worker_cores": 1, "worker_memory_mb": 1024,
            "gpus_per_node": 0, "master_port": free_port(), "master_ui_port": free_port(),
            "worker_ui_port": 0,
        },
    }  # fmt: skip
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump({"clusters": {name: entry}}))
    try:
        yield name, group, entry
    finally:
        try:
            if registry.registered().get(name) is not None:
                cli("down", name, cwd=tmp_path)
        finally:
            group.stop()
            group.remove()


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, no AWS reachable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # nothing listens: any AWS call would fail
    return subprocess.run(
        [str(SPARKNET), "cluster", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def up_with_step_times(name: str, cwd: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`cluster up`, and how long each node's steps took (from its `NODE: STEP ...` and
    `NODE: STEP done` lines as they came)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
    proc = subprocess.Popen(
        [str(SPARKNET), "cluster", "up", name], cwd=cwd, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    timer = threading.Timer(UP_TIMEOUT_S, proc.kill)
    timer.start()
    lines, started, took = [], {}, {}
    try:
        for line in proc.stderr:
            lines.append(line)
            now = time.monotonic()
            what = line.strip()
            if what.endswith(" ..."):
                started[what[:-4]] = now
            elif what.endswith(" done") and what[:-5] in started:
                took[what[:-5]] = round(now - started[what[:-5]], 1)
        stdout = proc.stdout.read()
        proc.wait(timeout=60)
    finally:
        timer.cancel()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "".join(lines)), took


def test_a_static_cluster_on_bare_nodes_trains_and_goes_down(bare_cluster, tmp_path) -> None:
    from sparknet.cluster import registry

    name, group, entry = bare_cluster
    master, worker = group.nodes
    for node in group.nodes:  # bare: nothing of this machine's Python, Java or sparknet
        assert not (node.root / "usr/lib/jvm").exists()
        assert not (node.root / "opt/sparknet").exists()

    began = time.monotonic()
    up, took = up_with_step_times(name, tmp_path)
    print(f"cluster up: {time.monotonic() - began:.0f} s; steps: {json.dumps(took)}")
    assert up.returncode == 0, up.stderr[-4000:]
    master_url = f"spark://{master.host}:{entry['bootstrap']['master_port']}"
    assert (
        "master: applied dirs, java, python-env, pyspark, sparknet, spark-conf, spark-master, "
        "spark-worker" in up.stderr
    ), up.stderr[-4000:]
    assert f"Spark master {master_url}: healthy" in up.stderr
    assert f"worker-1 ({worker.host}): ALIVE, 1 cores, 1024 MiB, 0 GPUs" in up.stderr
    site = "opt/sparknet/venv/lib/python3.11/site-packages"
    for node in group.nodes:  # each node's own Java and venv, inside its own root, torch from
        # the node's mirror (the CPU build where it has one: `bare_node.cpu_torch_pins`)
        assert list((node.root / "usr/lib/jvm").glob("java-17-openjdk-*"))
        assert (node.root / "opt/sparknet/venv/bin/sparknet").exists()
        torch = [p.name for p in (node.root / site).glob("torch-*.dist-info")]
        pinned = [p.split("==")[1] for p in group.torch_pins if p.startswith("torch==")]
        assert torch == [f"torch-{v}.dist-info" for v in pinned] or (not pinned and torch)

    # the documented way to train: sparknet from the master's venv, on the master node; the
    # run dir on a dir all nodes share (rank 0's task, on either node, writes the checkpoints)
    out = f"{NODE_SHARED}/runs/r1"
    began = time.monotonic()
    job = cli(
        "ssh", name, "master", "--", "/opt/sparknet/venv/bin/sparknet", "train",
        "--master", master_url, "--workers", "2", "--rounds", "2", "--tau", "1",
        "--model", "mlp", "--out", out, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    print(f"job: {time.monotonic() - began:.0f} s")
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    metrics = group.shared / "runs/r1/metrics.jsonl"
    rows = [r for r in map(json.loads, metrics.open()) if "executors" in r]
    assert [r["round"] for r in rows] == [1, 2]
    assert [r["executors"] for r in rows] == [2, 2]  # one on each node

    down = cli("down", name, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert "stopped Spark on master, worker-1" in down.stdout
    assert name not in registry.registered()
    for node in group.nodes:  # only the node's sshd is left: no JVM, no Python worker
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in node.processes()}
        assert names == {"sshd"}, (node.name, names)
