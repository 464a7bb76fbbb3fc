"""SSH to nodes over a real sshd on 127.0.0.1 (tests/sshd.py): pinned host keys, refusals of an
unknown or changed host key, and one function on all nodes at once."""

from __future__ import annotations

import time

import pytest

from sparknet.cluster import nodes
from sparknet.cluster.nodes import Access, Endpoint
from sparknet.errors import SparknetError


def test_a_pinned_node_runs_a_command(sshd_nodes):
    group = sshd_nodes(1)
    conn = nodes.connect(group.endpoints[0], group.access, timeout=10)
    try:
        assert conn.run("echo hi", hide=True).stdout == "hi\n"
    finally:
        conn.close()


def test_an_unknown_host_is_refused_in_one_line(sshd_nodes):
    group = sshd_nodes(1, pin=False)
    endpoint = group.endpoints[0]
    with pytest.raises(SparknetError) as caught:
        nodes.connect(endpoint, group.access, timeout=10)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("master (")
    assert f"no host key pinned for [127.0.0.1]:{endpoint.port}" in message
    # nothing was added to the known_hosts behind the user's back (AutoAddPolicy would)
    assert not group.access.known_hosts.exists()


def test_a_changed_host_key_is_refused_in_one_line(sshd_nodes):
    group = sshd_nodes(1)
    endpoint = group.endpoints[0]
    # the pin is another key than the one the node serves: a replaced or impersonated node
    _, other_public = nodes.new_ed25519()
    nodes.pin(group.access.known_hosts, {endpoint.address: other_public})
    with pytest.raises(SparknetError) as caught:
        nodes.connect(endpoint, group.access, timeout=10)
    message = str(caught.value)
    assert "\n" not in message
    assert "master (" in message and "host key changed" in message
    assert str(group.access.known_hosts) in message
    # the pin stays what it was
    assert other_public.split()[1] in group.access.known_hosts.read_text()


def test_a_wrong_client_key_is_refused_in_one_line(sshd_nodes, tmp_path):
    group = sshd_nodes(1)
    stranger = tmp_path / "stranger"
    nodes.write_private_key(stranger, nodes.new_ed25519()[0])
    access = Access(stranger, group.access.known_hosts)
    with pytest.raises(SparknetError, match=r"^master \(.*login refused for key"):
        nodes.connect(group.endpoints[0], access, timeout=10)


def test_a_node_that_does_not_listen_fails_after_the_timeout(sshd_nodes):
    from tests.sshd import free_port

    group = sshd_nodes(1)
    endpoint = Endpoint("worker-3", "127.0.0.1", free_port(), group.endpoints[0].user)
    start = time.monotonic()
    with pytest.raises(SparknetError, match=r"^worker-3 \(.*no SSH connection within 2 s"):
        nodes.connect(endpoint, group.access, timeout=2)
    assert 1.5 < time.monotonic() - start < 10


def test_run_all_runs_on_every_node_at_once(sshd_nodes):
    group = sshd_nodes(3)

    def where(endpoint: Endpoint, conn) -> str:
        return conn.run(f"sleep 1; echo {endpoint.name}", hide=True).stdout.strip()

    start = time.monotonic()
    out = nodes.run_all(group.endpoints, group.access, where, timeout=30)
    assert out == {"master": "master", "worker-1": "worker-1", "worker-2": "worker-2"}
    assert time.monotonic() - start < 2.9  # in parallel, not 3 s one after the other


def test_run_all_names_each_failed_node(sshd_nodes):
    group = sshd_nodes(3)
    # worker-2's host key is not the pinned one
    _, other_public = nodes.new_ed25519()
    nodes.pin(group.access.known_hosts, {group.endpoints[2].address: other_public})

    def step(endpoint: Endpoint, conn) -> str:
        code = 3 if endpoint.name == "worker-1" else 0
        return conn.run(f"echo broken >&2; exit {code}", hide=True).stdout

    with pytest.raises(nodes.NodesFailed) as caught:
        nodes.run_all(group.endpoints, group.access, step, timeout=30)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("2 of 3 nodes failed: ")
    assert "worker-1: `echo broken >&2; exit 3` exited 3: broken" in message
    assert "worker-2 (" in message and "host key changed" in message
    assert "master" not in message
    assert sorted(caught.value.failures) == ["worker-1", "worker-2"]


def test_run_all_times_out_naming_the_busy_node(sshd_nodes):
    group = sshd_nodes(2)

    def step(endpoint: Endpoint, conn) -> None:
        conn.run("sleep 30" if endpoint.name == "worker-1" else "true", hide=True)

    start = time.monotonic()
    with pytest.raises(nodes.NodesFailed, match=r"^1 of 2 nodes failed: worker-1: still running"):
        nodes.run_all(group.endpoints, group.access, step, timeout=3)
    assert time.monotonic() - start < 10
