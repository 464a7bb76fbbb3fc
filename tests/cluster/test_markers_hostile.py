"""A static host's marker against what another local user of the host, or a hand, leaves in
the install prefix: a symbolic link where the marker's temp file or its lock goes is never
written through, the lock is the login user's alone, and a marker that does not read keeps the
cluster registered on `down`. The marker's shell runs for real in a local shell, as in
test_markers.py."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import invoke
import pytest

from sparknet.cluster import markers, registry, spark_nodes, static
from sparknet.cluster.address import Endpoint
from sparknet.cluster.remote import CommandFailed
from sparknet.cluster.spark.plan import Node
from sparknet.errors import InputError
from tests.cluster.test_markers import _spec, hosts  # noqa: F401

ME = markers.Holder("lab", "a" * 16, "alice@laptop:/home/alice/.sparknet/clusters", "t0")


def _node(root: Path) -> Node:
    (root / "master").mkdir(exist_ok=True)
    return Node(Endpoint("master", "10.0.0.5"), prefix=str(root / "master"))


def _victim(root: Path) -> Path:
    victim = root / "victim"
    victim.write_text("the user's own file\n")
    return victim


def test_a_link_at_the_markers_temp_file_is_not_written_through(tmp_path) -> None:
    node, victim = _node(tmp_path), _victim(tmp_path)
    os.symlink(victim, tmp_path / "master" / f"{markers.MARKER}.new")
    assert markers.take(invoke.Context(), node, ME) == (markers.TAKEN, None)
    assert victim.read_text() == "the user's own file\n"
    marker = tmp_path / "master" / markers.MARKER
    assert not marker.is_symlink() and markers.Holder.parse(marker.read_text()) == ME
    assert stat.S_IMODE(marker.stat().st_mode) == 0o644  # others are told whose host it is


@pytest.mark.parametrize("dangling", [False, True])
def test_a_link_in_the_locks_place_is_refused(tmp_path, dangling) -> None:
    node, victim = _node(tmp_path), _victim(tmp_path)
    if dangling:
        victim.unlink()
    os.symlink(victim, tmp_path / "master" / markers.MARKER_LOCK)
    with pytest.raises(CommandFailed) as err:
        markers.take(invoke.Context(), node, ME)
    assert "is not a plain file (a link, a pipe), not a lock of sparknet's: remove it" in str(
        err.value
    ) + "".join(err.value.tail)
    assert victim.exists() is not dangling
    assert not (tmp_path / "master" / markers.MARKER).exists()


def test_the_lock_is_the_login_users_alone(tmp_path) -> None:
    """A lock others can open, they can hold (flock on a read-only descriptor) and so stall
    every up and down; one left 0644 by an older sparknet is made 0600."""
    node = _node(tmp_path)
    lock = tmp_path / "master" / markers.MARKER_LOCK
    assert markers.take(invoke.Context(), node, ME)[0] == markers.TAKEN
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    lock.chmod(0o644)
    assert markers.take(invoke.Context(), node, ME)[0] == markers.MINE
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_one_machine_listed_twice_is_refused_before_anything_runs(hosts, monkeypatch) -> None:  # noqa: F811
    """`hosts: [127.0.0.1, localhost]`: two spellings, one machine, one install prefix. The
    second node finds the first's marker of its own cluster: refused in one line (exit 2),
    nothing bootstrapped, the marker given back and no entry kept."""
    root = hosts
    one = {"prefix": str(root / "one")}
    (root / "endpoints.json").write_text(
        json.dumps({"lab/master/node": one, "lab/worker-1/node": one})
    )
    monkeypatch.setattr(spark_nodes, "carry", lambda spec, wheel_dir: None)
    ran: list[str] = []
    monkeypatch.setattr(spark_nodes, "bootstrap_locked", lambda *a, **k: ran.append("bootstrap"))
    with pytest.raises(markers.SameMachine) as err:
        static.up(_spec(root))
    line = str(err.value)
    assert isinstance(err.value, InputError) and "\n" not in line
    assert "give each machine once in hosts" in line
    assert ran == []
    assert not (root / "one" / markers.MARKER).exists()
    assert registry.registered() == {}


def _concurrent_run_all(endpoints, access, fn, timeout, **kw):
    """`nodes.run_all` as it runs: every host at once (a local shell each)."""
    from concurrent.futures import ThreadPoolExecutor

    if not endpoints:
        return {}
    with ThreadPoolExecutor(len(endpoints)) as pool:
        futures = {e.name: pool.submit(fn, e, invoke.Context()) for e in endpoints}
    return {name: f.result() for name, f in futures.items()}


def test_of_two_ups_of_the_same_hosts_at_once_one_goes_on(tmp_path, monkeypatch) -> None:
    """Two registries take the same three hosts at the same instant: one holds them all and the
    other is refused; never both refused (each having taken some, then given them back)."""
    from sparknet.cluster import nodes

    monkeypatch.setattr(nodes, "run_all", _concurrent_run_all)
    planned = [
        Node(Endpoint(name, f"10.0.0.{k + 5}"), prefix=str(tmp_path / name))
        for k, name in enumerate(("master", "worker-1", "worker-2"))
    ]
    for attempt in range(12):
        for node in planned:
            (Path(node.prefix) / markers.MARKER).unlink(missing_ok=True)
        outcome: dict[str, str] = {}

        def up(me: markers.Holder, outcome: dict[str, str] = outcome) -> None:
            try:
                markers.take_all(planned, None, me)
                outcome[me.cluster] = "up"
            except markers.HostHeld:
                outcome[me.cluster] = "refused"

        racers = [
            threading.Thread(target=up, args=(markers.Holder(c, c * 16),)) for c in ("a", "b")
        ]
        for t in racers:
            t.start()
        for t in racers:
            t.join(60)
        assert sorted(outcome.values()) == ["refused", "up"], (attempt, outcome)


def test_a_host_that_cannot_be_reached_gives_back_the_hosts_taken(tmp_path, monkeypatch) -> None:
    """worker-1 does not answer: the master, taken a moment before, is given back (a marker
    of an `up` that failed before it began would refuse every other registry's)."""
    from sparknet.cluster import nodes

    def run_all(endpoints, access, fn, timeout, **kw):
        out = {e.name: fn(e, invoke.Context()) for e in endpoints if e.name != "worker-1"}
        if any(e.name == "worker-1" for e in endpoints):
            failures = {"worker-1": OSError("connection refused")}
            raise nodes.NodesFailed(nodes._failed_line(endpoints, failures), failures)
        return out

    monkeypatch.setattr(nodes, "run_all", run_all)
    planned = [
        Node(Endpoint(name, f"10.0.0.{k + 5}"), prefix=str(tmp_path / name))
        for k, name in enumerate(("master", "worker-1"))
    ]
    with pytest.raises(nodes.NodesFailed):
        markers.take_all(planned, None, ME)
    assert not (tmp_path / "master" / markers.MARKER).exists()


def test_a_refusal_says_where_the_marker_is(hosts, monkeypatch) -> None:  # noqa: F811
    """Where the holding registry is gone (a laptop lost, an `up` killed and its home wiped),
    `sparknet cluster down` there cannot free the host: the line names the marker to remove."""
    monkeypatch.setattr(spark_nodes, "carry", lambda spec, wheel_dir: None)
    gone = markers.Holder("lab", "f" * 16, "bob@lost-laptop:/home/bob/.sparknet/clusters", "t1")
    master = Node(Endpoint("master", "10.0.0.5"), prefix=str(hosts / "master"))
    assert markers.take(invoke.Context(), master, gone)[0] == markers.TAKEN
    with pytest.raises(markers.HostHeld) as err:
        static.up(_spec(hosts, "other"))
    assert f"remove {hosts / 'master' / markers.MARKER} on the host once nothing" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_markers_words_cannot_break_the_refusals_one_line(hosts, monkeypatch) -> None:  # noqa: F811
    """A marker is another's text: a line break or a terminal escape in it is not repeated."""
    monkeypatch.setattr(spark_nodes, "carry", lambda spec, wheel_dir: None)
    (hosts / "master").mkdir()
    planted = {"holder": "x/lab", "cluster": "lab\nerror: all good", "registry": "x",
               "where": "\x1b]0;pwned\x07bob@desk:/b"}  # fmt: skip
    (hosts / "master" / markers.MARKER).write_text(json.dumps(planted) + "\n")
    with pytest.raises(markers.HostHeld) as err:
        static.up(_spec(hosts, "other"))
    line = str(err.value)
    assert "\n" not in line and "\x1b" not in line and "\x07" not in line
    assert "static cluster lab?error: all good of the sparknet registry ?]0;pwned?bob@desk" in line


def test_a_pipe_in_the_locks_place_is_refused_not_waited_on(tmp_path) -> None:
    """Opening a pipe to write waits for a reader forever: a pipe is no lock."""
    node = _node(tmp_path)
    os.mkfifo(tmp_path / "master" / markers.MARKER_LOCK, 0o666)
    started = time.monotonic()
    with pytest.raises(CommandFailed):
        markers.take(invoke.Context(), node, ME)
    assert time.monotonic() - started < 10


def test_a_marker_that_is_a_link_or_a_pipe_is_nobodys_to_take_or_follow(tmp_path) -> None:
    """A link in the marker's place (to a file that even holds this cluster's words) is not
    taken for this cluster's, nor written or removed through; a pipe is not read."""
    node, victim = _node(tmp_path), _victim(tmp_path)
    victim.write_text(ME.to_json() + "\n")
    marker = tmp_path / "master" / markers.MARKER
    os.symlink(victim, marker)
    verdict, holder = markers.take(invoke.Context(), node, ME)
    assert verdict == markers.HELD and holder is not None and holder.unread
    markers.release(invoke.Context(), node, ME)
    assert marker.is_symlink() and victim.read_text() == ME.to_json() + "\n"
    marker.unlink()
    os.mkfifo(marker)
    started = time.monotonic()
    assert markers.take(invoke.Context(), node, ME)[0] == markers.HELD
    markers.release(invoke.Context(), node, ME)
    assert time.monotonic() - started < 10
