"""The static provider's trust: each host's keys come from the user's known_hosts (plain or
hashed entries, a port other than 22 as ``[host]:port``) into the cluster's own, and a host
with no key there is refused, in one line, before anything connects."""

from __future__ import annotations

import getpass
from pathlib import Path

import paramiko
import pytest

from sparknet.cluster import registry, sshkeys, static
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    key = tmp_path / "id"
    sshkeys.write_private_key(key, sshkeys.new_ed25519()[0])
    return tmp_path


def _spec(home, hosts, known_hosts) -> ClusterSpec:
    return ClusterSpec(
        name="onprem", provider="static", hosts=hosts, key_file=str(home / "id"),
        known_hosts=str(known_hosts),
    )  # fmt: skip


def _key() -> tuple[str, str]:
    """(key type, base64) of a fresh ed25519 public key."""
    kind, blob = sshkeys.new_ed25519()[1].split()[:2]
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
    assert "`ssh -F none -p 2222 " in line
    assert registry.registered() == {}  # no registry entry, no lock
    assert not list((home / "home" / "clusters").glob("*.lock"))
    assert sshkeys.access_for(spec).known_hosts.read_text() == f"10.0.0.5 {a[0]} {a[1]}\n"


def test_an_unreadable_known_hosts_is_one_line(home) -> None:
    spec = _spec(home, ["10.0.0.5"], home / "missing")
    with pytest.raises(SparknetError, match=r"cannot read the hosts' keys from .*missing"):
        static.access(spec)


def test_a_key_file_others_can_read_is_refused_first(home) -> None:
    (home / "id").chmod(0o644)
    with pytest.raises(SparknetError, match="readable by others"):
        static.access(_spec(home, ["10.0.0.5"], home / "missing"))


def test_cert_authority_revoked_and_broken_lines_are_read_as_openssh_reads_them(home) -> None:
    """An enterprise known_hosts: a CA line (not a host key), a revoked key (trusted for no
    host, though a plain line lists it too), and lines paramiko cannot parse: none may crash
    or add trust."""
    good, bad, ca = _key(), _key(), _key()
    source = home / "known_hosts"
    source.write_text(
        f"@cert-authority *.corp.example {ca[0]} {ca[1]}\n"
        f"10.0.0.5 {good[0]} {good[1]}\n"
        f"10.0.0.6 {bad[0]} {bad[1]}\n"
        f"@revoked * {bad[0]} {bad[1]}\n"
        "10.0.0.7 ssh-ed25519 not-base64!!\n"
        "just-one-field\n"
    )
    access = static.access(_spec(home, ["10.0.0.5"], source))
    assert access.known_hosts.read_text() == f"10.0.0.5 {good[0]} {good[1]}\n"
    with pytest.raises(SparknetError, match=r"^no host key for worker-1 \(.*@10.0.0.6:22\)"):
        static.access(_spec(home, ["10.0.0.5", "10.0.0.6"], source))
    # the refusal leaves the cluster's file with the keys that were found, nothing stale
    assert access.known_hosts.read_text() == f"10.0.0.5 {good[0]} {good[1]}\n"


def test_the_default_trust_is_openssh_own_files(home, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(home))
    spec = ClusterSpec(
        name="onprem", provider="static", hosts=["10.0.0.5"], key_file=str(home / "id")
    )
    assert static.trusted_keys_files(spec) == [
        home / ".ssh" / "known_hosts",
        Path("/etc/ssh/ssh_known_hosts"),
    ]
    with pytest.raises(SparknetError) as err:  # neither file has the host: one line, no crash
        static.access(spec)
    assert "`ssh -F none -p 22 " in str(err.value)


def test_a_host_of_another_static_cluster_is_refused(home) -> None:
    a = _key()
    source = home / "known_hosts"
    source.write_text(f"10.0.0.5 {a[0]} {a[1]}\n10.0.0.6 {a[0]} {a[1]}\n")
    registry.save_entry(_spec(home, ["10.0.0.5"], source), None)
    other = _spec(home, ["10.0.0.6", "root@10.0.0.5:22"], source).model_copy(update={"name": "lab"})
    with pytest.raises(static.HostsChanged, match=r"^10.0.0.5:22 is a host of static cluster"):
        static.up(other)


def test_settings_paths_are_relative_to_the_settings_file_and_providers_do_not_mix(
    home, monkeypatch
) -> None:
    from sparknet.cli.cluster.options import cluster_spec

    settings = home / "conf" / "sparknet.yaml"
    settings.parent.mkdir()
    settings.write_text(
        "clusters:\n  onprem:\n    provider: static\n    hosts: [10.0.0.5]\n"
        "    key_file: keys/id\n    known_hosts: ../kh\n"
    )
    monkeypatch.chdir("/")
    spec = cluster_spec("onprem", settings, {})
    assert spec.key_file == str(home / "conf" / "keys" / "id")
    assert spec.known_hosts == str(home / "kh")
    # an EC2 cluster registered under the name: the settings' static one is refused
    registry.save_entry(ClusterSpec(name="onprem"), None)
    mixed = r"registered here as an EC2 cluster \(provider: aws\), but .* says provider: static"
    with pytest.raises(SparknetError, match=mixed):
        cluster_spec("onprem", settings, {})


def test_no_driver_is_installed_on_a_machine_of_the_users() -> None:
    """A static host that should offer GPUs but whose nvidia-smi fails: the step stops with one
    line and runs nothing (an EC2 node of sparknet's would get the driver)."""
    from sparknet.cluster.address import Endpoint
    from sparknet.cluster.remote import CommandFailed
    from sparknet.cluster.spark.plan import Context, Facts, Node, Plan
    from sparknet.cluster.spark.steps import NvidiaDriver
    from sparknet.cluster.spark.wheel import Wheel

    class Refusing:
        def __init__(self) -> None:
            self.commands: list[str] = []

        def run(self, command: str, **kwargs):
            self.commands.append(command)
            raise AssertionError("no command may run")

    node = Node(Endpoint("master", "10.0.0.5"), gpus=2)
    plan = Plan((node,), Wheel(Path("w.whl"), "1", "d"), "s" * 32, install_drivers=False)
    ctx = Context(plan, node, Facts("alice", 1000, 8, 32 * 1024 * 1024, False, ()))
    conn = Refusing()
    with pytest.raises(
        CommandFailed,
        match=r"should offer 2 GPUs but `nvidia-smi -L` fails \(or the node has NVSwitches ",
    ):
        NvidiaDriver(ctx).apply(conn)
    assert conn.commands == []
