"""The static provider's trust: each host's keys come from the user's known_hosts (plain or
hashed entries, a port other than 22 as ``[host]:port``) into the cluster's own, and a host
with no key there is refused, in one line, before anything connects."""

from __future__ import annotations

import getpass

import paramiko
import pytest

from sparknet.cluster import lifecycle, nodes, static
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(lifecycle.HOME_ENV, str(tmp_path / "home"))
    key = tmp_path / "id"
    nodes.write_private_key(key, nodes.new_ed25519()[0])
    return tmp_path


def _spec(home, hosts, known_hosts) -> ClusterSpec:
    return ClusterSpec(
        name="onprem", provider="static", hosts=hosts, key_file=str(home / "id"),
        known_hosts=str(known_hosts),
    )  # fmt: skip


def _key() -> tuple[str, str]:
    """(key type, base64) of a fresh ed25519 public key."""
    kind, blob = nodes.new_ed25519()[1].split()[:2]
    return kind, blob


def test_hosts_keys_are_copied_from_plain_and_hashed_entries(home) -> None:
    a, b = _key(), _key()
    hashed = paramiko.HostKeys.hash_host("[10.0.0.6]:2222")
    source = home / "known_hosts"
    source.write_text(
        f"10.0.0.5 {a[0]} {a[1]}\n{hashed} {b[0]} {b[1]}\nother.example {a[0]} {a[1]}\n"
    )
    spec = _spec(home, ["alice@10.0.0.5", "10.0.0.6:2222"], source)
    access = static.access(spec)
    assert access.key_file == home / "id"
    assert sorted(access.known_hosts.read_text().splitlines()) == sorted(
        [f"10.0.0.5 {a[0]} {a[1]}", f"[10.0.0.6]:2222 {b[0]} {b[1]}"]
    )
    master, worker = static.endpoints(spec)
    assert (master.name, master.user, master.port) == ("master", "alice", 22)
    assert (worker.name, worker.user, worker.port) == ("worker-1", getpass.getuser(), 2222)


def test_a_host_without_a_key_is_refused_and_nothing_is_written(home) -> None:
    a = _key()
    source = home / "known_hosts"
    source.write_text(f"10.0.0.5 {a[0]} {a[1]}\n10.0.0.6 {a[0]} {a[1]}\n")
    spec = _spec(home, ["10.0.0.5", "10.0.0.6:2222"], source)  # port 2222 is another entry
    with pytest.raises(SparknetError) as err:
        static.up(spec)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"no host key for worker-1 ({getpass.getuser()}@10.0.0.6:2222) in ")
    assert "ssh -p 2222" in line
    assert not (home / "home").exists()  # no registry entry, no lock, no known_hosts


def test_an_unreadable_known_hosts_is_one_line(home) -> None:
    spec = _spec(home, ["10.0.0.5"], home / "missing")
    with pytest.raises(SparknetError, match=r"cannot read the hosts' keys from .*missing"):
        static.access(spec)


def test_a_key_file_others_can_read_is_refused_first(home) -> None:
    (home / "id").chmod(0o644)
    with pytest.raises(SparknetError, match="readable by others"):
        static.access(_spec(home, ["10.0.0.5"], home / "missing"))
