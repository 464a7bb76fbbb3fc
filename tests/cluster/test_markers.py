"""A static host's owner marker, and the registry's own lock: the marker's shell runs for real
(a local shell stands in for the SSH session, each "host" an install prefix of its own under
tmp_path), so its `flock`, its reads and writes are what a host runs. Two registries are two
SPARKNET_HOMEs here, as they would be two machines."""

from __future__ import annotations

import getpass
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import invoke
import pytest

from sparknet.cluster import markers, node_endpoints, nodes, registry, spark_nodes, sshkeys, static
from sparknet.cluster.address import Endpoint
from sparknet.cluster.spark.daemons import WORKER_CLASS
from sparknet.cluster.spark.plan import Node
from sparknet.cluster.spec import ClusterSpec

HOSTS = ["10.0.0.5", "10.0.0.6"]


def _node(root: Path, name: str = "master") -> Node:
    return Node(Endpoint(name, "10.0.0.5"), prefix=str(root / name))


def test_take_mine_held_and_release(tmp_path) -> None:
    conn, node = invoke.Context(), _node(tmp_path)
    me = markers.Holder("lab", "a" * 16, "alice@laptop:/home/alice/.sparknet/clusters", "t0")
    other = markers.Holder("lab", "b" * 16, "bob@desk:/home/bob/.sparknet/clusters", "t1")
    # `down`'s look at a host where nothing was ever installed makes nothing there
    assert markers.take(conn, node, me, make=False) == (markers.ABSENT, None)
    markers.release(conn, node, me)
    assert not (tmp_path / "master").exists()
    assert markers.take(conn, node, me) == (markers.TAKEN, None)  # made the missing prefix too
    assert markers.take(conn, node, me) == (markers.MINE, None)
    # the same name in another registry is another cluster
    assert markers.take(conn, node, other) == (markers.HELD, me)
    markers.release(conn, node, other)  # not its marker: it stays
    assert markers.Holder.parse((tmp_path / "master" / markers.MARKER).read_text()) == me
    markers.release(conn, node, me)
    assert not (tmp_path / "master" / markers.MARKER).exists()
    assert markers.take(conn, node, other) == (markers.TAKEN, None)


def test_of_many_takers_at_once_exactly_one_takes_the_host(tmp_path) -> None:
    """The read and the write happen under the host's lock: never two holders."""
    node = _node(tmp_path)
    answers: list[str] = []

    def one(k: int) -> None:
        holder = markers.Holder(f"c{k}", f"{k:016x}")
        answers.append(markers.take(invoke.Context(), node, holder)[0])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(answers) == [markers.HELD] * 5 + [markers.TAKEN]


# --- static up and down over the markers ---------------------------------------------------------


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """Two hosts (prefixes under tmp_path, reached through a local shell) whose keys the
    user's known_hosts holds; the registry under tmp_path/home."""
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    key = tmp_path / "id"
    sshkeys.write_private_key(key, sshkeys.new_ed25519()[0])
    kind, blob = sshkeys.new_ed25519()[1].split()[:2]
    (tmp_path / "known_hosts").write_text("".join(f"{h} {kind} {blob}\n" for h in HOSTS))
    layout = {
        f"{cluster}/{node}/node": {"prefix": str(tmp_path / node)}
        for cluster in ("lab", "other")
        for node in ("master", "worker-1")
    }
    (tmp_path / "endpoints.json").write_text(json.dumps(layout))
    monkeypatch.setenv(node_endpoints.ENDPOINTS_ENV, str(tmp_path / "endpoints.json"))

    def run_all(endpoints, access, fn, timeout, **kw):  # each "host" in a local shell
        return {e.name: fn(e, invoke.Context()) for e in endpoints}

    monkeypatch.setattr(nodes, "run_all", run_all)
    return tmp_path


def _spec(root: Path, name: str = "lab") -> ClusterSpec:
    return ClusterSpec(
        name=name, provider="static", hosts=HOSTS, key_file=str(root / "id"),
        known_hosts=str(root / "known_hosts"),
    )  # fmt: skip


def _fake_worker(root: Path, node: str) -> subprocess.Popen:
    """A process that the worker's stop takes for the node's Spark worker (its command line
    holds the worker's class and the node's conf dir), with its pid file, and the node's venv
    that started it (its Python is this venv's: the stop runs `sparknet.node` there)."""
    (root / node / "run").mkdir(parents=True, exist_ok=True)
    python = root / node / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    conf = str(root / node / "conf")
    argv = [sys.executable, "-c", "import time; time.sleep(120)", WORKER_CLASS, conf]
    proc = subprocess.Popen(argv, start_new_session=True)
    threading.Thread(target=proc.wait, daemon=True).start()  # reaped at once, as a daemon is
    (root / node / "run" / "worker.pid").write_text(f"{proc.pid}\n")
    return proc


def test_down_stops_only_the_hosts_its_marker_holds(hosts, monkeypatch) -> None:
    """Another registry's cluster took worker-1 (its marker is there): `down` stops Spark on
    the master only, removes its own marker there, and leaves worker-1's worker and marker."""
    registry.save_entry(_spec(hosts), None)
    me = static.holder("lab")
    other = markers.Holder("other", "f" * 16, "bob@desk:/b", "t1")
    conn = invoke.Context()
    assert markers.take(conn, _node(hosts, "master"), me)[0] == markers.TAKEN
    assert markers.take(conn, _node(hosts, "worker-1"), other)[0] == markers.TAKEN
    mine, theirs = _fake_worker(hosts, "master"), _fake_worker(hosts, "worker-1")
    said: list[str] = []
    try:
        stopped = static.down(_spec(hosts), say=said.append).stopped
        assert stopped == ["master"]
        assert mine.wait(timeout=30) is not None
        assert theirs.poll() is None  # the other cluster's Spark runs on
        assert not (hosts / "master" / markers.MARKER).exists()
        assert markers.Holder.parse((hosts / "worker-1" / markers.MARKER).read_text()) == other
        assert any(
            line.startswith("worker-1: Spark there is not this cluster's, left alone: static "
                            "cluster other of the sparknet registry bob@desk:/b")
            for line in said
        ), said  # fmt: skip
        assert "lab" not in registry.registered()
    finally:
        for proc in (mine, theirs):
            proc.kill()
            proc.wait()


def test_up_of_hosts_another_registry_holds_is_refused_naming_it(hosts, monkeypatch) -> None:
    """`up other` from a second registry (another SPARKNET_HOME: another machine) on hosts that
    cluster lab holds: one line naming lab and its registry, nothing run, nothing kept (the
    free host it took meanwhile is given back, no entry, no lock)."""
    conn = invoke.Context()
    monkeypatch.setattr(spark_nodes, "carry", lambda spec, wheel_dir: None)
    ran: list[str] = []
    monkeypatch.setattr(spark_nodes, "bootstrap_locked", lambda *a, **k: ran.append("bootstrap"))
    lab = static.holder("lab")
    assert markers.take(conn, _node(hosts, "worker-1"), lab)[0] == markers.TAKEN
    monkeypatch.setenv(registry.HOME_ENV, str(hosts / "other-home"))
    with pytest.raises(markers.HostHeld) as err:
        static.up(_spec(hosts, "other"))
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(
        f"{getpass.getuser()}@10.0.0.6:22 (worker-1) is held by static cluster lab of the "
        "sparknet registry "
    )
    assert f"({lab.registry}) since {lab.since}" in line
    assert "`sparknet cluster down lab` where it is registered frees it" in line
    assert ran == []
    assert not (hosts / "master" / markers.MARKER).exists()  # taken, then given back
    assert markers.Holder.parse((hosts / "worker-1" / markers.MARKER).read_text()) == lab
    assert registry.registered() == {}
    assert not (hosts / "other-home" / "clusters" / "other.lock").exists()


def test_two_ups_of_different_names_at_once_cannot_both_register_one_host(
    hosts, monkeypatch
) -> None:
    """The one-cluster-per-host check and the entry's write happen under the registry's lock:
    a second `up` that checks while the first is writing its entry waits, then sees it."""
    real_save = registry.save_entry
    saving, second_done = threading.Event(), threading.Event()

    def slow_save(spec, endpoint_url) -> None:
        if spec.name == "lab":
            saving.set()
            second_done.wait(0.5)  # the old code let the second `up` finish meanwhile
        real_save(spec, endpoint_url)

    monkeypatch.setattr(registry, "save_entry", slow_save)
    first = threading.Thread(target=static.up, args=(_spec(hosts),), kwargs={"bootstrap": False})
    first.start()
    assert saving.wait(10)
    other = _spec(hosts, "other").model_copy(update={"hosts": [HOSTS[1]]})
    started = time.monotonic()
    try:
        with pytest.raises(
            static.HostsChanged, match=r"^10.0.0.6:22 is a host of static cluster lab"
        ):
            static.up(other, bootstrap=False)
    finally:
        second_done.set()
        first.join(10)
    assert time.monotonic() - started >= 0.3  # it waited for the first's entry
    assert sorted(registry.registered()) == ["lab"]
    assert not (hosts / "home" / "clusters" / "other.lock").exists()
