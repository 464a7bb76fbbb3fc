"""Bootstrap: what turns a bare node into one of a Spark standalone cluster's machines.

A bootstrap is a list of `Step`s per node, each with `check` (already done?) and `apply`; the
runner applies only the steps whose check fails, on every node at once (`nodes.run_all`), so a
second run changes nothing and says so. A failing step stops its node; the one error names the
node, the step and the last lines of the failed command's output.

The steps: a directory tree under the node's `prefix`; Java 17 and the OS packages; the NVIDIA
driver (only on a GPU node whose `nvidia-smi` fails); a Python venv with torch (one that sees an
existing venv's packages when the node has one whose torch fits, such as the Deep Learning
AMI's); the submitter's pyspark version; the sparknet wheel built from the submitter's checkout;
`spark-defaults.conf` with the cluster's secret and the GPU discovery script; then the Spark
standalone daemons from that venv's pyspark (`spark-class`: the pip pyspark has no
`sbin/start-*.sh`): the master on the master node, a worker on every node, as systemd units where
systemd runs, else as background processes with pid files under the prefix.

Nothing here puts the secret on a command line or in an error: it travels to the node in a file
(streamed over the SSH channel, `upload`), into a directory only the node's user can open.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from invoke.exceptions import CommandTimedOut

from sparknet.cluster import nodes
from sparknet.cluster.nodes import Access, Endpoint
from sparknet.cluster.spark_conf import (
    DEFAULT_PREFIX,
    GPU_DISCOVERY_SCRIPT,
    UI_HOST,
    Ports,
    instance_store_dirs,
    java_major,
    load_or_create_secret,
    mem_total_kb,
    parse_nvme_models,
    spark_defaults,
    systemd_unit,
    torch_index_url,
    worker_memory_mb,
)
from sparknet.errors import SparknetError

Say = Callable[[str], None]

#: how many of a failed command's last output lines an error carries
TAIL_LINES = 10

#: Spark's daemon classes, run through spark-class
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


def _quiet(_line: str) -> None:
    pass


class Conn(Protocol):
    """What the steps use of a Fabric Connection (an `invoke.Context` will do for `run`)."""

    def run(self, command: str, **kwargs: Any) -> Any: ...


# --- commands ----------------------------------------------------------------------------------


class CommandFailed(SparknetError):
    """A command on a node exited non-zero (or ran past its timeout); `tail` holds the last lines
    of its output."""

    def __init__(self, what: str, tail: list[str]) -> None:
        super().__init__(what)
        self.what = what
        self.tail = tail


def _tail(*texts: str) -> list[str]:
    lines = [ln.rstrip() for text in texts for ln in (text or "").splitlines() if ln.strip()]
    return lines[-TAIL_LINES:]


def run(conn: Conn, command: str, timeout: float = 60) -> str:
    """Run `command` on the node; its stdout. Non-zero exit or a timeout is CommandFailed."""
    try:
        result = conn.run(
            command, hide=True, warn=True, timeout=timeout, pty=False, in_stream=False
        )
    except CommandTimedOut as exc:
        raise CommandFailed(
            f"timed out after {timeout:g} s", _tail(exc.result.stdout, exc.result.stderr)
        ) from None
    if result.exited != 0:
        raise CommandFailed(f"exited {result.exited}", _tail(result.stdout, result.stderr))
    return result.stdout


def succeeds(conn: Conn, command: str, timeout: float = 60) -> bool:
    """Whether `command` exits 0 on the node (what most checks ask)."""
    try:
        run(conn, command, timeout)
    except CommandFailed:
        return False
    return True


def q(*words: str) -> str:
    """Words quoted for the node's shell."""
    return " ".join(shlex.quote(str(w)) for w in words)


def upload(conn: Conn, data: bytes, remote: str, mode: int, timeout: float = 300) -> None:
    """Write `data` to the file `remote` on the node with `mode`, streamed over the SSH channel
    into `cat` (no SFTP subsystem needed, nothing on a command line). The file is made under
    umask 077, so it is never readable by others, not even before its chmod; it replaces the
    old one at once (`mv`), so a reader never sees half a file."""
    new = q(f"{remote}.new")
    command = f"umask 077 && cat > {new} && chmod {mode:o} {new} && mv -f {new} {q(remote)}"
    client = getattr(conn, "client", None)
    if client is None:  # a local invoke.Context (unit tests): the same command, locally
        subprocess.run(["sh", "-c", command], input=data, check=True, timeout=timeout)
        return
    stdin, stdout, stderr = client.exec_command(command, timeout=timeout)
    stdin.write(data)
    stdin.channel.shutdown_write()
    status = stdout.channel.recv_exit_status()
    if status != 0:
        raise CommandFailed(
            f"writing {remote} exited {status}", _tail(stderr.read().decode(errors="replace"))
        )


# --- what a node is, and what sparknet learns about it -------------------------------------------


@dataclass(frozen=True)
class Node:
    """One machine of the cluster as the bootstrap sees it."""

    endpoint: Endpoint
    #: the private address Spark's RPC binds and the other nodes reach; default endpoint.host
    address: str | None = None
    #: where everything sparknet installs on the node lives
    prefix: str = DEFAULT_PREFIX
    #: GPUs the node has (from its instance type); 0: no driver, no GPU resource
    gpus: int = 0

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def rpc_host(self) -> str:
        return self.address or self.endpoint.host

    def path(self, *parts: str) -> str:
        return "/".join([self.prefix.rstrip("/"), *parts])

    @property
    def venv(self) -> str:
        return self.path("venv")

    @property
    def python(self) -> str:
        return self.path("venv", "bin", "python")


@dataclass(frozen=True)
class Wheel:
    """The sparknet wheel every node installs: built from the submitter's checkout."""

    path: Path
    version: str
    #: sha256 of the wheel's RECORD (every file's own hash): the same sources give the same
    #: digest whatever the zip's timestamps, so an unchanged checkout is not reinstalled
    digest: str


@dataclass(frozen=True)
class Plan:
    """What the bootstrap makes of a cluster: its nodes (the first is the master; every node
    runs a worker), what they install, and how the daemons are set up."""

    nodes: tuple[Node, ...]
    wheel: Wheel
    #: the cluster's `spark.authenticate` secret (`spark_conf.load_or_create_secret`)
    secret: str = field(repr=False)
    ports: Ports = field(default_factory=Ports)
    #: an existing env on the nodes whose torch fits; None: the first of AMI_TORCH_ENVS a node
    #: has whose torch fits, else a fresh venv with torch installed
    python_env: str | None = None
    #: the pyspark the nodes run: the submitter's, so driver and executors agree
    pyspark_version: str = field(default_factory=lambda: importlib.metadata.version("pyspark"))
    #: what each worker offers; default: the node's cores, and its memory less headroom
    worker_cores: int | None = None
    worker_memory_mb: int | None = None

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SparknetError("a cluster to bootstrap needs at least one node")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise SparknetError(f"node names repeat: {', '.join(names)}")

    @property
    def master(self) -> Node:
        return self.nodes[0]

    @property
    def master_url(self) -> str:
        return f"spark://{self.master.rpc_host}:{self.ports.master}"


#: where the Deep Learning AMIs with PyTorch keep it (a venv on newer ones, conda on older)
AMI_TORCH_ENVS = ("/opt/pytorch", "/opt/conda/envs/pytorch")


@dataclass(frozen=True)
class Facts:
    """What one command tells about a node before any step runs."""

    user: str
    uid: int
    cores: int
    mem_total_kb: int
    systemd: bool
    #: instance store mounts for Spark's local dirs (empty: none)
    local_dirs: tuple[str, ...]
    #: which of AMI_TORCH_ENVS the node has (a python there)
    envs: tuple[str, ...] = ()


_FACTS = (
    "echo @user; id -un; echo @uid; id -u; echo @nproc; nproc; echo @meminfo; cat /proc/meminfo;"
    " echo @systemd; if [ -d /run/systemd/system ]; then echo yes; else echo no; fi;"
    " echo @mounts; cat /proc/mounts;"
    " echo @nvme; grep -H . /sys/block/nvme*/device/model 2>/dev/null;"
    f" echo @envs; for d in {' '.join(AMI_TORCH_ENVS)}; do [ -x $d/bin/python ] && echo $d; done;"
    " true"
)


def parse_facts(text: str, prefix: str) -> Facts:
    """The facts command's output (sections after `@name` lines) as Facts."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("@"):
            current = sections.setdefault(line[1:].strip(), [])
        else:
            current.append(line)
    part = {k: "\n".join(v) for k, v in sections.items()}
    return Facts(
        user=part["user"].strip(),
        uid=int(part["uid"]),
        cores=int(part["nproc"]),
        mem_total_kb=mem_total_kb(part["meminfo"]),
        systemd=part["systemd"].strip() == "yes",
        local_dirs=tuple(
            instance_store_dirs(part["mounts"], parse_nvme_models(part.get("nvme", "")), prefix)
        ),
        envs=tuple(line.strip() for line in part.get("envs", "").splitlines() if line.strip()),
    )


@dataclass(frozen=True)
class Context:
    """One node's step inputs: the cluster plan, the node and its facts."""

    plan: Plan
    node: Node
    facts: Facts

    @property
    def sudo(self) -> str:
        """What runs a command as root: nothing for root, `sudo -n` (never a prompt) else."""
        return "" if self.facts.uid == 0 else "sudo -n "

    @property
    def is_master(self) -> bool:
        return self.node.name == self.plan.master.name

    @property
    def cores(self) -> int:
        return self.plan.worker_cores or self.facts.cores

    @property
    def memory_mb(self) -> int:
        return self.plan.worker_memory_mb or worker_memory_mb(
            self.facts.mem_total_kb, runs_driver=self.is_master
        )

    @property
    def local_dirs(self) -> tuple[str, ...]:
        return self.facts.local_dirs or (self.node.path("work", "local"),)

    @property
    def base_env(self) -> str | None:
        """The existing env the node's venv is laid over: the plan's, else the AMI's."""
        env = self.plan.python_env or (self.facts.envs[0] if self.facts.envs else None)
        return env.rstrip("/") if env else None

    def pip(self, conn: Conn) -> str:
        """pip for the node's venv: its own where it has one, else the base env's pip aimed at
        it (a venv laid over a base env has none of its own)."""
        own = f"{q(self.node.python)} -m pip -q --disable-pip-version-check"
        if self.base_env is None or succeeds(
            conn, f"[ -x {q(self.node.path('venv', 'bin', 'pip'))} ]"
        ):
            return own
        base = q(f"{self.base_env}/bin/python")
        return f"{base} -m pip -q --disable-pip-version-check --python {q(self.node.python)}"


# --- steps ---------------------------------------------------------------------------------------


class Step:
    """One idempotent piece of a bootstrap. `check` says whether it is done already (and must
    say yes right after `apply`); `apply` does it. `timeout` bounds each of its commands."""

    name = "step"
    timeout: float = 120

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def check(self, conn: Conn) -> bool:
        raise NotImplementedError

    def apply(self, conn: Conn) -> None:
        raise NotImplementedError

    def run(self, conn: Conn, command: str, timeout: float | None = None) -> str:
        return run(conn, command, timeout or self.timeout)


class Dirs(Step):
    """The prefix's tree, owned by the node's user; conf/ (the secret) only for that user."""

    name = "dirs"

    @property
    def dirs(self) -> list[str]:
        n = self.ctx.node
        subdirs = (n.path(d) for d in ("conf", "logs", "run", "work", "dist"))
        return [n.prefix, *subdirs, *self.ctx.local_dirs]

    def check(self, conn: Conn) -> bool:
        tests = " && ".join(f"[ -d {q(d)} ] && [ -w {q(d)} ]" for d in self.dirs)
        conf = q(self.ctx.node.path("conf"))
        return succeeds(conn, f'{tests} && [ "$(stat -c %a {conf})" = 700 ]')

    def apply(self, conn: Conn) -> None:
        s, user = self.ctx.sudo, self.ctx.facts.user
        self.run(
            conn,
            f"{s}mkdir -p {q(*self.dirs)} && {s}chown {q(user)} {q(*self.dirs)}"
            f" && chmod 700 {q(self.ctx.node.path('conf'))}",
        )


class OsPackages(Step):
    """Java 17+ for Spark (and python3-venv, curl): skipped where `java -version` says 17+."""

    name = "java"
    timeout = 900
    PACKAGES = ("openjdk-17-jre-headless", "python3-venv", "curl")

    def check(self, conn: Conn) -> bool:
        try:
            text = self.run(conn, "java -version 2>&1")
        except CommandFailed:
            return False
        major = java_major(text)
        if major is None or major < 17:
            return False
        return bool(self.ctx.base_env) or succeeds(conn, "python3 -c 'import ensurepip'")

    def apply(self, conn: Conn) -> None:
        s = self.ctx.sudo
        apt = f"{s}env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300"
        self.run(conn, f"{apt} update -qq && {apt} install -y -qq {q(*self.PACKAGES)}")


class NvidiaDriver(Step):
    """The NVIDIA driver, only on a node with GPUs whose `nvidia-smi` fails (the Deep Learning
    AMIs have it). A fresh driver needs a reboot: the step then fails saying so."""

    name = "nvidia-driver"
    timeout = 1800

    def check(self, conn: Conn) -> bool:
        return self.ctx.node.gpus == 0 or succeeds(conn, "nvidia-smi -L")

    def apply(self, conn: Conn) -> None:
        s = self.ctx.sudo
        apt = f"{s}env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300"
        self.run(
            conn,
            f"{apt} update -qq && {apt} install -y -qq ubuntu-drivers-common"
            f" && {s}ubuntu-drivers install --gpgpu",
        )
        if not succeeds(conn, "nvidia-smi -L"):
            raise CommandFailed(
                "installed the NVIDIA driver, but nvidia-smi fails until the node reboots: "
                "reboot it, then run the bootstrap again",
                [],
            )


#: the .pth file that lets the node's venv see an existing env's packages (torch, CUDA)
BASE_PTH = "_sparknet_base.pth"


class PythonEnv(Step):
    """The node's venv (`prefix`/venv) with a torch that imports (and sees the GPUs on a GPU
    node). Over an existing env whose torch fits (`Plan.python_env`, else the AMI's PyTorch env):
    a venv without packages of its own that sees that env's through a .pth file, so sparknet and
    its pyspark never change the AMI's env. Else (or when the AMI's torch does not fit) a venv of
    its own with torch from PyTorch's index for the driver's CUDA version."""

    name = "python-env"
    timeout = 1800

    def _torch_fits(self, quick: bool = False) -> str:
        """Python code that fails unless torch fits the node. `quick` on a node without GPUs
        only finds torch (importing it takes seconds on every check; `apply` imports it)."""
        if quick and not self.ctx.node.gpus:
            return "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"
        cuda = "assert torch.cuda.is_available(), 'no GPU'; " if self.ctx.node.gpus else ""
        return f"import torch; {cuda}print(torch.__version__)"

    def check(self, conn: Conn) -> bool:
        """A venv of its own, or one laid over today's base env, whose torch fits."""
        n, base = self.ctx.node, self.ctx.base_env
        made = f"[ -x {q(n.path('venv', 'bin', 'pip'))} ]"
        if base:
            line = q(self._base_line(conn, base))
            made = f"{{ {made} || grep -qxF {line} {self._site(n.python)}/{BASE_PTH}; }}"
        fits = f"{q(n.python)} -c {q(self._torch_fits(quick=True))}"
        return succeeds(conn, f"{made} && {fits}", timeout=120)

    @staticmethod
    def _site(python: str) -> str:
        return f"$({q(python)} -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"

    def _base_line(self, conn: Conn, base: str) -> str:
        """The .pth line that adds `base`'s site-packages (and runs its .pth files)."""
        site = self.run(conn, f"echo {self._site(base + '/bin/python')}").strip()
        return f"import site; site.addsitedir({site!r})"

    def apply(self, conn: Conn) -> None:
        n, base = self.ctx.node, self.ctx.base_env
        if base:
            python = f"{base}/bin/python"
            if succeeds(conn, f"{q(python)} -c {q(self._torch_fits())}", timeout=120):
                line = self._base_line(conn, base)
                self.run(
                    conn,
                    f"rm -rf {q(n.venv)} && {q(python)} -m venv --without-pip {q(n.venv)}"
                    f" && echo {q(line)} > {self._site(n.python)}/{BASE_PTH}",
                )
                return
            if self.ctx.plan.python_env:  # asked for, so not silently replaced
                raise CommandFailed(f"{base} has no torch that fits this node", [])
        index = torch_index_url(self._driver_cuda(conn) if n.gpus else None)
        own = f"{q(n.python)} -m pip -q --disable-pip-version-check"
        self.run(
            conn,
            f"rm -rf {q(n.venv)} && python3 -m venv {q(n.venv)}"
            f" && {own} install torch torchvision --index-url {q(index)}"
            f" && {q(n.python)} -c {q(self._torch_fits())}",
        )

    def _driver_cuda(self, conn: Conn) -> str | None:
        """The highest CUDA version the driver runs, as `nvidia-smi` prints it."""
        match = re.search(r"CUDA Version:\s*([\d.]+)", self.run(conn, "nvidia-smi"))
        return match.group(1) if match else None


class Pyspark(Step):
    """The submitter's pyspark version in the node's venv (its own copy over a base env with
    another version): driver and executors must run one Spark."""

    name = "pyspark"
    timeout = 900

    def check(self, conn: Conn) -> bool:
        code = "import importlib.metadata as m; print(m.version('pyspark'))"
        try:
            have = self.run(conn, f"{q(self.ctx.node.python)} -c {q(code)}").strip()
        except CommandFailed:
            return False
        return have == self.ctx.plan.pyspark_version

    def apply(self, conn: Conn) -> None:
        version = self.ctx.plan.pyspark_version
        self.run(conn, f"{self.ctx.pip(conn)} install {q('pyspark==' + version)}")


#: the file in the node's venv that records the digest of the sparknet wheel installed there
WHEEL_MARK = "sparknet-wheel.sha256"


#: Python code that fails unless every package sparknet requires is installed (by name: the
#: versions are the env's; importing them all would take seconds on every bootstrap)
DEPENDENCIES_THERE = """
import importlib.metadata as m, re, sys
missing = []
for req in m.requires("sparknet") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[ ;<>=!~\\[(]", req, maxsplit=1)[0]
    try:
        m.distribution(name)
    except m.PackageNotFoundError:
        missing.append(name)
sys.exit(f"missing: {' '.join(missing)}" if missing else 0)
"""


class SparknetWheel(Step):
    """The sparknet wheel built from the submitter's checkout, so the nodes run exactly the
    submitter's code. Done when the venv's sparknet has the wheel's version and the recorded
    digest is the wheel's."""

    name = "sparknet"
    timeout = 900

    def check(self, conn: Conn) -> bool:
        n, wheel = self.ctx.node, self.ctx.plan.wheel
        code = (
            "import importlib.metadata as m, importlib.util as u, sys; "
            "print(m.version('sparknet'), u.find_spec('sparknet').origin.startswith(sys.prefix))"
        )
        mark = q(n.path("venv", WHEEL_MARK))
        try:
            out = self.run(conn, f"{q(n.python)} -c {q(code)} && cat {mark}", timeout=60)
        except CommandFailed:
            return False
        return out.split() == [wheel.version, "True", wheel.digest]

    def apply(self, conn: Conn) -> None:
        n, wheel = self.ctx.node, self.ctx.plan.wheel
        remote = n.path("dist", wheel.path.name)
        upload(conn, wheel.path.read_bytes(), remote, 0o644)
        pip = self.ctx.pip(conn)
        self.run(conn, f"{pip} install --no-deps --force-reinstall {q(remote)}")
        # sparknet's dependencies: already there over the AMI's env or the test venv; a node
        # that lacks some gets them from the index (pip leaves satisfied ones alone)
        if not succeeds(conn, f"{q(n.python)} -c {q(DEPENDENCIES_THERE)}", timeout=120):
            self.run(conn, f"{pip} install {q(remote)}")
        self.run(conn, f"echo {q(wheel.digest)} > {q(n.path('venv', WHEEL_MARK))}")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def conf_files(ctx: Context) -> dict[str, tuple[str, int]]:
    """The files of the node's conf dir: name -> (text, mode)."""
    n = ctx.node
    script = n.path("conf", "gpus.sh")
    files = {
        "spark-defaults.conf": (
            spark_defaults(ctx.plan.secret, n.python, n.gpus, script if n.gpus else None),
            0o600,
        )
    }
    if n.gpus:
        files["gpus.sh"] = (GPU_DISCOVERY_SCRIPT, 0o700)
    return files


#: the .pth file in the node's venv that points Spark at the node's conf dir
CONF_PTH = "_sparknet_spark_conf.pth"


def conf_pth(node: Node) -> str:
    """A .pth line that gives every Python of the node's venv SPARK_CONF_DIR (unless set), so a
    driver started there (`sparknet train --master spark://...` on the master) reads the
    cluster's spark-defaults.conf, and with it the secret, with nothing on its command line."""
    conf = node.path("conf")
    return f"import os; os.environ.setdefault('SPARK_CONF_DIR', {conf!r})\n"


class SparkConf(Step):
    """spark-defaults.conf (the secret, security settings, GPUs; mode 0600) and the GPU discovery
    script, streamed as files into conf/ (0700): the secret is never on a command line. And the
    venv's .pth that points its Pythons at conf/."""

    name = "spark-conf"

    def files(self, conn: Conn) -> dict[str, tuple[str, int]]:
        """Remote path -> (text, mode) of every file this step writes."""
        n = self.ctx.node
        out = {n.path("conf", name): v for name, v in conf_files(self.ctx).items()}
        site = self.run(conn, f"echo {PythonEnv._site(n.python)}").strip()
        out[f"{site}/{CONF_PTH}"] = (conf_pth(n), 0o644)
        return out

    def check(self, conn: Conn) -> bool:
        try:
            files = self.files(conn)
            have = self.run(
                conn,
                "; ".join(f"echo $(sha256sum {q(p)}) $(stat -c %a {q(p)})" for p in sorted(files)),
            )
        except CommandFailed:
            return False
        want = [f"{_sha(text)} {p} {mode:o}" for p, (text, mode) in sorted(files.items())]
        return [" ".join(line.split()) for line in have.splitlines()] == want

    def apply(self, conn: Conn) -> None:
        for path, (text, mode) in self.files(conn).items():
            upload(conn, text.encode(), path, mode)


# --- the Spark daemons ---------------------------------------------------------------------------


class Daemon(Step):
    """A Spark daemon (master or worker) from the venv's pyspark. Done when it runs with exactly
    today's command line, environment and conf (their hash, the stamp): a changed setting
    restarts it. A systemd unit where systemd runs, else a background process in its own session
    whose pid file is under the prefix (stopped through its process group)."""

    role = "daemon"
    klass = ""

    def argv(self, spark_home: str) -> list[str]:
        raise NotImplementedError

    def env(self, spark_home: str) -> dict[str, str]:
        n = self.ctx.node
        return {
            "SPARK_HOME": spark_home,
            "SPARK_CONF_DIR": n.path("conf"),
            "SPARK_LOG_DIR": n.path("logs"),
            # the web UIs bind this address: only the SSH tunnel reaches them (RPC binds --host)
            "SPARK_LOCAL_IP": UI_HOST,
            "SPARK_LOCAL_DIRS": ",".join(self.ctx.local_dirs),
            "PYSPARK_PYTHON": n.python,
        }

    def spark_home(self, conn: Conn) -> str:
        code = (
            "import importlib.util as u; "
            "print(u.find_spec('pyspark').submodule_search_locations[0])"
        )
        return self.run(conn, f"{q(self.ctx.node.python)} -c {q(code)}").strip()

    def stamp(self, spark_home: str) -> str:
        what = [self.argv(spark_home), self.env(spark_home), sorted(conf_files(self.ctx).items())]
        return _sha(json.dumps(what, sort_keys=True))[:16]

    @property
    def pid_file(self) -> str:
        return self.ctx.node.path("run", f"{self.role}.pid")

    @property
    def stamp_file(self) -> str:
        return self.ctx.node.path("run", f"{self.role}.stamp")

    @property
    def log_file(self) -> str:
        return self.ctx.node.path("logs", f"{self.role}.out")

    @property
    def unit(self) -> str:
        return f"sparknet-{self.role}.service"

    def check(self, conn: Conn) -> bool:
        try:
            stamp = self.stamp(self.spark_home(conn))
        except CommandFailed:
            return False
        if self.ctx.facts.systemd:
            unit = q(f"/etc/systemd/system/{self.unit}")
            return succeeds(
                conn, f"systemctl is-active -q {q(self.unit)} && grep -qF {q(stamp)} {unit}"
            )
        return succeeds(conn, f'{self._alive()} && [ "$(cat {q(self.stamp_file)})" = {stamp} ]')

    def _alive(self) -> str:
        """A shell test: the pid file names a live process running this daemon of this prefix."""
        cmdline = '"/proc/$(cat ' + q(self.pid_file) + ')/cmdline"'
        return (
            f"[ -s {q(self.pid_file)} ] && [ -r {cmdline} ]"
            f" && tr '\\0' '\\n' < {cmdline} | grep -qxF {q(self.klass)}"
            f" && tr '\\0' '\\n' < {cmdline} | grep -qF {q(self.ctx.node.path('conf'))}"
        )

    def apply(self, conn: Conn) -> None:
        home = self.spark_home(conn)
        if self.ctx.facts.systemd:
            self._apply_unit(conn, home)
        else:
            self.stop(conn)
            self._start(conn, home)
        self.wait(conn)

    def _start(self, conn: Conn, home: str) -> None:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env(home).items())
        self.run(
            conn,
            f"cd {q(self.ctx.node.prefix)} || exit 1; env {env} nohup setsid {q(*self.argv(home))}"
            f" > {q(self.log_file)} 2>&1 < /dev/null & echo $! > {q(self.pid_file)}"
            f" && echo {self.stamp(home)} > {q(self.stamp_file)}",
        )

    def _apply_unit(self, conn: Conn, home: str) -> None:
        text = systemd_unit(
            f"sparknet Spark {self.role}",
            self.ctx.facts.user,
            self.env(home),
            [q(a) for a in self.argv(home)],
            self.stamp(home),
        ).replace(
            "[Service]\n",
            f"[Service]\nStandardOutput=append:{self.log_file}\nStandardError=inherit\n",
        )
        staged = self.ctx.node.path("run", self.unit)
        upload(conn, text.encode(), staged, 0o644)
        s, unit = self.ctx.sudo, q(self.unit)
        self.run(
            conn,
            f"{s}install -m 0644 {q(staged)} /etc/systemd/system/{unit} && {s}systemctl"
            f" daemon-reload && {s}systemctl enable -q {unit} && {s}systemctl restart {unit}",
        )

    def stop(self, conn: Conn, *, remove: bool = False) -> None:
        """Stop the daemon if it runs (by its pid file's process group, TERM then KILL); with
        `remove`, its systemd unit goes too, so a reboot does not start it again."""
        if self.ctx.facts.systemd:
            s, unit = self.ctx.sudo, q(self.unit)
            gone = (
                f"; {s}systemctl disable -q {unit} 2>/dev/null; {s}rm -f "
                f"/etc/systemd/system/{unit}; {s}systemctl daemon-reload"
                if remove
                else ""
            )
            self.run(conn, f"{s}systemctl stop {unit} 2>/dev/null{gone}; true")
            return
        pid = f"$(cat {q(self.pid_file)})"
        self.run(
            conn,
            f"if {self._alive()}; then p={pid}; kill -TERM -- -$p 2>/dev/null || kill -TERM $p;"
            " for i in $(seq 150); do [ -d /proc/$p ] || break; sleep 0.2; done;"
            " [ -d /proc/$p ] && kill -KILL -- -$p 2>/dev/null; true; fi;"
            f" rm -f {q(self.pid_file)} {q(self.stamp_file)}",
            timeout=60,
        )

    def wait(self, conn: Conn) -> None:
        """Until the pid file names the daemon's JVM. `spark-class` is a shell script that runs a
        launcher JVM before it execs the daemon's; until then the check cannot tell it from
        another prefix's daemon, and on a loaded machine that takes seconds."""
        if self.ctx.facts.systemd:
            return
        pid = f"$(cat {q(self.pid_file)} 2>/dev/null)"
        try:
            self.run(
                conn,
                f"end=$(( $(date +%s) + {DAEMON_START_S} )); while [ $(date +%s) -lt $end ]; do"
                f" if {self._alive()}; then exit 0; fi; p={pid};"
                ' [ -n "$p" ] && [ -d /proc/$p ] || exit 1; sleep 0.2; done; exit 1',
                DAEMON_START_S + 30,
            )
        except CommandFailed as exc:
            log = self.run(conn, f"tail -n {TAIL_LINES} {q(self.log_file)}; true")
            raise CommandFailed(
                f"the {self.role} did not start within {DAEMON_START_S} s", _tail(log)
            ) from exc


#: how long a started daemon's launcher may take to exec its JVM (about 1 s on an idle machine)
DAEMON_START_S = 90


#: how long a started master may take to listen (it is up in ~3 s on a small machine)
MASTER_START_S = 90


class Master(Daemon):
    name = "spark-master"
    role = "master"
    klass = MASTER_CLASS

    def argv(self, spark_home: str) -> list[str]:
        p, n = self.ctx.plan.ports, self.ctx.node
        return [f"{spark_home}/bin/spark-class", MASTER_CLASS, "--host", n.rpc_host,
                "--port", str(p.master), "--webui-port", str(p.master_ui)]  # fmt: skip

    def wait(self, conn: Conn) -> None:
        """Workers started before the master listens wait 5-15 s to retry: wait for its port."""
        super().wait(conn)
        host, port = self.ctx.node.rpc_host, self.ctx.plan.ports.master
        code = (
            "import socket, time, sys\n"
            f"end = time.monotonic() + {MASTER_START_S}\n"
            "while time.monotonic() < end:\n"
            f"    try: socket.create_connection(({host!r}, {port}), 1).close(); sys.exit(0)\n"
            "    except OSError: time.sleep(0.2)\n"
            "sys.exit(1)\n"
        )
        try:
            self.run(conn, f"{q(self.ctx.node.python)} -c {q(code)}", MASTER_START_S + 30)
        except CommandFailed as exc:
            log = self.run(conn, f"tail -n {TAIL_LINES} {q(self.log_file)}; true")
            raise CommandFailed(
                f"the master did not listen on {host}:{port} within {MASTER_START_S} s",
                _tail(log),
            ) from exc


class Worker(Daemon):
    name = "spark-worker"
    role = "worker"
    klass = WORKER_CLASS

    def argv(self, spark_home: str) -> list[str]:
        p, n = self.ctx.plan.ports, self.ctx.node
        return [f"{spark_home}/bin/spark-class", WORKER_CLASS, "--host", n.rpc_host,
                "--port", str(p.worker), "--webui-port", str(p.worker_ui),
                "--cores", str(self.ctx.cores), "--memory", f"{self.ctx.memory_mb}m",
                "--work-dir", n.path("work"), self.ctx.plan.master_url]  # fmt: skip


#: the install and configuration steps, in order (every node)
PREPARE: tuple[type[Step], ...] = (
    Dirs,
    OsPackages,
    NvidiaDriver,
    PythonEnv,
    Pyspark,
    SparknetWheel,
    SparkConf,
)


# --- the runner ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeReport:
    """Which steps a node applied and which it found done."""

    node: str
    applied: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    def __add__(self, other: NodeReport) -> NodeReport:
        return NodeReport(self.node, self.applied + other.applied, self.skipped + other.skipped)


class StepFailed(SparknetError):
    """A step failed on a node: `node`, `step`, and the last lines of the command's output."""

    def __init__(self, node: str, step: str, what: str, tail: list[str]) -> None:
        last = f": {tail[-1].strip()}" if tail else ""
        super().__init__(f"{node}: step {step} failed ({what}){last}")
        self.node, self.step, self.what, self.tail = node, step, what, tail


def run_steps(node: str, steps: Sequence[Step], conn: Conn, say: Say = _quiet) -> NodeReport:
    """Each step in order on one node: skipped when its check says done, else applied and
    checked again (a step whose check still fails is a bug in it, reported like a failure)."""
    applied: list[str] = []
    skipped: list[str] = []
    for step in steps:
        try:
            if step.check(conn):
                skipped.append(step.name)
                continue
            say(f"{node}: {step.name} ...")
            step.apply(conn)
            if not step.check(conn):
                raise CommandFailed("applied, but its check still fails", [])
        except CommandFailed as exc:
            raise StepFailed(node, step.name, exc.what, exc.tail) from None
        applied.append(step.name)
        say(f"{node}: {step.name} done")
    return NodeReport(node, tuple(applied), tuple(skipped))


def gather_facts(conn: Conn, node: Node) -> Facts:
    try:
        return parse_facts(run(conn, _FACTS), node.prefix)
    except CommandFailed as exc:
        raise StepFailed(node.name, "facts", exc.what, exc.tail) from None


@dataclass(frozen=True)
class BootstrapReport:
    """What a bootstrap did on each node, and the cluster's health after it."""

    nodes: dict[str, NodeReport]
    health: ClusterHealth

    @property
    def nothing_to_do(self) -> bool:
        return not any(r.applied for r in self.nodes.values())

    def lines(self) -> list[str]:
        if self.nothing_to_do:
            return [f"nothing to do: every step was already done on all {len(self.nodes)} nodes"]
        out = []
        for r in self.nodes.values():
            did = ", ".join(r.applied) if r.applied else "nothing"
            out.append(f"{r.node}: applied {did} ({len(r.skipped)} steps already done)")
        return out


def run_on_nodes(
    plan: Plan,
    access: Access,
    nodes_: Sequence[Node],
    steps_for: Callable[[Context], list[Step]],
    say: Say,
    timeout: float,
) -> dict[str, tuple[NodeReport, Facts]]:
    """`steps_for(ctx)` on each of `nodes_` in parallel. Step failures are collected into one
    StepFailed-like SparknetError naming every failed node and step, with each one's output."""
    by_name = {n.name: n for n in nodes_}

    def one(endpoint: Endpoint, conn: Conn) -> tuple[NodeReport, Facts] | StepFailed:
        node = by_name[endpoint.name]
        try:
            facts = gather_facts(conn, node)
            ctx = Context(plan, node, facts)
            return run_steps(node.name, steps_for(ctx), conn, say), facts
        except StepFailed as exc:
            return exc

    results = nodes.run_all([n.endpoint for n in nodes_], access, one, timeout)
    failed = [r for r in results.values() if isinstance(r, StepFailed)]
    if failed:
        raise BootstrapFailed(failed)
    return {k: v for k, v in results.items() if not isinstance(v, StepFailed)}


class BootstrapFailed(SparknetError):
    """Steps failed on some nodes. The first line names each node, step and its last output
    line; the lines after it hold each failure's last output lines."""

    def __init__(self, failures: Sequence[StepFailed]) -> None:
        head = "bootstrap failed: " + "; ".join(str(f) for f in failures)
        body = [
            f"--- {f.node}, step {f.step}, last output:\n" + "\n".join(f"  {ln}" for ln in f.tail)
            for f in failures
            if f.tail
        ]
        super().__init__("\n".join([head, *body]))
        self.failures = list(failures)


def bootstrap(
    plan: Plan,
    access: Access,
    *,
    say: Say = _quiet,
    timeout: float = 3600,
    health_wait_s: float = 120,
) -> BootstrapReport:
    """Bring `plan`'s nodes to a running, healthy Spark standalone cluster; what was done.

    Two rounds over all nodes at once: the install and conf steps (and the master on the master
    node), then the workers, so no worker starts before its master listens. Then the health
    check, which waits up to `health_wait_s` for every worker to register."""

    def prepare(ctx: Context) -> list[Step]:
        steps: list[Step] = [cls(ctx) for cls in PREPARE]
        return steps + ([Master(ctx)] if ctx.is_master else [])

    first = run_on_nodes(plan, access, plan.nodes, prepare, say, timeout)
    second = run_on_nodes(plan, access, plan.nodes, lambda ctx: [Worker(ctx)], say, timeout)
    reports = {n.name: first[n.name][0] + second[n.name][0] for n in plan.nodes}
    expected = [
        Expected(n.name, n.rpc_host, Context(plan, n, second[n.name][1]).cores, n.gpus)
        for n in plan.nodes
    ]
    health = cluster_health(plan.master, plan.ports, expected, access, wait_s=health_wait_s)
    if not health.ok:
        registered = {w.node for w in health.workers}
        missing = [n for n in plan.nodes if n.name not in registered]
        raise SparknetError(
            f"the Spark cluster is not healthy: {'; '.join(health.problems)}"
            + "".join(
                f"\n--- {name}, worker log:\n" + "\n".join(f"  {ln}" for ln in lines)
                for name, lines in _worker_logs(plan, access, missing).items()
            )
        )
    return BootstrapReport(reports, health)


def _worker_logs(plan: Plan, access: Access, missing: Sequence[Node]) -> dict[str, list[str]]:
    """The last lines of the workers' logs on `missing` nodes (what a worker that did not
    register says about why); nothing for a node that cannot be asked."""

    def tail(endpoint: Endpoint, conn: Conn) -> list[str]:
        node = next(n for n in missing if n.name == endpoint.name)
        log = q(node.path("logs", "worker.out"))
        return _tail(run(conn, f"tail -n {TAIL_LINES} {log} 2>/dev/null; true"))

    try:
        return nodes.run_all([n.endpoint for n in missing], access, tail, timeout=60)
    except SparknetError:
        return {}


def prepare_plan(
    nodes_: Sequence[Node], secret_file: Path, wheel_dir: Path, **settings: Any
) -> Plan:
    """A Plan for `nodes_` (the master first): the cluster's secret from `secret_file` (made
    0600 on first use), the sparknet wheel built from this checkout into `wheel_dir`, and the
    other Plan fields from `settings` (ports, python_env, ...)."""
    wheel = build_wheel(source_checkout(), wheel_dir)
    return Plan(tuple(nodes_), wheel, load_or_create_secret(secret_file), **settings)


def stop_daemons(nodes_: Sequence[Node], access: Access, timeout: float = 120) -> None:
    """Stop every node's worker, and the master on the first node (by pid file or systemd
    unit), and remove what would start them again or let a client in: their systemd units and
    the conf file with the cluster's secret. What `down` does before it terminates instances,
    and all it does to a static cluster's machines: the install (venv, wheel) stays for the
    next `up`, which writes the conf and units again. A daemon that is not running is no
    error."""
    # stopping reads only the nodes' paths and facts from a plan: no wheel, no secret
    plan = Plan(tuple(nodes_), Wheel(Path("unused.whl"), "", ""), "")

    def stop(endpoint: Endpoint, conn: Conn) -> None:
        node = next(n for n in plan.nodes if n.name == endpoint.name)
        ctx = Context(plan, node, parse_facts(run(conn, _FACTS), node.prefix))
        Worker(ctx).stop(conn, remove=True)
        if ctx.is_master:
            Master(ctx).stop(conn, remove=True)
        run(conn, f"rm -f {q(node.path('conf', 'spark-defaults.conf'))}")

    nodes.run_all([n.endpoint for n in plan.nodes], access, stop, timeout)


# --- health --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """A worker the master should have: the node, its address, its cores (None: any) and GPUs."""

    node: str
    address: str
    cores: int | None
    gpus: int = 0


@dataclass(frozen=True)
class WorkerState:
    """One worker as the master's JSON shows it."""

    node: str
    address: str
    state: str
    cores: int
    memory_mb: int
    gpus: int


@dataclass(frozen=True)
class ClusterHealth:
    """What `cluster status` prints: the master, each expected worker, and what is wrong."""

    master_url: str
    workers: tuple[WorkerState, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        out = [f"Spark master {self.master_url}: " + ("healthy" if self.ok else "UNHEALTHY")]
        for w in self.workers:
            out.append(
                f"  {w.node} ({w.address}): {w.state}, {w.cores} cores, "
                f"{w.memory_mb} MiB, {w.gpus} GPUs"
            )
        out += [f"  problem: {p}" for p in self.problems]
        return out


def judge(master_json: dict, master_url: str, expected: Sequence[Expected]) -> ClusterHealth:
    """Compare the master's JSON (`/json/`) with the workers the cluster should have."""
    alive = {w.get("host"): w for w in master_json.get("workers", []) if w.get("state") == "ALIVE"}
    states, problems = [], []
    for want in expected:
        got = alive.get(want.address)
        if got is None:
            problems.append(
                f"{want.node}'s worker ({want.address}) is not registered with the master"
            )
            continue
        gpus = len(((got.get("resources") or {}).get("gpu") or {}).get("addresses") or [])
        state = WorkerState(
            want.node, want.address, got["state"], int(got.get("cores", 0)),
            int(got.get("memory", 0)), gpus,
        )  # fmt: skip
        states.append(state)
        if want.cores is not None and state.cores != want.cores:
            problems.append(f"{want.node}'s worker offers {state.cores} cores, not {want.cores}")
        if state.gpus != want.gpus:
            problems.append(f"{want.node}'s worker offers {state.gpus} GPUs, not {want.gpus}")
    return ClusterHealth(master_url, tuple(states), tuple(problems))


def master_json(conn: Conn, ui_port: int) -> dict:
    """The master's state as JSON, fetched on the master node (its UI binds 127.0.0.1 there)."""
    code = (
        "import urllib.request; print(urllib.request.urlopen("
        f"'http://{UI_HOST}:{ui_port}/json/', timeout=5).read().decode())"
    )
    return json.loads(run(conn, f"python3 -c {q(code)}", timeout=30))


def cluster_health(
    master: Node,
    ports: Ports,
    expected: Sequence[Expected],
    access: Access,
    *,
    wait_s: float = 0,
    connect_timeout: float = 20,
) -> ClusterHealth:
    """The cluster's health, asked of the master until it is healthy or `wait_s` has passed
    (workers register within seconds of starting). A master that does not answer is a
    problem, not an exception: `cluster status` prints it; a master node that takes no SSH
    connection within `connect_timeout` is a SparknetError."""
    url = f"spark://{master.rpc_host}:{ports.master}"
    deadline = time.monotonic() + wait_s
    conn = nodes.connect(master.endpoint, access, connect_timeout)
    try:
        while True:
            try:
                health = judge(master_json(conn, ports.master_ui), url, expected)
            except (CommandFailed, ValueError) as exc:
                what = exc.tail[-1] if isinstance(exc, CommandFailed) and exc.tail else str(exc)
                health = ClusterHealth(url, (), (f"the master does not answer ({what})",))
            if health.ok or time.monotonic() >= deadline:
                return health
            time.sleep(0.5)
    finally:
        conn.close()


def require_healthy(
    master: Node, ports: Ports, expected: Sequence[Expected], access: Access, wait_s: float = 0
) -> ClusterHealth:
    """`cluster_health`, or one SparknetError naming what is wrong (the missing worker)."""
    health = cluster_health(master, ports, expected, access, wait_s=wait_s)
    if not health.ok:
        raise SparknetError(f"the Spark cluster is not healthy: {'; '.join(health.problems)}")
    return health


# --- the wheel -----------------------------------------------------------------------------------


def source_checkout() -> Path:
    """The checkout this sparknet runs from (pyproject.toml beside the package): what the nodes
    install, so they run exactly the submitter's code."""
    import sparknet

    root = Path(sparknet.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise SparknetError(
            f"sparknet runs from {root}, not from a source checkout: install it with "
            "`pip install -e <checkout>` so the nodes can be given the same version"
        )
    return root


#: what a wheel is built from (the package, and the files its build reads)
WHEEL_SOURCES = ("pyproject.toml", "README.md", "sparknet", "infra")


def build_wheel(checkout: Path, out_dir: Path) -> Wheel:
    """`pip wheel --no-deps` of a copy of `checkout`'s sources (a build in the checkout would
    leave build/ there), into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sparknet-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in WHEEL_SOURCES:
            source = checkout / name
            if source.is_dir():
                shutil.copytree(
                    source, src / name, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".terraform", "*.tfstate*"),
                )  # fmt: skip
            elif source.exists():
                shutil.copy(source, src / name)
        dist = Path(tmp) / "dist"
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel"]
        done = subprocess.run(
            [*pip, "--no-deps", "--no-build-isolation", str(src), "-w", str(dist)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode != 0:
            last = _tail(done.stdout, done.stderr)
            raise SparknetError(
                f"could not build the sparknet wheel from {checkout}: "
                + (last[-1] if last else f"pip exited {done.returncode}")
            )
        (built,) = dist.glob("sparknet-*.whl")
        target = out_dir / built.name
        shutil.copy(built, target)
    return wheel_info(target)


def wheel_info(path: Path) -> Wheel:
    """A built wheel's version (from its name) and digest (of its RECORD)."""
    version = path.name.split("-")[1]
    with zipfile.ZipFile(path) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        digest = hashlib.sha256(zf.read(record)).hexdigest()
    return Wheel(path, version, digest)
