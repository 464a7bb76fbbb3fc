"""What the bootstrap knows of a cluster.

Its nodes (`Node`), what they install and how their daemons are set up (`Plan`), what one
command tells about a node (`Facts`), and one node's step inputs together (`Context`)."""

from __future__ import annotations

import importlib.metadata
import re
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from sparknet.cluster.address import Endpoint
from sparknet.cluster.aws.autostop import Settings as AutostopSettings
from sparknet.cluster.node_endpoints import node_layout
from sparknet.cluster.nodes import Access
from sparknet.cluster.remote import Conn, q, run_script, succeeds
from sparknet.cluster.spark.spark_conf import (
    DEFAULT_PREFIX,
    TORCH_MIN,
    Ports,
    instance_store_dirs,
    mem_total_kb,
    parse_nvme_models,
    torch_index_url,
    worker_memory_mb,
)
from sparknet.cluster.spark.wheel import Wheel
from sparknet.cluster.spec import PACKAGE_INDEX_NODE, PACKAGE_INDEX_PYTORCH
from sparknet.errors import SparknetError
from sparknet.node import job as node_job

#: a job's dir on its master is ``<prefix>/jobs/<run id>`` (sparknet-submit's); its session's pid
#: file there (the supervisor's, whose process group is the whole job), and the marker of a job
#: that was ended on purpose
JOBS_DIR, JOB_PID, JOB_CANCELLED = "jobs", node_job.PID, node_job.CANCELLED

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


def laid_out(cluster: str, endpoint: Endpoint, address: str | None, gpus: int = 0) -> Node:
    """Node `endpoint` of `cluster` where the endpoints file's ``<cluster>/<node>/node`` entry
    places it (its own private address and install prefix: several nodes on one host), else at
    `address` under DEFAULT_PREFIX: the one place either provider lays a node out."""
    layout = node_layout(cluster, endpoint.name)
    return Node(
        endpoint,
        address=layout.get("address") or address,
        prefix=layout.get("prefix") or DEFAULT_PREFIX,
        gpus=gpus,
    )


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
    #: where the nodes' pip finds packages (`BootstrapSettings.package_index`): `pytorch`,
    #: `node` (the node's own pip configuration) or an index URL
    package_index: str = PACKAGE_INDEX_PYTORCH
    #: what each worker offers; default: the node's cores, and its memory less headroom
    worker_cores: int | None = None
    worker_memory_mb: int | None = None
    #: whether a GPU node without a working driver gets one installed (an EC2 instance of
    #: sparknet's); on a machine of the user's (static) the step says so and stops instead
    install_drivers: bool = True
    #: the master's autostop timer (`autostop.py`); None: none is installed (a static cluster's
    #: machines are the user's, and the tests' plans need none)
    autostop: AutostopSettings | None = None
    #: the region of an EC2 cluster, which the nodes' Pythons get as AWS_DEFAULT_REGION (their
    #: S3 clients then ask the region's endpoint, not us-east-1's); None: a static cluster's
    region: str | None = None

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

    def python_needs(self) -> dict[str, SpecifierSet]:
        """The Python versions what the nodes install accepts, by what: the pyspark of
        `pyspark_version` (the submitter's installed one's Requires-Python: the same release)
        and the sparknet wheel's own requires-python (read from the wheel, which was built from
        the checkout now, not from a metadata an older install left)."""
        needs: dict[str, SpecifierSet] = {}
        try:
            if importlib.metadata.version("pyspark") == self.pyspark_version:
                spec = importlib.metadata.metadata("pyspark").get("Requires-Python")
                if spec:
                    needs[f"pyspark {self.pyspark_version}"] = SpecifierSet(spec)
        except (importlib.metadata.PackageNotFoundError, InvalidSpecifier):
            pass  # no such pyspark here, or a bound it cannot read: the wheel's bound decides
        spec = wheel_requires_python(self.wheel.path)
        if spec:
            needs[f"sparknet {self.wheel.version}"] = SpecifierSet(spec)
        return needs


def wheel_requires_python(path: Path) -> str | None:
    """The Requires-Python of a built wheel's METADATA; None when the file is not a wheel that
    says (a test's plan names a wheel it never builds)."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            return HeaderParser().parsestr(zf.read(name).decode()).get("Requires-Python")
    except (OSError, zipfile.BadZipFile, StopIteration):
        return None


def python_problem(python: str, version: str | None, needs: dict[str, SpecifierSet]) -> str | None:
    """Why `python` (its version `version`, None: not there) cannot run what the node installs
    (`Plan.python_needs`), in words that say what is needed; None when it can."""
    wanted = " and ".join(f"{what} needs Python {spec}" for what, spec in needs.items())
    if version is None:
        return f"the node has no {python}, and {wanted or 'sparknet needs Python 3'}"
    refused = {what: spec for what, spec in needs.items() if not spec.contains(version)}
    if not refused:
        return None
    return f"{python} is Python {version}, but " + " and ".join(
        f"{what} needs Python {spec}" for what, spec in refused.items()
    )


#: how the nodes' pip meets the network: 20 s without a byte ends a try (pip's --timeout is a
#: socket read timeout: it bounds a silent index, never a download that flows), and three retries
#: of a failed request (a 5xx or a reset) keep a multi-GB torch download from failing on two
#: errors in a row; pip's default of five retries of 15 s is minutes of silence on a dead index
PIP_NETWORK = "--retries 3 --timeout 20"


#: where the Deep Learning AMIs with PyTorch keep it (a venv on newer ones, conda on older)
AMI_TORCH_ENVS = ("/opt/pytorch", "/opt/conda/envs/pytorch")


def torch_new_enough(version: str | None) -> bool:
    """Whether torch `version` ("2.8.0+cu128") is TORCH_MIN or newer; False for none."""
    parts = re.findall(r"\d+", version or "")[:2]
    return len(parts) == 2 and tuple(int(p) for p in parts) >= TORCH_MIN


@dataclass(frozen=True)
class AmiEnv:
    """One of AMI_TORCH_ENVS on a node, as the facts command finds it."""

    path: str
    #: its Python's version ("3.11.9"); None: its python does not run
    python: str | None = None
    #: its torch's version by metadata; None: it has none
    torch: str | None = None

    @property
    def torch_fits(self) -> bool:
        """Whether the node's venv may be laid over it: its torch is new enough by version
        (`PythonEnv` then also imports it, and on a GPU node asks it for the GPUs)."""
        return torch_new_enough(self.torch)


def parse_ami_env(line: str) -> AmiEnv:
    """One line of the facts script's `@envs` section: the env's path, then its probe's output
    (nothing where its python does not run)."""
    path, *probe = line.split()
    python = probe[0] if probe and re.fullmatch(r"\d+\.\d+\.\d+\S*", probe[0]) else None
    torch = probe[1] if python and len(probe) > 1 and probe[1] != "-" else None
    return AmiEnv(path, python, torch)


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
    #: which of AMI_TORCH_ENVS the node has (a python there), with their Python and torch
    envs: tuple[AmiEnv, ...] = ()
    #: the version of the node's `python3` ("3.12.3"); None: it has none
    python: str | None = None


#: the package's script that prints a node's Facts (it runs before the wheel is there)
FACTS_SCRIPT = "facts.sh"


def node_facts(conn: Conn, prefix: str, envs: tuple[str, ...] | None = None) -> Facts:
    """The node's Facts, from one run of FACTS_SCRIPT, looking for torch envs at `envs`
    (default AMI_TORCH_ENVS)."""
    found = run_script(conn, FACTS_SCRIPT, *(AMI_TORCH_ENVS if envs is None else envs))
    return parse_facts(found, prefix)


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
        envs=tuple(
            parse_ami_env(line) for line in part.get("envs", "").splitlines() if line.strip()
        ),
        python=python_version(part.get("python", "")),
    )


def python_version(text: str) -> str | None:
    """The version in `python3 --version`'s output (``Python 3.12.3``); None for anything else
    (``python3: command not found``)."""
    match = re.fullmatch(r"Python (\d+\.\d+\.\d+)\S*", text.strip())
    return match.group(1) if match else None


@dataclass(frozen=True)
class Context:
    """One node's step inputs: the cluster plan, the node and its facts, and how the node is
    reached (a step that reboots the node connects to it again)."""

    plan: Plan
    node: Node
    facts: Facts
    #: the cluster's key and pinned host keys; None: the node cannot be reached again (a
    #: step that would reboot it says so instead)
    access: Access | None = None

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
        """The existing env the node's venv is laid over: the plan's, else the first of the
        AMI's whose torch is new enough. An AMI env with an older torch (or none) is passed
        over: the venv is then made from `python3`, so that is the Python `NodePython` checks
        and `OsPackages` must give venv support to."""
        if self.plan.python_env:
            return self.plan.python_env.rstrip("/")
        env = next((e for e in self.facts.envs if e.torch_fits), None)
        return env.path.rstrip("/") if env else None

    @property
    def passed_over(self) -> tuple[AmiEnv, ...]:
        """The AMI envs the venv is not laid over for their torch (none when the plan names
        its own env): what a refusal of `python3` must name, the reason it is used at all."""
        if self.plan.python_env:
            return ()
        return tuple(e for e in self.facts.envs if not e.torch_fits)

    def pip_install(self, conn: Conn, index: str | None = None) -> str:
        """`pip install` into the node's venv, with bounded retries and the plan's index
        (`index`: flags from `index_flags`; default: the plan's for packages other than torch):
        its own pip where it has one, else the base env's pip aimed at it (a venv laid over a
        base env has none of its own). The index flags follow `install`: they are options of
        that command, which pip refuses before it (`no such option: --index-url`)."""
        index = self.index_flags() if index is None else index
        flags = f"-q --disable-pip-version-check {PIP_NETWORK} {index}".rstrip()
        if self.base_env is None or succeeds(
            conn, f"[ -x {q(self.node.path('venv', 'bin', 'pip'))} ]"
        ):
            return f"{q(self.node.python)} -m pip install {flags}"
        base = q(f"{self.base_env}/bin/python")
        return f"{base} -m pip --python {q(self.node.python)} install {flags}"

    def index_flags(self, torch_for_cuda: str | None = None, torch: bool = False) -> str:
        """pip's index flags for what the plan's `package_index` says: none for the node's own
        pip configuration, `--index-url URL` for a URL; with `torch` and the default, PyTorch's
        index for the driver's CUDA `torch_for_cuda` (None: the CPU build)."""
        index = self.plan.package_index
        if index == PACKAGE_INDEX_NODE:
            return ""
        if index == PACKAGE_INDEX_PYTORCH:
            return f"--index-url {q(torch_index_url(torch_for_cuda))}" if torch else ""
        return f"--index-url {q(index)}"
