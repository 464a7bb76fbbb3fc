"""A bare node for the tests: a machine that shares nothing with the test's own environment.

Each node is a fresh Debian 12 root (made by `debootstrap`, cached per machine as a zstd
tarball keyed by its recipe) with an sshd running inside `chroot` on its own loopback address
and port: no Java, no venv, no pyspark, only Debian's python3. It has the package sources a
company's machine has: this machine's Debian mirror (its apt sources, apt.conf.d and CA
certificates) and a pip mirror: the local package dirs this machine's pip configuration names,
bind-mounted read-only and named in the node's /etc/pip.conf, with PyPI behind them as this
machine has it (PyTorch's own index cannot be reached). sparknet logs in as user `sparknet` (a
key in its authorized_keys, passwordless sudo), as on a machine of the user's.

What a run costs is kept down where the node's truth does not change: the node's pip takes
the CPU build of torch where the local dirs hold one (`cpu_torch_pins`: ~0.7 GB installed
instead of the CUDA build's ~6 GB, 12 s instead of 70-95 s a node), compiles no .pyc at
install, and finds the submitter's pyspark as a wheel built once per machine (`wheelhouse`).

The node's mounts (/proc, /sys, /dev, /dev/pts, a tmpfs on /run and /dev/shm, the pip dirs)
are made in a mount namespace of its own (`unshare -m`), never in this machine's: they vanish
with the last process in that namespace, so a test that dies, or a Ctrl-C, leaves no mount
behind, and removing the root can never reach this machine's /dev. `stop` kills every process
in the namespace (the sshd, its sessions, the Spark daemons the bootstrap started).

No systemd runs in a chroot: the bootstrap starts the daemons as plain processes. Two nodes on
this machine share its loopback, so their ports must differ.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sparknet.cluster import sshkeys
from sparknet.cluster.nodes import Access
from tests.sshd import free_port, wait_listening

#: what makes the root: a change here is a new cache key, so a new root
SUITE = "bookworm"
INCLUDE = "openssh-server,python3,sudo,ca-certificates,util-linux,procps,iproute2"
DEBOOTSTRAP = ("debootstrap", "--variant=minbase", f"--include={INCLUDE}", SUITE)
#: where the root tarball and the pyspark wheel are kept between runs
CACHE_ENV = "SPARKNET_TEST_CACHE"
#: the user sparknet logs in as
USER = "sparknet"
#: inside the node: its pip constraints (this machine's, and the CPU torch pins)
NODE_CONSTRAINTS = "/etc/pip-constraints.txt"
#: inside every node: one dir of this machine, writable by the node's user, that all nodes
#: share (as an NFS mount would): a run dir on it is the same on every node
NODE_SHARED = "/srv/shared"
#: inside the node: its sshd's config
SSHD_CONFIG = "/etc/ssh/sparknet_sshd_config"


def cache_dir() -> Path:
    """The per-machine cache: `CACHE_ENV`, else ~/.cache/sparknet-tests."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sparknet-tests")


def debian_mirror() -> str:
    """This machine's Debian mirror: the first `URIs:` of its deb822 sources (or the first
    `deb` line of sources.list), as the node's apt will use it too."""
    sources = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in sources:
        for line in path.read_text().splitlines():
            if line.startswith("URIs:"):
                return line.split()[1]
    listed = Path("/etc/apt/sources.list")
    for line in listed.read_text().splitlines() if listed.exists() else []:
        if line.startswith("deb "):
            return next(w for w in line.split()[1:] if "://" in w)
    raise RuntimeError("no Debian mirror in /etc/apt/sources.list.d/*.sources or sources.list")


def recipe() -> list[str]:
    """The debootstrap command (less its target dir) that makes the root."""
    return [*DEBOOTSTRAP, "TARGET", debian_mirror()]


def _made_once(final: Path, make) -> Path:
    """`final` in the cache, made by `make(tmp_dir) -> path` on first use. Two test processes
    that both need it while it is made: one makes it under a lock, the other waits for it; it
    appears whole (made aside, then renamed) or not at all."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{final.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists():  # the other process made it meanwhile
            return final
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=".build-") as tmp:
            make(Path(tmp)).replace(final)
    return final


def root_tarball() -> Path:
    """The cached root for `recipe` (made on first use: ~1 minute, ~120 MB)."""
    key = hashlib.sha256(json.dumps(recipe()).encode()).hexdigest()[:16]

    def make(tmp: Path) -> Path:
        root = tmp / "root"
        command = [w if w != "TARGET" else str(root) for w in recipe()]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed: {done.stdout[-3000:]}")
        # each node gets its own host key; apt's lists are fetched again by the bootstrap
        for stale in [*root.glob("etc/ssh/ssh_host_*"), *root.glob("var/lib/apt/lists/*_*")]:
            stale.unlink()
        part = tmp / "root.tar.zst"
        subprocess.run(
            ["tar", "--zstd", "--numeric-owner", "-C", str(root), "-cf", str(part), "."],
            check=True, timeout=600,
        )  # fmt: skip
        return part

    return _made_once(cache_dir() / f"debian-{SUITE}-minbase-{key}.tar.zst", make)


#: where the node sees `wheelhouse()` (read-only, a find-links of its pip)
NODE_WHEELHOUSE = "/opt/sparknet-test-wheels"


def wheelhouse() -> Path:
    """A dir with the wheel of the submitter's pyspark, built once per machine: PyPI has only
    its sdist (456 MB), which each node's pip would fetch and build into a wheel again (a
    company's mirror serves it built). The proxy here strips PyPI's cache headers, so pip's own
    HTTP cache keeps nothing between runs."""
    version = importlib.metadata.version("pyspark")

    def make(tmp: Path) -> Path:
        built = tmp / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", f"pyspark=={version}",
             "-w", str(built)],
            check=True, timeout=1200, capture_output=True,
        )  # fmt: skip
        return built

    return _made_once(cache_dir() / f"wheelhouse-pyspark-{version}", make)


@dataclass(frozen=True)
class PipSources:
    """This machine's pip mirror as a node sees it: the [global] settings of its pip.conf, the
    local dirs to bind-mount read-only, and the constraints to copy in."""

    settings: dict[str, str]
    dirs: tuple[str, ...]
    constraints: str


def pip_sources() -> PipSources:
    """What `python3 -m pip config list` says on this machine, as the node's pip.conf: its
    indexes, find-links, constraints and certificate; the local dirs among them are mounted
    (an index's `.../simple` dir with its parent, where its files lie)."""
    listed = subprocess.run(
        ["python3", "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        key = name.rsplit(".", 1)[-1]
        if value and key not in settings:
            settings[key] = value.strip().strip("'\"")
    dirs: list[str] = []
    for key in ("index-url", "extra-index-url", "find-links"):
        for word in settings.get(key, "").split():
            path = word.removeprefix("file://")
            if path.startswith("/"):
                top = str(Path(path).parent) if Path(path).name == "simple" else path
                if Path(top).is_dir() and top not in dirs:
                    dirs.append(top)
    constraint = Path(settings.get("constraint") or "/nonexistent")
    constraints = constraint.read_text() if constraint.is_file() else ""
    return PipSources(settings, tuple(dirs), constraints)


def cpu_torch_pins(dirs: tuple[str, ...]) -> list[str]:
    """``torch==<v>+cpu`` and its torchvision where the local dirs hold a CPU build of torch
    for the node's Python (3.11) and the torchvision made for it (0.N+15 for torch 2.N): a
    node without a GPU then installs ~0.7 GB instead of the CUDA build's ~6 GB. Empty where
    they hold none."""
    names = [w.name for d in dirs for w in (*Path(d).glob("*.whl"), *Path(d).glob("files/*.whl"))]
    cpu = sorted(
        (int(m.group(2)), int(m.group(3)), m.group(1))
        for name in names
        if (m := re.fullmatch(r"torch-(2\.(\d+)\.(\d+)\+cpu)-cp311-cp311-\S+\.whl", name))
    )
    if not cpu:
        return []
    minor, _patch, version = cpu[-1]
    vision = sorted(
        int(m.group(1))
        for name in names
        if (m := re.fullmatch(rf"torchvision-0\.{minor + 15}\.(\d+)-cp311-cp311-\S+\.whl", name))
    )
    if not vision:
        return []
    return [f"torch=={version}", f"torchvision==0.{minor + 15}.{vision[-1]}"]


def node_pip_conf(sources: PipSources, wheels: str | None = None) -> str:
    """The node's /etc/pip.conf: this machine's pip settings, and `wheels` as one more
    find-links dir; its constraints (and the CPU torch pins) in NODE_CONSTRAINTS. `compile =
    no`: pip writes no .pyc for the tens of thousands of modules it installs (the node's Python
    compiles what it imports, when it imports it)."""
    keep = ("index-url", "extra-index-url", "find-links", "cert", "default-timeout")
    settings = {k: v for k, v in sources.settings.items() if k in keep}
    if wheels:
        settings["find-links"] = f"{settings.get('find-links', '')} {wheels}".strip()
    lines = ["[global]"]
    lines += [f"{k} = {v}" for k, v in settings.items()]
    lines += [f"constraint = {NODE_CONSTRAINTS}", "disable-pip-version-check = 1"]
    lines += ["", "[install]", "compile = no"]
    return "\n".join(lines) + "\n"


#: run by `unshare -m` as root: the node's mounts, in its own namespace, then its sshd
_START = r"""
set -eu
R=$1; shift
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount --bind /dev "$R/dev"
mount --bind /dev/pts "$R/dev/pts"
mount -t tmpfs -o mode=0755 tmpfs "$R/run"
mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm"
for pair in "$@"; do  # SOURCE:TARGET (read-only) or SOURCE:TARGET:rw
    src=${pair%%:*}; rest=${pair#*:}; dst=$R${rest%%:*}
    mkdir -p "$dst"
    mount --bind "$src" "$dst"
    case "$rest" in *:rw) ;; *) mount -o remount,bind,ro "$dst";; esac
done
mkdir -p "$R/run/sshd"
exec chroot "$R" /usr/sbin/sshd -D -e -f /etc/ssh/sparknet_sshd_config
"""


@dataclass
class BareNode:
    """One bare node: its root dir, where its sshd listens, and its process."""

    name: str
    root: Path
    host: str
    port: int
    proc: subprocess.Popen
    log: Path
    host_public: str
    #: the mount namespace's id (its /proc/PID/ns/mnt link): every process in it is the node's
    namespace: str

    @property
    def address(self) -> str:
        return f"{USER}@{self.host}:{self.port}"

    def processes(self) -> list[int]:
        """The pids in the node's mount namespace (its sshd, sessions and daemons); only the
        node's first process while its namespace is not known to be its own (never every
        process of this machine's namespace)."""
        if self.namespace in ("", "none", os.readlink("/proc/self/ns/mnt")):
            return [self.proc.pid] if self.proc.poll() is None else []
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "mnt") == self.namespace:
                        found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Kill every process of the node (TERM, then KILL after 10 s): its namespace, and so
        its mounts, go with the last one. KILL is sent again to what is left until nothing is
        (for up to a minute): a process forked while the first KILLs went out escapes them,
        and a loaded machine takes seconds to end a large JVM."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline = time.monotonic() + 60
        while self.processes() and time.monotonic() < deadline:
            self._signal(signal.SIGKILL)
            time.sleep(0.5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def _signal(self, sig: int) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def described(self) -> str:
        """The node's processes left, as `pid (command)`, for an error that says what stayed."""
        left = []
        for pid in self.processes():
            with contextlib.suppress(OSError):
                left.append(f"{pid} ({Path(f'/proc/{pid}/comm').read_text().strip()})")
        return ", ".join(left) or "none"


def start_node(
    workdir: Path,
    name: str,
    host: str,
    client_public: str,
    tarball: Path,
    pip: PipSources,
    pins: list[str],
    wheels: Path,
    shared: Path,
) -> BareNode:
    """Unpack the root under `workdir/root`, make it a machine of its own (user, sudo, host
    key, apt and pip sources with `pins` added to pip's constraints and `wheels` to its
    find-links, CA certificates; `shared` at NODE_SHARED), and start its sshd on
    `host`:<free port>."""
    root = workdir / "root"
    root.mkdir(parents=True)
    subprocess.run(
        ["tar", "--zstd", "--numeric-owner", "-C", str(root), "-xf", str(tarball)],
        check=True, timeout=600,
    )  # fmt: skip
    for path in ("/etc/resolv.conf", "/etc/hosts"):
        shutil.copyfile(path, root / path.lstrip("/"))
    # this machine's apt sources replace debootstrap's one-line sources.list
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
    for d in ("sources.list.d", "apt.conf.d"):
        shutil.copytree(f"/etc/apt/{d}", root / "etc/apt" / d, dirs_exist_ok=True)
    shutil.copytree(
        "/usr/local/share/ca-certificates",
        root / "usr/local/share/ca-certificates",
        dirs_exist_ok=True,
    )
    (root / NODE_CONSTRAINTS.lstrip("/")).write_text(
        pip.constraints + "".join(f"{p}\n" for p in pins)
    )
    (root / "etc/pip.conf").write_text(node_pip_conf(pip, NODE_WHEELHOUSE))
    private, public = sshkeys.new_ed25519()
    key = root / "etc/ssh/sparknet_host_ed25519_key"
    key.write_text(private)
    key.chmod(0o600)
    port = free_port()
    (root / SSHD_CONFIG.lstrip("/")).write_text(_sshd_config(host, port))
    inside = (
        "update-ca-certificates >/dev/null 2>&1"
        f" && useradd -m -s /bin/bash {USER} && usermod -p '*' {USER}"
        f" && echo '{USER} ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/{USER}"
        f" && chmod 440 /etc/sudoers.d/{USER}"
        f" && install -d -m 700 -o {USER} -g {USER} /home/{USER}/.ssh"
    )
    subprocess.run(["chroot", str(root), "sh", "-c", inside], check=True, timeout=120)
    auth = root / f"home/{USER}/.ssh/authorized_keys"
    auth.write_text(client_public + "\n")
    owner = (root / f"home/{USER}").stat()
    os.chown(auth, owner.st_uid, owner.st_gid)
    auth.chmod(0o600)

    mounts = [f"{d}:{d}" for d in pip.dirs]
    mounts += [f"{wheels}:{NODE_WHEELHOUSE}", f"{shared}:{NODE_SHARED}:rw"]
    log = workdir / "sshd.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private",
             "sh", "-c", _START, "start", str(root), *mounts],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env=_clean_env(),
        )  # fmt: skip
    node = BareNode(name, root, host, port, proc, log, public, namespace="")
    try:
        # sshd listens: the process runs in its own namespace now
        wait_listening(proc, log, host, port, 30, who=f"{name}'s sshd")
        node.namespace = os.readlink(f"/proc/{proc.pid}/ns/mnt")
    except BaseException:
        node.stop()
        raise
    return node


def _clean_env() -> dict[str, str]:
    """The node's sshd starts with a plain environment, none of the test's (its venv's PATH,
    JAVA_HOME, AWS settings): a bare machine's sessions have its own."""
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
    }


def _sshd_config(host: str, port: int) -> str:
    return "\n".join(
        [
            f"ListenAddress {host}",
            f"Port {port}",
            "HostKey /etc/ssh/sparknet_host_ed25519_key",
            "AuthorizedKeysFile .ssh/authorized_keys",
            "PidFile /run/sshd.pid",
            "UsePAM no",
            "PermitRootLogin no",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "AllowTcpForwarding yes",
            "X11Forwarding no",
            "PrintMotd no",
            "LogLevel VERBOSE",
            "",
        ]
    )


@dataclass
class BareNodes:
    """Bare nodes that one client key logs in to, their host keys pinned in one known_hosts."""

    nodes: list[BareNode]
    access: Access
    #: the dir the nodes share at NODE_SHARED
    shared: Path
    #: the pins of the CPU torch the nodes' pip constraints hold (`cpu_torch_pins`; empty:
    #: none, torch is what the mirror's newest is)
    torch_pins: list[str]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def remove(self) -> None:
        """Remove the stopped nodes' roots (their logs stay): refused while anything is
        still mounted under one."""
        mounts = Path("/proc/self/mounts").read_text()
        for node in self.nodes:
            if node.processes() or f" {node.root}/" in mounts or f" {node.root} " in mounts:
                raise RuntimeError(
                    f"{node.name} still runs or has mounts: its root stays (processes left:"
                    f" {node.described()})"
                )
            shutil.rmtree(node.root, ignore_errors=True)


def start_nodes(workdir: Path, addresses: dict[str, str]) -> BareNodes:
    """Bare nodes named and addressed by `addresses` (name -> 127.0.0.x), with one fresh client
    key (`access.key_file`) and their host keys pinned in `access.known_hosts`, sharing
    `workdir/shared` at NODE_SHARED."""
    tarball, wheels = root_tarball(), wheelhouse()
    pip = pip_sources()
    client_private, client_public = sshkeys.new_ed25519()
    workdir.mkdir(parents=True, exist_ok=True)
    access = Access(workdir / "id_ed25519", workdir / "known_hosts")
    sshkeys.write_private_key(access.key_file, client_private)
    shared = workdir / "shared"
    shared.mkdir()
    started = BareNodes([], access, shared, cpu_torch_pins(pip.dirs))
    try:
        for name, host in addresses.items():
            node = start_node(
                workdir / name, name, host, client_public, tarball, pip,
                started.torch_pins, wheels, shared,
            )  # fmt: skip
            started.nodes.append(node)
    except BaseException:
        started.stop()
        raise
    owner = (started.nodes[0].root / "home" / USER).stat()  # USER's uid: the same in each root
    os.chown(shared, owner.st_uid, owner.st_gid)
    sshkeys.pin(
        access.known_hosts,
        {f"[{n.host}]:{n.port}": n.host_public for n in started.nodes},
    )
    return started
