"""A real OpenSSH server on 127.0.0.1 for the tests: one per "node", each with its own port,
config dir, host key and authorized keys.

The node tests connect over real SSH (paramiko through Fabric, and the `ssh` client), so what
they check (host-key pinning, refusals, exit codes) is what happens against a real machine. The
sshd runs in the foreground (`-D -e`) as a child of the test process and is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparknet.cluster import node_endpoints, sshkeys
from sparknet.cluster.address import Endpoint
from sparknet.cluster.aws import keys
from sparknet.cluster.aws.spot import ENDPOINT_ENV
from sparknet.cluster.nodes import Access
from tests.imds import ImdsStandIn

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
#: sshd refuses to start as root without its privilege separation dir (made by the Debian
#: package's service unit on a real system, absent in a container)
PRIVSEP_DIR = Path("/run/sshd")


@dataclass
class Sshd:
    """One running sshd: where to reach it, its files, and its process."""

    host: str
    port: int
    dir: Path
    proc: subprocess.Popen
    #: the host private key it serves (OpenSSH PEM)
    host_key: Path
    authorized_keys: Path
    user: str = field(default_factory=lambda: os.environ.get("USER") or "root")

    @property
    def log(self) -> Path:
        return self.dir / "sshd.log"

    def stop(self) -> None:
        """Stop it by its PID (and the sessions it forked, which share its process group)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def daemon_pids(root: Path, node_names: Iterable[str]) -> dict[str, int]:
    """The Spark daemons' pids by `<node>/<role>`, from the pid files under each node's install
    prefix (`root/<node>`, as the tests lay nodes out)."""
    out = {}
    for node in node_names:
        for role in ("master", "worker"):
            pid = root / node / "run" / f"{role}.pid"
            if pid.exists():
                out[f"{node}/{role}"] = int(pid.read_text())
    return out


def loopback_cluster_entry(
    region: str, ami_parameter: str, bucket: str | None = None, data_prefix: str = "datasets/"
) -> dict:
    """A `clusters:` entry for a moto cluster of a master and one worker (g5.xlarge, whose GPU
    `plan_nodes` finds) that loopback sshd nodes stand in for: they run over the repo's .venv,
    offer no GPU (`gpus_per_node: 0`) and 1 core and 1 GiB per Spark worker, on free ports.
    With `bucket` (a submit's cluster needs one: its nodes read data and write runs only there),
    the data is under `data_prefix` of it."""
    bucket_settings = {} if bucket is None else {"bucket": bucket, "data_prefix": data_prefix}
    return {
        **bucket_settings,
        "region": region, "workers": 1, "master_type": "g5.xlarge",
        "instance_types": ["g5.xlarge"], "ami_parameter": ami_parameter,
        "allowed_cidr": "203.0.113.9/32",
        "bootstrap": {
            "python_env": str(Path(__file__).resolve().parents[1] / ".venv"), "worker_cores": 1,
            "worker_memory_mb": 1024, "gpus_per_node": 0, "master_port": free_port(),
            "master_ui_port": free_port(), "worker_ui_port": 0,
        },
    }  # fmt: skip


#: every port `free_port` handed out in this process: a port is free from its `free_port` until
#: whatever it was meant for binds it, and two of a test's ports (a master's UI, a node's sshd)
#: must never be the same one
_GIVEN: set[int] = set()


def static_cluster_entry(
    group: SshNodes, name: str, addresses: Mapping[str, str], root: Path, **bootstrap: Any
) -> dict:
    """A `clusters:` entry (without `provider`) for static cluster `name` on `group`'s sshd
    nodes, over the repo's .venv with 1 core and 1 GiB per worker, on free ports (`bootstrap`
    adds settings); and the seam file ``root/endpoints.json`` giving each node its address
    from `addresses` and its install prefix ``root/<node>`` (two nodes on one host need their
    own): point `node_endpoints.ENDPOINTS_ENV` at it."""
    layout = {
        f"{name}/{node}/node": {"address": address, "prefix": str(root / node)}
        for node, address in addresses.items()
    }
    (root / "endpoints.json").write_text(json.dumps(layout))
    return {
        "hosts": [f"{s.user}@{s.host}:{s.port}" for s in group.servers],
        "key_file": str(group.access.key_file),
        "known_hosts": str(group.access.known_hosts),
        "bootstrap": {
            "python_env": str(Path(__file__).resolve().parents[1] / ".venv"), "worker_cores": 1,
            "worker_memory_mb": 1024, "master_port": free_port(), "master_ui_port": free_port(),
            "worker_ui_port": 0, **bootstrap,
        },
    }  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that no earlier call gave."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _config(
    workdir: Path, port: int, host_key: Path, authorized_keys: Path, env: Mapping[str, str]
) -> str:
    return "\n".join(
        [
            "ListenAddress 127.0.0.1",
            f"Port {port}",
            f"HostKey {host_key}",
            f"AuthorizedKeysFile {authorized_keys}",
            f"PidFile {workdir / 'sshd.pid'}",
            "StrictModes no",
            "UsePAM no",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "AllowTcpForwarding yes",
            "X11Forwarding no",
            "PrintMotd no",
            "LogLevel VERBOSE",
            # the tests' PATH (the venv's bin) and JAVA_HOME (tests/jvm.py) for the commands
            # run over SSH, and moto's endpoint and fake credentials where a test has them: the
            # stand-in for an EC2 node's instance role (sshd takes only the first SetEnv line:
            # one line for all)
            "SetEnv " + " ".join(f"{k}={v}" for k, v in {**_session_env(), **env}.items()),
            "",
        ]
    )


#: the AWS settings a node's session gets from the test's environment (see `_config`)
_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def _session_env() -> dict[str, str]:
    # SHLVL=1: bash sources the login user's ~/.bashrc for a command sshd runs only at shell
    # level 1 (this one is then level 2). An EC2 image's stock ~/.bashrc returns at once when not
    # interactive; a developer's may not (one that runs `pyenv init` costs 0.12 CPU-s and some
    # 200 processes per command, a tenth of a cluster test's CPU), and its PATH would not be the
    # test's
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SHLVL": "1"}
    if os.environ.get("JAVA_HOME"):  # the tests' quick JVM flags (tests/jvm.py)
        env["JAVA_HOME"] = os.environ["JAVA_HOME"]
    env.update({k: os.environ[k] for k in _AWS_ENV if os.environ.get(k)})
    return env


def start_sshd(
    workdir: Path,
    host_key_private: str,
    authorized_keys: str,
    *,
    port: int | None = None,
    timeout: float = 20.0,
    env: Mapping[str, str] | None = None,
) -> Sshd:
    """Start an sshd on 127.0.0.1:`port` (a free one when None) serving `host_key_private` (an
    OpenSSH private key) and letting in the public keys in `authorized_keys` (file text); its
    config, keys, pid file and log in `workdir`; its sessions get `env` too. Returns once it
    accepts TCP connections."""
    workdir.mkdir(parents=True, exist_ok=True)
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    host_key = workdir / "ssh_host_ed25519_key"
    host_key.write_text(host_key_private)
    host_key.chmod(0o600)
    auth = workdir / "authorized_keys"
    auth.write_text(authorized_keys)
    for attempt in range(5):
        chosen = port or free_port()
        config = workdir / "sshd_config"
        config.write_text(_config(workdir, chosen, host_key, auth, env or {}))
        with (workdir / "sshd.log").open("w") as log:
            proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        node = Sshd("127.0.0.1", chosen, workdir, proc, host_key, auth)
        try:
            wait_listening(proc, node.log, node.host, chosen, timeout)
            return node
        except PortTaken:
            node.stop()
            if port is not None or attempt == 4:
                raise
        except BaseException:
            node.stop()
            raise
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    """Another process bound the port between `free_port` and sshd (parallel test workers)."""


def wait_listening(
    proc: subprocess.Popen, log: Path, host: str, port: int, timeout: float, who: str = "sshd"
) -> None:
    """Until the sshd `proc` says in `log` that it listens on `host`:`port` (a TCP connect could
    reach another process's sshd that took the port first, and a test would then meet a
    stranger's host key). PortTaken if it exits for the port, a RuntimeError with its log if it
    exits otherwise or does not listen within `timeout` s; `who` names it in those errors."""
    deadline = time.monotonic() + timeout
    listening = f"Server listening on {host} port {port}."
    while True:
        text = log.read_text() if log.exists() else ""
        if proc.poll() is not None:
            if "Address already in use" in text:
                raise PortTaken(f"{who}: port {port} taken: {text}")
            raise RuntimeError(f"{who} exited ({proc.returncode}): {text}")
        if listening in text:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{who} on port {port} did not listen within {timeout} s: {text}")
        time.sleep(0.05)


@dataclass
class SshNodes:
    """Several sshd "nodes" that one client key logs in to, with their host keys pinned in one
    known_hosts: what a cluster looks like to `nodes.py`."""

    servers: list[Sshd]
    access: Access
    #: each node's host key pair (private, public line), in node order
    host_keys: list[tuple[str, str]]
    client_public: str

    @property
    def endpoints(self) -> list[Endpoint]:
        names = ["master"] + [f"worker-{i}" for i in range(1, len(self.servers))]
        return [
            Endpoint(n, s.host, s.port, s.user) for n, s in zip(names, self.servers, strict=True)
        ]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def start_nodes(
    workdir: Path, count: int, *, pin: bool = True, env: Mapping[str, str] | None = None
) -> SshNodes:
    """`count` sshd nodes under `workdir`, each with a fresh host key, all letting in one fresh
    client key (`access.key_file`); with `pin`, their host keys are in `access.known_hosts`;
    their sessions get `env` too (`start_sshd`)."""
    client_private, client_public = sshkeys.new_ed25519()
    access = Access(workdir / "id_ed25519", workdir / "known_hosts")
    sshkeys.write_private_key(access.key_file, client_private)
    servers: list[Sshd] = []
    host_keys = [sshkeys.new_ed25519() for _ in range(count)]
    try:
        for i, (private, _public) in enumerate(host_keys):
            servers.append(start_sshd(workdir / f"node{i}", private, client_public + "\n", env=env))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    group = SshNodes(servers, access, host_keys, client_public)
    if pin:
        sshkeys.pin(
            access.known_hosts,
            {
                ep.address: public
                for ep, (_, public) in zip(group.endpoints, host_keys, strict=True)
            },
        )
    return group


#: `systemctl` and `shutdown` on a rebooting node's PATH: a reboot leaves the request file
#: (`{request}`) for the test's thread; `{hold}` keeps the command running until the node goes
#: down under it, or returns at once (as systemd's `systemctl reboot` does)
_REBOOT_TOOL = """#!/bin/sh
case "$*" in reboot|"-r now") ;; *) echo "$0: no stand-in for: $*" >&2; exit 64;; esac
touch {request}
{hold}
"""


class RebootingNode:
    """One loopback sshd node that reboots when told to (`systemctl reboot`, `shutdown -r now`:
    stand-ins first on its sessions' PATH, in `bin`, where a test adds its own tools).

    A thread here does the reboot, `lag_s` after the request (sshd still serves meanwhile, as on
    a real node): every process of the node's sshd is killed, so each connection drops; the
    boot id in `boot_id` (the node's /proc/sys/kernel/random/boot_id) changes; `down_s` later
    the sshd starts again on its port with its host key, unless `back` is False (a node that
    never comes back). `boots` counts the reboots."""

    def __init__(
        self,
        workdir: Path,
        *,
        lag_s: float = 0.5,
        down_s: float = 1.0,
        back: bool = True,
        hold: bool = False,
    ) -> None:
        self.bin = workdir / "bin"
        self.bin.mkdir(parents=True)
        self.boot_id = workdir / "boot_id"
        self.boot_id.write_text(f"{uuid.uuid4()}\n")
        self._request = workdir / "reboot-requested"
        tool = _REBOOT_TOOL.format(request=self._request, hold="sleep 60" if hold else "")
        for name in ("systemctl", "shutdown"):
            (self.bin / name).write_text(tool)
            (self.bin / name).chmod(0o755)
        # the sessions' SHLVL (see `_session_env`) matters here too: the reboot never kills a
        # shell amid the login user's start-up files (a pyenv rehash there left its lock
        # behind, and every later SSH session waited on it)
        self._env = {"PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.group = start_nodes(workdir / "nodes", 1, env=self._env)
        self.lag_s, self.down_s, self.back = lag_s, down_s, back
        self.boots = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="reboots", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> Endpoint:
        return self.group.endpoints[0]

    @property
    def access(self) -> Access:
        return self.group.access

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            if not self._request.exists():
                continue
            self._request.unlink()
            if self._stop.wait(self.lag_s):
                return
            self._power_off()
            self.boot_id.write_text(f"{uuid.uuid4()}\n")
            self.boots += 1
            if self._stop.wait(self.down_s) or not self.back:
                return
            old = self.group.servers[0]
            private = old.host_key.read_text()
            self.group.servers[0] = start_sshd(
                old.dir, private, old.authorized_keys.read_text(), port=old.port, env=self._env
            )

    def _power_off(self) -> None:
        """Stop the node's sshd and every process below it (each connection's own sshd runs in
        a session of its own, which `Sshd.stop` does not reach): each connection drops."""
        server = self.group.servers[0]
        below = _descendants(server.proc.pid)
        server.stop()
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._power_off()


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, by the parent ids in /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


class MotoNodes:
    """Loopback sshd nodes standing in for the instances of cluster `cluster` on moto, through
    the seam of `node_endpoints.py` (its `ENDPOINTS_ENV` file, which CLI subprocesses see too).

    Each node's port is fixed before anything launches (the master's and `workers` workers';
    `reserve` adds more), so `up` pins and finds each node's address at once. `serve` then
    starts, for each live instance, an sshd with the host key that sparknet put in that
    instance's user data and the public key of the instance's EC2 key pair, both read back from
    moto: what cloud-init does on a real node. `watch` keeps serving in a thread while a
    command launches instances and connects to them in one go.

    Each node's first serve is its first boot: the per-boot scripts its user data writes run
    as cloud-init's `scripts_per_boot` runs them, with a stand-in `shutdown` (tests/standins/power)
    first on their PATH and on its sessions' PATH, which records a scheduled power-off in the
    node's dir instead of acting on this machine. `end_due` then does what EC2 does when that
    power-off comes due: what the instance's InstanceInitiatedShutdownBehavior (read from moto)
    says, terminate or stop. Its clock is the real one plus `skew` seconds, which a test
    advances instead of waiting.
    """

    def __init__(
        self, workdir: Path, cluster: str, workers: int = 0, file: Path | None = None
    ) -> None:
        self.workdir = workdir
        self.cluster = cluster
        #: the endpoints file (shared by several clusters' MotoNodes in one test)
        self.file = file or workdir / "endpoints.json"
        self.ports: dict[str, int] = {}
        self.servers: dict[str, Sshd] = {}
        #: node name -> the instance id its sshd stands in for
        self.serving: dict[str, str] = {}
        #: the instances `gone` ended: never served again, nor named (as sparknet names none
        #: that is shutting down)
        self.departed: set[str] = set()
        #: the instances' metadata service (tests/imds.py), when a test gives one: each node's
        #: sessions reach their instance's part of it as EC2's link-local address
        self.imds: ImdsStandIn | None = None
        #: seconds added to the real clock when `end_due` asks whether a power-off is due
        self.skew = 0.0
        #: node name -> (instance id, what EC2 did to it: "terminate" or "stop") for each
        #: power-off `end_due` carried out
        self.ended: dict[str, tuple[str, str]] = {}
        self.user = os.environ.get("USER") or "root"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        workdir.mkdir(parents=True, exist_ok=True)
        self.reserve(["master"] + [f"worker-{k}" for k in range(1, workers + 1)])

    def reserve(self, names: list[str]) -> None:
        """Give each node name a port and write them into the endpoints file."""
        for name in names:
            self.ports.setdefault(name, free_port())
        mapping = json.loads(self.file.read_text()) if self.file.is_file() else {}
        mine = {f"{self.cluster}/{name}": f"{self.user}@127.0.0.1:{port}"
                for name, port in self.ports.items()}  # fmt: skip
        if mine.items() <= mapping.items():
            return
        mapping.update(mine)
        tmp = self.file.with_name(f".{self.cluster}.endpoints.tmp")
        tmp.write_text(json.dumps(mapping))
        tmp.replace(self.file)

    def serve(self, ec2) -> dict[str, Sshd]:
        """An sshd for each live instance of the cluster (a new one where the instance behind a
        node name changed); the servers by node name."""
        from sparknet.cluster.aws import instances

        with self._lock:
            found = [i for i in instances.find(ec2, self.cluster) if i.id not in self.departed]
            named = node_endpoints.node_names(found)
            self.reserve([name for name, _ in named])
            for name, inst in named:
                if self.serving.get(name) == inst.id and name in self.servers:
                    continue
                private, authorized = _what_cloud_init_installs(ec2, inst.id)
                if name in self.servers:
                    self.servers.pop(name).stop()
                env = shutdown_env(self.workdir / name)
                if self.imds is not None:
                    env[ENDPOINT_ENV] = self.imds.endpoint(inst.id)
                boot(keys.user_data_of(ec2, inst.id), self.workdir / name, env)
                self.servers[name] = start_sshd(
                    self.workdir / name, private, authorized, port=self.ports[name], env=env
                )
                self.serving[name] = inst.id
            return dict(self.servers)

    def end_due(self, ec2) -> dict[str, tuple[str, str]]:
        """Carry out each served node's power-off that is due (by the real clock plus `skew`)
        as EC2 does for a shutdown from inside an instance: terminate or stop it, as its
        InstanceInitiatedShutdownBehavior says; the node then answers no more (`gone`). A
        halt is no power-off: EC2 leaves such an instance running. What it ended, by name."""
        now = time.time() + self.skew
        with self._lock:
            serving = dict(self.serving)
        done = {}
        for name, instance in serving.items():
            scheduled = scheduled_shutdown(self.workdir / name)
            if scheduled is None or scheduled["mode"] != "poweroff" or scheduled["at"] > now:
                continue
            got = ec2.describe_instance_attribute(
                InstanceId=instance, Attribute="instanceInitiatedShutdownBehavior"
            )
            behavior = got["InstanceInitiatedShutdownBehavior"]["Value"]
            if behavior == "terminate":
                ec2.terminate_instances(InstanceIds=[instance])
            else:
                ec2.stop_instances(InstanceIds=[instance])
            self.gone(name)
            done[name] = (instance, behavior)
        self.ended.update(done)
        return done

    @contextlib.contextmanager
    def watch(self, ec2, every_s: float = 1.0):
        """`serve` every `every_s` in a thread for the block (errors of one round are retried in
        the next: an instance may not have its user data or key yet). Not more often: each
        round is a DescribeInstances on the moto server in this process, whose CPU the whole
        suite shares (every 0.2 s cost about 30 s of CPU in one submit test)."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                with contextlib.suppress(Exception):
                    self.serve(ec2)
                    self.end_due(ec2)

        self._stop.clear()
        thread = threading.Thread(target=loop, name="moto-nodes", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=10)

    def gone(self, name: str) -> None:
        """Node `name` stops answering, as a terminated instance does, for good: a `serve` round
        before EC2 has the instance terminated would otherwise start its sshd again, at the
        address its replacement takes (its daemons are the test's to kill: they run in sessions
        of their own)."""
        with self._lock:
            server = self.servers.pop(name, None)
            if (instance := self.serving.pop(name, None)) is not None:
                self.departed.add(instance)
        if server is not None:
            server.stop()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for server in self.servers.values():
                server.stop()
            self.servers.clear()


def _what_cloud_init_installs(ec2, instance_id: str) -> tuple[str, str]:
    """(host private key from the user data, authorized_keys text from the EC2 key pair) of an
    instance, read back from moto."""
    import yaml

    user_data = keys.user_data_of(ec2, instance_id)
    config = yaml.safe_load(user_data) if user_data.startswith("#cloud-config") else None
    if not config or "ssh_keys" not in config:
        raise RuntimeError(f"{instance_id} has no host key in its user data")
    raw = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
    authorized = ""
    if raw.get("KeyName"):
        pairs = ec2.describe_key_pairs(KeyNames=[raw["KeyName"]], IncludePublicKey=True)
        authorized = pairs["KeyPairs"][0]["PublicKey"].strip() + "\n"
    return config["ssh_keys"]["ed25519_private"], authorized


#: the stand-ins a loopback node's commands find first on their PATH (tests/standins/power)
STANDINS = Path(__file__).resolve().parent / "standins" / "power"
#: cloud-init's per-boot scripts dir on a node (`cc_scripts_per_boot`: every boot runs the
#: executable files in it, in name order)
PER_BOOT = "/var/lib/cloud/scripts/per-boot/"


def shutdown_env(node_dir: Path) -> dict[str, str]:
    """The environment that puts the stand-in `shutdown` first on a node's PATH and has it
    record into `node_dir`: this machine is never shut down by a test."""
    return {
        "PATH": f"{STANDINS}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "SPARKNET_TEST_SHUTDOWN_FILE": str(node_dir / "shutdown.json"),
    }


def boot(user_data: str, node_dir: Path, env: Mapping[str, str]) -> list[str]:
    """A node's boot as cloud-init makes it from `user_data`: each `write_files` entry under the
    per-boot dir that is executable (cloud-init's default mode 0644 is not) runs, in name order,
    with `env` (see `shutdown_env`); a shutdown an earlier instance of the node scheduled is
    gone. The scripts' names."""
    import yaml

    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "shutdown.json").unlink(missing_ok=True)
    config = yaml.safe_load(user_data) if user_data.startswith("#cloud-config") else None
    entries = (config or {}).get("write_files") or []
    scripts = sorted(
        (e for e in entries if str(e.get("path", "")).startswith(PER_BOOT)
         and int(str(e.get("permissions", "0644")), 8) & 0o111),
        key=lambda e: e["path"],
    )  # fmt: skip
    ran = []
    for entry in scripts:
        script = node_dir / "per-boot" / Path(entry["path"]).name
        script.parent.mkdir(exist_ok=True)
        script.write_text(entry.get("content", ""))
        script.chmod(0o755)
        subprocess.run([str(script)], env={**os.environ, **env}, check=True, timeout=30)
        ran.append(entry["path"])
    return ran


def scheduled_shutdown(node_dir: Path) -> dict[str, Any] | None:
    """What the stand-in `shutdown` has pending on the node: {"at": epoch seconds, "mode":
    "poweroff" | "halt" | "reboot"}; None when nothing is (never scheduled, or cancelled)."""
    try:
        return json.loads((node_dir / "shutdown.json").read_text())
    except FileNotFoundError:
        return None
