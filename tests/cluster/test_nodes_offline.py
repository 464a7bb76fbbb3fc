"""nodes.py, node_endpoints.py, sshkeys.py and openssh.py without a network.

Addresses, node names, the seam's override file, the cloud-init host key, known_hosts pinning,
key rules, and the `ssh` command line."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from pydantic import ValidationError

from sparknet.cli.cluster.ssh import _split_command
from sparknet.cluster import address, node_endpoints, nodes, openssh, sshkeys
from sparknet.cluster.address import Endpoint
from sparknet.cluster.aws import keys
from sparknet.cluster.aws.instances import Instance
from sparknet.cluster.nodes import Access
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def inst(iid: str, role: str, ip: str | None = "198.51.100.1", minutes: int = 0) -> Instance:
    return Instance(iid, role, "g5.xlarge", "us-east-1a", "10.0.0.1", ip, False,
                    T0 + timedelta(minutes=minutes))  # fmt: skip


def test_parse_address_takes_user_host_and_port():
    assert address.parse_address("worker-1", "root@10.1.2.3:2222") == Endpoint(
        "worker-1", "10.1.2.3", 2222, "root"
    )
    assert address.parse_address("master", "box.example.com") == Endpoint(
        "master", "box.example.com", 22, "ubuntu"
    )
    assert address.parse_address("m", "ubuntu@ip-10-0-0-5.ec2.internal").host == (
        "ip-10-0-0-5.ec2.internal"
    )
    assert address.parse_address("m", "node7:2201").host == "node7"
    for bad in ("root@", "a@b@c", "host:0", "host:70000", "host:port", "two words"):
        with pytest.raises(SparknetError, match="is not an SSH address"):
            address.parse_address("master", bad)


@pytest.mark.parametrize(
    "bad",
    [
        "-oProxyCommand=x",  # an ssh option where the host goes
        "root@-oProxyCommand=x:22",
        "a;b",
        "$(id)",
        "`id`",
        "h\x00",
        "h\nx",
        "host_1",
        "-host",
        "host-",
        "a..b",
        ".host",
        "host.",
        "a" * 64 + ".com",  # a label of 64
        ".".join(["a" * 63] * 4) + "x",  # 256 characters
        "256.1.1.1",  # all digits and dots: an IPv4 address or nothing
        "10.0.0",
        "01.2.3.4",
        "[host]:22",
    ],
)
def test_parse_address_takes_only_an_ipv4_address_or_a_host_name(bad):
    with pytest.raises(SparknetError) as caught:
        address.parse_address("worker-2", bad)
    assert str(caught.value) == f"worker-2: {bad!r} is not an SSH address (user@host:port)"
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("text", ["::1", "[::1]:22", "root@[fe80::1]", "2001:db8::7", "[::1]"])
def test_an_ipv6_address_is_refused_as_such(text):
    with pytest.raises(SparknetError) as caught:
        address.parse_address("master", text)
    assert str(caught.value) == (
        f"master: {text!r}: IPv6 addresses are not supported (give an IPv4 address or a host name)"
    )


def test_endpoint_address_is_known_hosts_form():
    assert Endpoint("m", "10.0.0.1").address == "10.0.0.1"
    assert Endpoint("m", "127.0.0.1", 2222).address == "[127.0.0.1]:2222"


def test_workers_are_named_by_launch_time_then_id():
    found = [inst("i-c", "worker", minutes=1), inst("i-b", "worker"), inst("i-a", "worker"),
             inst("i-m", "master", minutes=5)]  # fmt: skip
    named = [(name, i.id) for name, i in node_endpoints.node_names(found)]
    assert named == [("master", "i-m"), ("worker-1", "i-a"), ("worker-2", "i-b"),
                     ("worker-3", "i-c")]  # fmt: skip


def test_the_seam_is_the_public_ip_unless_the_override_file_names_the_node(tmp_path, monkeypatch):
    found = [inst("i-m", "master", "198.51.100.7"), inst("i-w", "worker", "198.51.100.8")]
    monkeypatch.delenv(node_endpoints.ENDPOINTS_ENV, raising=False)
    assert node_endpoints.endpoints("c1", found) == [
        Endpoint("master", "198.51.100.7"),
        Endpoint("worker-1", "198.51.100.8"),
    ]
    override = tmp_path / "endpoints.json"
    override.write_text(json.dumps({"c1/worker-1": "root@127.0.0.1:2201", "i-m": "127.0.0.1:2200"}))
    monkeypatch.setenv(node_endpoints.ENDPOINTS_ENV, str(override))
    assert node_endpoints.endpoints("c1", found) == [
        Endpoint("master", "127.0.0.1", 2200, "ubuntu"),
        Endpoint("worker-1", "127.0.0.1", 2201, "root"),
    ]
    # another cluster's entries do not apply
    assert node_endpoints.endpoints("c2", found)[1] == Endpoint("worker-1", "198.51.100.8")


def test_a_node_without_a_public_ip_is_one_line(monkeypatch):
    monkeypatch.delenv(node_endpoints.ENDPOINTS_ENV, raising=False)
    with pytest.raises(SparknetError, match=r"^master \(i-m, running\) has no public IP address"):
        node_endpoints.endpoints("c1", [inst("i-m", "master", None)])


def test_pick_names_the_nodes_there_are():
    found = [Endpoint("master", "h"), Endpoint("worker-1", "h")]
    assert node_endpoints.pick(found, "worker-1") is found[1]
    with pytest.raises(SparknetError, match=r"^no node 'worker-2'; the cluster's nodes: master"):
        node_endpoints.pick(found, "worker-2")
    with pytest.raises(SparknetError, match=r"^no node 'mastr' \(master or worker-N\)"):
        node_endpoints.pick(found, "mastr")


def test_a_pending_worker_keeps_no_one_from_the_master(monkeypatch):
    """`cluster ssh` picks its node before it asks for an address: a worker still pending (no
    public IP yet) is an error only for a user who asks for that worker."""
    monkeypatch.delenv(node_endpoints.ENDPOINTS_ENV, raising=False)
    found = [inst("i-m", "master"), inst("i-w", "worker", None, minutes=1)]
    assert node_endpoints.endpoint_named("c1", found, "master") == Endpoint(
        "master", "198.51.100.1"
    )
    with pytest.raises(SparknetError, match=r"^worker-1 \(i-w, running\) has no public IP"):
        node_endpoints.endpoint_named("c1", found, "worker-1")
    with pytest.raises(SparknetError, match=r"^no node 'worker-2'; the cluster's nodes: master, "):
        node_endpoints.endpoint_named("c1", found, "worker-2")


def test_pinning_skips_a_node_with_no_address_yet(monkeypatch, tmp_path):
    """A stand-in for EC2's DescribeInstanceAttribute (the user data of each instance): what
    is checked here is which nodes get pinned, not EC2."""
    import base64
    from types import SimpleNamespace

    monkeypatch.delenv(node_endpoints.ENDPOINTS_ENV, raising=False)
    text, public = keys.host_key_user_data(60)
    data = {"Value": base64.b64encode(text.encode()).decode()}
    ec2 = SimpleNamespace(
        meta=SimpleNamespace(region_name="us-east-1"),
        describe_instance_attribute=lambda **kw: {"UserData": data},
    )
    found = [inst("i-m", "master"), inst("i-w", "worker", None, minutes=1)]
    assert keys.pin_cluster(ec2, "c1", found, tmp_path / "known_hosts") == []
    assert (tmp_path / "known_hosts").read_text() == f"198.51.100.1 {public}\n"


def test_host_key_user_data_is_cloud_config_with_only_that_key():
    text, public = keys.host_key_user_data(60)
    assert text.startswith("#cloud-config\n")
    config = yaml.safe_load(text)
    assert config["ssh_deletekeys"] is True and "ssh_genkeytypes" not in config
    assert config["ssh_keys"]["ed25519_public"] == public and public.startswith("ssh-ed25519 ")
    assert config["ssh_keys"]["ed25519_private"].startswith("-----BEGIN OPENSSH PRIVATE KEY")
    assert keys.host_public_key(text) == public
    assert len(text.encode()) < 16 * 1024  # EC2's user data limit
    # two calls, two keys
    assert keys.host_key_user_data(60)[1] != public


def test_user_data_without_a_host_key_has_none():
    assert keys.host_public_key("") is None
    assert keys.host_public_key("#!/bin/sh\necho hi\n") is None
    assert keys.host_public_key("#cloud-config\npackages: [git]\n") is None
    assert keys.host_public_key("#cloud-config\n: [\n") is None


def test_pin_replaces_an_address_and_keeps_the_others(tmp_path):
    known = tmp_path / "known_hosts"
    a, b, c = (sshkeys.new_ed25519()[1] for _ in range(3))
    sshkeys.pin(known, {"10.0.0.1": a, "[127.0.0.1]:2222": b})
    sshkeys.pin(known, {"10.0.0.1": c})
    lines = known.read_text().splitlines()
    assert lines == [f"[127.0.0.1]:2222 {b}", f"10.0.0.1 {c}"]
    sshkeys.pin(known, {"10.0.0.9": a}, only=True)
    assert known.read_text().splitlines() == [f"10.0.0.9 {a}"]


def test_a_private_key_is_0600_from_the_start(tmp_path):
    path = tmp_path / "d" / "id_ed25519"
    sshkeys.write_private_key(path, sshkeys.new_ed25519()[0])
    assert path.stat().st_mode & 0o777 == 0o600
    sshkeys.check_key_file(Access(path, tmp_path / "kh"))
    path.chmod(0o644)
    with pytest.raises(SparknetError, match=r"readable by others \(mode 644\); chmod 600"):
        sshkeys.check_key_file(Access(path, tmp_path / "kh"))
    with pytest.raises(SparknetError, match="cannot be read"):
        sshkeys.check_key_file(Access(tmp_path / "missing", tmp_path / "kh"))


def private_key(kind: str, password: bytes | None = None, fmt: str = "OpenSSH") -> str:
    """A private key of `kind` as ssh-keygen writes it (OpenSSH format, or PEM), encrypted
    with `password` when given."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    key = {
        "ed25519": ed25519.Ed25519PrivateKey.generate,
        "ecdsa": lambda: ec.generate_private_key(ec.SECP256R1()),
        "rsa": lambda: rsa.generate_private_key(65537, 2048),
    }[kind]()
    crypt = ser.BestAvailableEncryption(password) if password else ser.NoEncryption()
    form = getattr(ser.PrivateFormat, fmt)
    return key.private_bytes(ser.Encoding.PEM, form, crypt).decode("ascii")


@pytest.mark.parametrize(
    ("kind", "fmt"),
    [("ed25519", "OpenSSH"), ("ecdsa", "OpenSSH"), ("rsa", "OpenSSH"),
     ("rsa", "TraditionalOpenSSL"), ("ecdsa", "TraditionalOpenSSL")],
)  # fmt: skip
def test_a_key_file_is_loaded_and_one_with_a_passphrase_is_one_line(tmp_path, kind, fmt):
    """sparknet uses no SSH agent: a key it cannot open by itself would fail at every node
    later, with paramiko's words; it is refused before any node is asked, saying what to do."""
    path = tmp_path / "id"
    sshkeys.write_private_key(path, private_key(kind, fmt=fmt))
    sshkeys.check_key_file(Access(path, tmp_path / "kh"))
    sshkeys.write_private_key(path, private_key(kind, b"correct horse", fmt))
    with pytest.raises(SparknetError) as caught:
        sshkeys.check_key_file(Access(path, tmp_path / "kh"))
    assert str(caught.value) == (
        f"key file {path} is protected by a passphrase, and sparknet uses no SSH agent: give a "
        "key without a passphrase (e.g. one made for the cluster)"
    )


@pytest.mark.parametrize(
    "text", ["", "hello\n", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA me@host\n", "\x00\xff"]
)
def test_a_key_file_that_is_not_a_private_key_is_one_line(tmp_path, text):
    path = tmp_path / "id.pub"
    sshkeys.write_private_key(path, text)
    with pytest.raises(SparknetError) as caught:
        sshkeys.check_key_file(Access(path, tmp_path / "kh"))
    assert str(caught.value) == (
        f"key file {path} is not an ed25519, ECDSA or RSA private key; set key_file to the "
        "private key (not its .pub)"
    )


def test_key_pair_names_follow_ec2s_rule():
    assert keys.key_pair_name("c1") == "sparknet-c1"
    assert keys.check_key_name("k" * 255) == "k" * 255
    for bad in ("", "k" * 256, "schlüssel"):
        with pytest.raises(SparknetError, match="1-255 ASCII"):
            keys.check_key_name(bad)


def test_key_name_and_key_file_go_together():
    ClusterSpec(name="c1", key_name="mine", key_file="~/.ssh/mine")
    for half in ({"key_name": "mine"}, {"key_file": "~/.ssh/mine"}):
        with pytest.raises(ValidationError, match="key_name and key_file go together"):
            ClusterSpec(name="c1", **half)
    with pytest.raises(ValidationError, match="1-255 ASCII"):
        ClusterSpec(name="c1", key_name="k" * 256, key_file="f")


def test_access_is_the_users_key_file_or_sparknets(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKNET_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    own = sshkeys.access_for(ClusterSpec(name="c1", key_name="mine", key_file="~/.ssh/mine"))
    assert own.key_file == tmp_path / "me" / ".ssh" / "mine"
    made = sshkeys.access_for(ClusterSpec(name="c1"))
    assert made.key_file == tmp_path / "clusters" / "c1" / "id_ed25519"
    assert made.known_hosts == own.known_hosts == tmp_path / "clusters" / "c1" / "known_hosts"


def test_the_ssh_command_trusts_only_the_clusters_key_and_pins(tmp_path):
    known_hosts = tmp_path / "my registry" / "known_hosts"  # a space: quoted for OpenSSH
    access = Access(tmp_path / "id", known_hosts)
    argv = openssh.ssh_command(Endpoint("worker-1", "10.0.0.5", 2222, "root"), access, "-N")
    text = " ".join(argv)
    assert argv[0] == "ssh" and argv[-1] == "root@10.0.0.5"
    for option in ("-F none", f"-i {tmp_path / 'id'}", "-o StrictHostKeyChecking=yes",
                   f'-o UserKnownHostsFile="{known_hosts}"', "-o IdentitiesOnly=yes",
                   "-o GlobalKnownHostsFile=/dev/null", "-p 2222 -N"):  # fmt: skip
        assert option in text


def test_cluster_ssh_splits_node_and_command():
    assert _split_command([]) == ("master", [], {})
    assert _split_command(["worker-2"]) == ("worker-2", [], {})
    assert _split_command(["--", "echo", "hi"]) == ("master", ["echo", "hi"], {})
    assert _split_command(["worker-1", "--", "ls", "--", "-l"]) == (
        "worker-1", ["ls", "--", "-l"], {}
    )  # fmt: skip
    assert _split_command(["--region", "eu-west-1", "worker-1", "--debug", "--", "ls", "-l"]) == (
        "worker-1", ["ls", "-l"], {"--region": "eu-west-1", "--debug": ""}
    )  # fmt: skip
    with pytest.raises(SparknetError, match=r"^--region needs a value$"):
        _split_command(["--region", "--", "ls"])
    with pytest.raises(SparknetError, match=r"put the command after `--`"):
        _split_command(["master", "uptime"])


def test_the_users_fabric_yaml_is_not_read(tmp_path, monkeypatch):
    """A ~/.fabric.yaml asking for agent forwarding and a gateway changes no connection: the
    cluster's nodes are reached directly, with the user's agent nowhere near them."""
    (tmp_path / ".fabric.yaml").write_text(
        "forward_agent: true\ngateway: evil@203.0.113.66\nuser: mallory\n"
        "connect_kwargs:\n  allow_agent: true\n"
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    access = Access(tmp_path / "id_ed25519", tmp_path / "known_hosts")
    conn = nodes.connection(Endpoint("master", "127.0.0.1", 2222), access)
    assert conn.forward_agent is False
    assert conn.gateway is None
    assert conn.user == "ubuntu"
    assert conn.connect_kwargs["allow_agent"] is False


def test_concurrent_pins_and_key_writes_do_not_collide(tmp_path):
    """Two threads pinning (and writing a key) at once, 50 times each: no crash on a shared
    temporary file, and the files end whole (one address per line, the key 0600)."""
    import sys
    import threading

    known_hosts, key = tmp_path / "known_hosts", tmp_path / "id_ed25519"
    _, public = sshkeys.new_ed25519()
    private = sshkeys.new_ed25519()[0]
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(50):
                sshkeys.pin(known_hosts, {f"[127.0.0.1]:{1000 * k + i}": public})
                sshkeys.write_private_key(key, private)
        except BaseException as exc:  # any error is the failure reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in (1, 2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the race shows in 50 rounds
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    lines = known_hosts.read_text().splitlines()
    assert lines and all(line.endswith(" ".join(public.split()[:2])) for line in lines)
    assert len({line.split()[0] for line in lines}) == len(lines)
    assert key.read_text() == private and key.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id_ed25519", "known_hosts"]
