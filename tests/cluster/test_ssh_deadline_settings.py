"""The SSH deadlines' settings and the paths around them that the silent-master work left open:
`cluster ssh`/`tunnel` (the `ssh` binary) end on a silent node as sparknet's own calls do; a wait
setting too large to be a deadline (threading's waits overflow) is refused; a bad setting is one
line, exit 2, before `cluster up` launches anything; an interrupted submit whose cancel cannot
reach the master says the job may run on and how to end it."""

from __future__ import annotations

import contextlib

import pytest

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import nodes, openssh, registry
from sparknet.cluster.address import Endpoint
from sparknet.cluster.nodes import Access
from sparknet.cluster.remote import CommandFailed
from sparknet.cluster.spark import steps
from sparknet.errors import SparknetError
from sparknet.jobs import driver_control, follow, preflight
from sparknet.jobs import submit as flow

SETTINGS = [
    (nodes.SILENCE_ENV, nodes.silence_s),
    (follow.RECONNECT_ENV, follow.reconnect_s),
    (steps.REBOOT_WAIT_ENV, steps.reboot_wait_s),
]


def test_the_ssh_command_ends_on_a_silent_node(tmp_path, monkeypatch):
    """OpenSSH without ServerAliveInterval waits forever on a node that stopped answering (and
    without ConnectTimeout on a listener that never sends its banner)."""
    monkeypatch.setenv(nodes.SILENCE_ENV, "30")
    argv = openssh.ssh_command(Endpoint("master", "10.0.0.5", 22, "ubuntu"), Access(tmp_path / "id",
                             tmp_path / "known_hosts"), "-N")  # fmt: skip
    text = " ".join(argv)
    for option in ("-o ServerAliveInterval=10", "-o ServerAliveCountMax=3",
                   "-o ConnectTimeout=30"):  # fmt: skip
        assert option in text
    assert argv.index("-o") < argv.index("-N") < argv.index("ubuntu@10.0.0.5")


@pytest.mark.parametrize(("env", "read"), SETTINGS)
@pytest.mark.parametrize("value", ["1e11", "1e300", "inf", "nan", "0", "0.001", "-1", "abc"])
def test_a_wait_setting_that_is_no_deadline_is_refused(monkeypatch, env, read, value):
    """1e11 s passed before and killed the keepalive thread (threading's wait overflows) with a
    traceback, leaving the connection unwatched; a silence of 1 ms closed every connection."""
    monkeypatch.setenv(env, value)
    with pytest.raises(
        SparknetError, match=f"^{env}=.*: give a number of seconds from 1 to 86400 \\(a day\\)$"
    ):
        read()


@pytest.mark.parametrize(("env", "read"), SETTINGS)
def test_a_wait_setting_up_to_a_day_is_taken(monkeypatch, env, read):
    monkeypatch.setenv(env, "86400")
    assert read() == 86400.0
    monkeypatch.setenv(env, "1.5")
    assert read() == 1.5


@pytest.mark.parametrize("env", [nodes.SILENCE_ENV, steps.REBOOT_WAIT_ENV])
def test_cluster_up_refuses_a_bad_wait_setting_before_launching(tmp_path, monkeypatch, env):
    from typer.testing import CliRunner

    from sparknet.cli.cluster import cluster_app

    launched = []
    monkeypatch.setattr(aws_provider, "up", lambda spec, **kw: launched.append(spec))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(env, "abc")
    done = CliRunner().invoke(cluster_app, ["up", "c1"])
    assert (done.exit_code, launched) == (2, [])
    assert done.stderr == f"error: {env}='abc': give a number of seconds from 1 to 86400 (a day)\n"


def test_submit_preflight_refuses_a_bad_reboot_wait(monkeypatch):
    """A submit that makes its cluster may reboot a node to load the NVIDIA driver."""
    monkeypatch.setenv(steps.REBOOT_WAIT_ENV, "-1")
    with pytest.raises(preflight.PreflightFailed, match=steps.REBOOT_WAIT_ENV):
        preflight.preflight(object())  # refused before the job is looked at


def test_a_cancel_that_cannot_reach_the_master_says_the_job_may_run_on(monkeypatch):
    """An interrupted submit's cancel failed in silence: the user was told nothing of a driver
    that may hold the cluster's GPUs on."""

    def unreachable(endpoint, access, timeout=20):
        raise SparknetError(f"{endpoint}: no SSH connection within 20 s (timed out)")

    monkeypatch.setattr(nodes, "connect", unreachable)
    master = driver_control.Master.__new__(driver_control.Master)
    object.__setattr__(master, "node", type("N", (), {"endpoint": "master"})())
    object.__setattr__(master, "access", None)
    said: list[str] = []
    flow._cancel_over_a_new_connection(master, "r1", said.append)
    assert said == [
        "could not cancel job r1 (master: no SSH connection within 20 s (timed out)): it may "
        "still run on the master; `sparknet-submit cancel r1` ends it"
    ]


@pytest.mark.parametrize("banner", [b"", b"SSH-2.0-OpenSSH_9.6\r\n"])
def test_a_node_silent_in_the_handshake_is_no_connection_within_the_timeout(tmp_path, banner):
    """A listener that takes the TCP connection (and sends its banner, or not) then says
    nothing: one line naming the unfinished handshake within the timeout (it was "SSH failed
    (No existing session)", which names no cause)."""
    import socket
    import threading
    import time

    held: list[socket.socket] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                peer, _ = listener.accept()
                held.append(peer)
                peer.sendall(banner)

    threading.Thread(target=serve, daemon=True).start()
    (tmp_path / "known_hosts").write_text("")
    endpoint = Endpoint("master", "127.0.0.1", listener.getsockname()[1], "u")
    started = time.monotonic()
    try:
        with pytest.raises(SparknetError) as err:
            nodes.connect(endpoint, Access(tmp_path / "id", tmp_path / "known_hosts"), 1)
    finally:
        listener.close()
        for peer in held:
            peer.close()
    assert time.monotonic() - started < 3
    assert str(err.value).startswith(f"{endpoint}: no SSH connection within 1 s (")
    assert "did not finish the SSH handshake" in str(err.value) or "banner" in str(err.value)


def test_a_second_signal_on_a_submit_that_keeps_its_cluster_does_not_say_it_goes_down():
    """Ctrl-C twice on a --cluster or --keep submit: its note said "still taking the cluster
    down" while the job's cancel ran and the cluster stayed up."""
    from types import SimpleNamespace

    from sparknet.cli.submit import _second_signal_note

    spec = SimpleNamespace(name="gpu")
    for reused, keep in ((True, False), (False, True)):
        note = _second_signal_note(SimpleNamespace(spec=spec, reused=reused, keep=keep))
        assert "taking the cluster down" not in note
        assert note.startswith("still cancelling the job") and "cluster gpu stays up" in note
    made = _second_signal_note(SimpleNamespace(spec=spec, reused=False, keep=False))
    assert made == "still cancelling the job and taking the cluster down; it ends by itself"


def test_a_node_lost_again_after_its_reboot_is_not_a_driver_that_does_not_load(monkeypatch):
    """A node that rebooted for its NVIDIA driver, answered, and went away again (a second
    reboot, a dropped link) under the nvidia-smi check: it was told as a driver that does not
    load ("launch it from an image with the driver"), the wrong advice."""
    from pathlib import Path
    from types import SimpleNamespace

    from sparknet.cluster.spark.plan import Context, Facts, Node, Plan
    from sparknet.cluster.spark.steps import NvidiaDriver
    from sparknet.cluster.spark.wheel import Wheel

    class Conn:
        rebooted = False

        def run(self, command, **_kw):
            if command == "nvidia-smi -L":
                if self.rebooted:
                    raise OSError("Connection reset by peer")
                return SimpleNamespace(exited=9, stdout="", stderr="no driver")
            if command.startswith("dpkg-query"):  # the branch ubuntu-drivers installed
                out = "ii  nvidia-headless-no-dkms-550-server\n"
                return SimpleNamespace(exited=0, stdout=out, stderr="")
            if "0x10de" in command:  # no NVSwitch
                return SimpleNamespace(exited=1, stdout="", stderr="")
            return SimpleNamespace(exited=0, stdout="", stderr="")

    node = Node(Endpoint("master", "h"), gpus=1)
    facts = Facts("ubuntu", 1000, 8, 1 << 24, True, ())
    step = NvidiaDriver(Context(Plan((node,), Wheel(Path("w.whl"), "1", "d"), "s"), node, facts))
    monkeypatch.setattr(step, "reboot", lambda conn: setattr(conn, "rebooted", True))
    with pytest.raises(CommandFailed) as err:
        step.apply(Conn())
    assert err.value.what.startswith(
        "the node rebooted to load the NVIDIA driver and answered, then its SSH connection was "
        "lost before nvidia-smi could be checked (SSH connection lost ("
    )
    assert "does not load" not in err.value.what


def test_a_node_silent_at_the_login_is_not_a_refused_login(tmp_path):
    """A node that finishes the handshake with its pinned key and then leaves the login
    unanswered (at boot: its PAM or logind not up yet) was "login refused for key ...; check
    key_file", and a rebooted node's wait gave up at once; it is a node that does not serve
    yet: tried again until the timeout, and named as silent."""
    import socket
    import subprocess
    import threading
    import time

    import paramiko

    for name in ("host", "id"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)],
            check=True,
        )
    host_key = paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "host"))
    release = threading.Event()

    class Silent(paramiko.ServerInterface):
        def get_allowed_auths(self, username):
            return "publickey"

        def check_auth_publickey(self, username, key):
            release.wait(10)  # no answer while the client waits
            return paramiko.AUTH_FAILED

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    transports: list[paramiko.Transport] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                peer, _ = listener.accept()
                transport = paramiko.Transport(peer)
                transport.add_server_key(host_key)
                transports.append(transport)
                transport.start_server(server=Silent())

    threading.Thread(target=serve, daemon=True).start()
    public = (tmp_path / "host.pub").read_text().split()
    (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{port} {public[0]} {public[1]}\n")
    endpoint = Endpoint("master", "127.0.0.1", port, "u")
    started = time.monotonic()
    try:
        with pytest.raises(SparknetError) as err:
            nodes.connect(endpoint, Access(tmp_path / "id", tmp_path / "known_hosts"), 1.5)
    finally:
        release.set()
        listener.close()
        for transport in transports:
            transport.close()
    assert time.monotonic() - started < 4
    assert str(err.value).startswith(
        f"{endpoint}: no SSH connection within 1.5 s (the node did not answer the login in time"
    )


def test_a_cancel_that_finds_nothing_running_says_so(monkeypatch):
    """An interrupt before the driver started (or after it ended): the submitter said it was
    "waiting for its driver to stop" and then nothing."""

    class Conn:
        def close(self):
            pass

    monkeypatch.setattr(nodes, "connect", lambda endpoint, access, timeout=20: Conn())
    monkeypatch.setattr(flow, "cancel_job", lambda conn, node, run_id, wait_s=None: False)
    master = driver_control.Master.__new__(driver_control.Master)
    object.__setattr__(master, "node", type("N", (), {"endpoint": "master"})())
    object.__setattr__(master, "access", None)
    said: list[str] = []
    flow._cancel_over_a_new_connection(master, "r1", said.append)
    assert said == [
        "cancelling job r1: waiting for its driver to stop",
        "job r1: nothing of it runs on the master",
    ]
