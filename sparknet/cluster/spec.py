"""What a cluster is: `ClusterSpec`, and the constants every part of `cluster/` shares.

`ClusterSpec` comes from `clusters:` in sparknet.yaml plus flags; the constants are the tag
keys, the roles, the default AMI parameter."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sparknet import aws
from sparknet.aws import check_bucket_name
from sparknet.cluster.address import parse_address
from sparknet.errors import SparknetError

#: every AWS resource sparknet makes carries both tags; `down` and `sweep` find resources by them
TAG_CLUSTER = "sparknet:cluster"
TAG_ROLE = "sparknet:role"
#: the principal (STS caller ARN) that made the resource: `sweep` touches only the caller's own
TAG_OWNER = "sparknet:owner"

#: what AWS accepts in a tag value on every service sparknet tags (IAM's and S3's rule, the
#: strictest): letters, digits, spaces and ``_ . : / = + - @``, at most 256 characters
TAG_VALUE_MAX = 256
_TAG_VALUE_BAD = re.compile(r"[^\w .:/=+\-@]")  # \w: letters, digits and _

#: the widest SSH source sparknet accepts (as infra/variables.tf): a /15 or wider opens SSH to a
#: large part of the internet. IPv6 sources are refused whole: the cluster's network has no IPv6.
MIN_SSH_PREFIX = 16

#: the most workers of one cluster: every worker launches in one AZ, so into one of the
#: foundation's /24 subnets (infra/rules/network.json), which holds 251 addresses (AWS keeps 5 of
#: 256), the master's among them
MAX_WORKERS = 250
#: a week: the longest idle time `autostop_minutes` may give (0 turns the timer off)
MAX_AUTOSTOP_MINUTES = 7 * 24 * 60
#: the backstop every EC2 instance carries from launch until the autostop timer replaces it:
#: at least what a bootstrap needs (a first boot, torch's download, a driver's reboot; the
#: backstop starts afresh at each boot), at most a day
MIN_BACKSTOP_MINUTES, MAX_BACKSTOP_MINUTES = 10, 24 * 60
#: the most GPUs any EC2 instance type has (p2.16xlarge: 16; p4d, p5: 8)
MAX_GPUS_PER_NODE = 16
#: room above the largest EC2 instance types (u7inh-32tb.480xlarge: 1920 vCPUs, 32 TiB)
MAX_WORKER_CORES = 4096
MAX_WORKER_MEMORY_MB = 32 * 1024 * 1024
#: an EBS gp3 volume's size in GiB: 1 to 16 TiB; a root volume needs 8 for the OS
MIN_ROOT_VOLUME_GB, MAX_ROOT_VOLUME_GB = 8, 16384

#: the bucket's two key prefixes, checked by `check_prefixes` here and by infra/variables.tf with
#: the same pattern and the same words: nodes read everything under `data_prefix` and write under
#: `runs_prefix` + `<cluster>/`, so a prefix that overlaps the other gives the nodes read of every
#: cluster's runs (`data_prefix: r` covers `runs/`) or write inside the shared data
PREFIX_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9._-]*/)+$"
PREFIX_MAX_LENGTH = 256
PREFIX_RULE = (
    "{name} must be a key prefix such as {example}: at most 256 characters, parts of letters, "
    "digits, '.', '_' and '-' that each start with a letter or digit and end with / (not empty, "
    "no leading /, no . or .. parts, no wildcards)."
)
PREFIXES_APART_RULE = (
    "data_prefix and runs_prefix must not overlap: neither may equal the other or start with it "
    "(nodes read everything under data_prefix and write under runs_prefix)."
)
#: the example each prefix's error names (its default)
PREFIX_EXAMPLES = {"data_prefix": "datasets/", "runs_prefix": "runs/"}

#: the worker types tried in order where none are given (one GPU each); in a region that lacks
#: some of them the others are tried (`preflight.in_region`)
DEFAULT_INSTANCE_TYPES = ("g5.xlarge", "g4dn.xlarge", "g6.xlarge")

#: the AWS Deep Learning Base AMI (GPU driver, CUDA, Docker) for Ubuntu 24.04, newest release: its
#: python3 is 3.12, which runs pyspark 4.x (the 22.04 one's 3.10 does not)
DEFAULT_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
)

#: `bootstrap: package_index`: torch from PyTorch's own index for the node's CUDA, everything
#: else from the node's pip configuration (the default)
PACKAGE_INDEX_PYTORCH = "pytorch"
#: every package from the node's own pip configuration (`pip.conf`, PIP_INDEX_URL): an internal
#: mirror that the node is already set up for
PACKAGE_INDEX_NODE = "node"

#: Terraform for the foundation and the data files (security rules, IAM policy documents) that
#: Terraform and the boto3 foundation both read, so the two cannot drift apart. In a checkout,
#: sparknet/cluster/infra is a link to the repository's infra/; a wheel carries the files there
#: (package data), so an installed sparknet reads the same single copy.
INFRA_DIR = Path(__file__).resolve().parent / "infra"


def check_package_index(value: str) -> str:
    """`value` as `bootstrap: package_index` takes it: pytorch, node, or an https:// or file://
    index URL. Plain http:// is refused: pip ignores such an index unless told to trust its host
    (`--trusted-host`), and packages fetched over it can be replaced in transit. The message
    leaves the value out: the settings loader and the CLI add it."""
    if value in (PACKAGE_INDEX_PYTORCH, PACKAGE_INDEX_NODE) or re.fullmatch(
        r"(https|file)://[^\s'\"]+", value
    ):
        return value
    if re.match(r"http://", value, re.I):
        raise ValueError(
            "a plain http:// index is refused (packages over plain http can be replaced in "
            "transit, and pip ignores such an index): serve the mirror over https://, or set "
            "package_index: node and trust it in the nodes' own pip.conf"
        )
    raise ValueError("give pytorch, node, or an index URL such as https://pypi.example.com/simple")


class BootstrapSettings(BaseModel):
    """How `up` and `cluster bootstrap` set the nodes' Spark up (`bootstrap:` of a cluster).

    Every field has a default that fits the Deep Learning AMIs; they exist for nodes that are
    not such (a static host, a node shared with other work) and for tests, which run several
    nodes on one host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python_env: str | None = Field(
        None,
        description="an existing Python env on the nodes whose torch fits; default: the "
        "AMI's PyTorch env when its torch fits, else a fresh venv with torch",
    )
    package_index: str = Field(
        PACKAGE_INDEX_PYTORCH,
        description="where the nodes' pip finds packages: `pytorch` (torch from PyTorch's "
        "index for the node's CUDA, the rest from the node's pip configuration), `node` "
        "(everything from the node's own pip configuration: an internal mirror), or an https:// "
        "or file:// index URL (everything from it, as pip's --index-url)",
    )
    worker_cores: int | None = Field(
        None, ge=1, le=MAX_WORKER_CORES, description="default: the node's cores"
    )
    worker_memory_mb: int | None = Field(
        None,
        ge=512,
        le=MAX_WORKER_MEMORY_MB,
        description="default: the node's memory less headroom",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        le=MAX_GPUS_PER_NODE,
        description="GPUs each worker offers to Spark; default: its instance type's "
        "(DescribeInstanceTypes), 0 for a type without GPUs",
    )
    master_port: int = Field(7077, ge=1, le=65535)
    master_ui_port: int = Field(8080, ge=1, le=65535)
    worker_ui_port: int = Field(8081, ge=0, le=65535, description="0: any free port")

    @field_validator(
        "worker_cores", "worker_memory_mb", "gpus_per_node", "master_port", "master_ui_port",
        "worker_ui_port", mode="before",
    )  # fmt: skip
    @classmethod
    def _numbers_not_bools(cls, value: Any) -> Any:
        return _not_a_bool(value)

    @field_validator("package_index")
    @classmethod
    def _an_index(cls, value: str) -> str:
        return check_package_index(value)

    @model_validator(mode="after")
    def _ports_apart(self) -> BootstrapSettings:
        """The master runs a worker too: two daemons on one port would not both start."""
        ports = {"master_port": self.master_port, "master_ui_port": self.master_ui_port}
        if self.worker_ui_port:
            ports["worker_ui_port"] = self.worker_ui_port
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise ValueError(f"{seen[port]} and {name} are both {port}; give each its own port")
            seen[port] = name
        return self


#: the settings that say how EC2 instances are made: a `static` cluster, made of machines the
#: user already has, refuses them rather than ignore them
AWS_ONLY = (
    "region", "availability_zones", "master_type", "instance_types", "spot", "ami", "ami_parameter",
    "root_volume_gb", "key_name", "allowed_cidr", "vpc_id", "subnet_ids", "foundation",
    "terraform_backend", "autostop_minutes", "backstop_minutes",
)  # fmt: skip


class ClusterSpec(BaseModel):
    """One cluster: its name, where, what machines, and how the foundation is made.

    `provider: aws` (the default) launches EC2 instances; `provider: static` is a cluster of
    machines the user already has (`hosts`), which sparknet bootstraps and stops but never
    launches or deletes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: 2-31 of a-z 0-9 and single hyphens, a letter first and no hyphen last: it becomes
    #: `<name>-master`, `sparknet-<name>-<region>` and file names, where `c2-` or `a--b` would
    #: read as a typo
    name: str = Field(
        min_length=2,
        max_length=31,
        pattern=r"^[a-z](?:-?[a-z0-9])+$",
        description="unique per account+region",
    )
    provider: Literal["aws", "static"] = Field(
        "aws", description="aws: EC2 instances sparknet launches; static: your own `hosts`"
    )
    hosts: list[str] = Field(
        default_factory=list,
        description="static: the machines as [user@]host[:port], the master first; every host "
        "runs a Spark worker",
    )
    known_hosts: str | None = Field(
        None,
        description="static: an OpenSSH known_hosts file with the hosts' keys; default: "
        "~/.ssh/known_hosts",
    )
    region: str = "us-east-1"
    availability_zones: list[str] = Field(
        default_factory=list, description="fallback order; default: every AZ of the region"
    )
    workers: int = Field(2, ge=0, le=MAX_WORKERS, description="0: the master's worker only")
    master_type: str = Field(
        DEFAULT_INSTANCE_TYPES[0],
        description="unset: g5.xlarge, or where the cluster's AZs lack it the first default "
        "worker type they offer",
    )
    instance_types: list[str] = Field(
        default_factory=lambda: list(DEFAULT_INSTANCE_TYPES),
        min_length=1,
        description="worker types in fallback order; unset: those of the defaults the "
        "cluster's AZs offer",
    )
    spot: bool = Field(False, description="workers on spot (the master is always on-demand)")
    ami: str | None = Field(None, description="an AMI id; default: from ami_parameter")
    ami_parameter: str = DEFAULT_AMI_PARAMETER
    root_volume_gb: int = Field(100, ge=MIN_ROOT_VOLUME_GB, le=MAX_ROOT_VOLUME_GB)
    key_name: str | None = Field(
        None, description="your own EC2 key pair (with key_file); default: one sparknet makes"
    )
    key_file: str | None = Field(None, description="the private key of key_name (mode 0600)")
    allowed_cidr: str | None = Field(None, description="SSH source; default: the caller's /32")
    vpc_id: str | None = Field(None, description="an existing VPC to use (with subnet_ids)")
    subnet_ids: list[str] = Field(default_factory=list, description="its subnets, one per AZ")
    foundation: Literal["terraform", "boto3"] = "boto3"
    terraform_backend: dict[str, str] | None = Field(
        None,
        description="-backend-config settings of the backend declared in "
        "infra/backend_override.tf; default: local state under ~/.sparknet/clusters/<name>/",
    )
    bucket: str | None = Field(None, description="data and runs bucket")
    data_prefix: str = "datasets/"
    runs_prefix: str = "runs/"
    cross_region_data: bool = Field(
        False,
        description="let the cluster read a bucket in another region (cross-region transfer "
        "is billed per GB); default: such a bucket is refused before launch",
    )
    bootstrap: BootstrapSettings = Field(default_factory=BootstrapSettings)
    autostop_minutes: int = Field(
        30,
        ge=0,
        le=MAX_AUTOSTOP_MINUTES,
        description="the master terminates the cluster after this many minutes with no job "
        "running and no submitter attached; 0: off",
    )
    backstop_minutes: int = Field(
        60,
        ge=MIN_BACKSTOP_MINUTES,
        le=MAX_BACKSTOP_MINUTES,
        description="each instance shuts down (and so terminates) this many minutes after it "
        "boots until the bootstrap has started the autostop timer, which replaces it: a "
        "bootstrap that fails or is cut off leaves nothing billing",
    )
    owner: str | None = Field(
        None,
        description="set by `up` from STS GetCallerIdentity (the caller's ARN) and tagged on "
        "every resource as sparknet:owner; not a user setting",
    )

    @field_validator(
        "workers", "root_volume_gb", "autostop_minutes", "backstop_minutes", mode="before"
    )
    @classmethod
    def _numbers_not_bools(cls, value: Any) -> Any:
        return _not_a_bool(value)

    @field_validator("region")
    @classmethod
    def _known_region(cls, region: str) -> str:
        try:
            return aws.check_region(region)
        except SparknetError as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("allowed_cidr")
    @classmethod
    def _ssh_source_not_the_internet(cls, cidr: str | None) -> str | None:
        return None if cidr is None else check_ssh_cidr(cidr)

    @field_validator("bucket")
    @classmethod
    def _s3_bucket_name(cls, bucket: str | None) -> str | None:
        return None if bucket is None else check_bucket_name(bucket)

    @field_validator("owner")
    @classmethod
    def _owner_as_tag_value(cls, owner: str | None) -> str | None:
        return None if owner is None else tag_value(owner)

    @property
    def cluster_runs_prefix(self) -> str:
        """Where this cluster's runs go (``runs/<cluster>/``): its nodes may write only there, so
        one cluster cannot overwrite or delete another's runs."""
        return f"{self.runs_prefix}{self.name}/"

    @model_validator(mode="after")
    def _prefixes(self) -> ClusterSpec:
        check_prefixes(self.data_prefix, self.runs_prefix)
        return self

    @model_validator(mode="after")
    def _existing_network(self) -> ClusterSpec:
        if bool(self.vpc_id) != bool(self.subnet_ids):
            raise ValueError("vpc_id and subnet_ids go together: give both or neither")
        return self

    @model_validator(mode="before")
    @classmethod
    def _static_workers(cls, data: Any) -> Any:
        """A static cluster's workers are its hosts after the master: counted, not set."""
        if isinstance(data, dict) and data.get("provider") == "static":
            hosts = data.get("hosts")
            if isinstance(hosts, list) and hosts and data.get("workers") is None:
                data = {**data, "workers": len(hosts) - 1}
        return data

    @model_validator(mode="after")
    def _provider_settings(self) -> ClusterSpec:
        """Settings of the other provider are refused, not ignored: a static cluster with
        `spot: true` would otherwise run on what the user did not ask for."""
        if self.provider == "aws":
            if self.hosts or self.known_hosts:
                raise ValueError(
                    "hosts and known_hosts are for `provider: static` (machines you have); "
                    "remove them, or set provider: static"
                )
            return self
        defaults = {
            name: ClusterSpec.model_fields[name].get_default(call_default_factory=True)
            for name in AWS_ONLY
        }
        given = [name for name, default in defaults.items() if getattr(self, name) != default]
        if given:
            raise ValueError(
                f"{', '.join(given)}: EC2 settings, not for `provider: static`; remove them"
            )
        if not self.hosts:
            raise ValueError("provider: static needs hosts: [user@host:port, ...], master first")
        if not self.key_file:
            raise ValueError(
                "provider: static needs key_file: the private key that logs in to the hosts"
            )
        if self.workers != len(self.hosts) - 1:
            raise ValueError(
                f"a static cluster's workers are its hosts after the master ({len(self.hosts)} "
                f"hosts: workers {len(self.hosts) - 1}), not {self.workers}; change hosts"
            )
        _check_hosts(self.hosts)
        return self

    @model_validator(mode="after")
    def _own_key(self) -> ClusterSpec:
        """sparknet logs in to the nodes too (bootstrap, `cluster ssh`): a key pair of the
        user's is no use to it without the private key's file."""
        if self.provider == "static":
            return self
        if bool(self.key_name) != bool(self.key_file):
            raise ValueError(
                "key_name and key_file go together: your EC2 key pair and the file of its "
                "private key (or neither: sparknet then makes a key pair for the cluster)"
            )
        if self.key_name and (len(self.key_name) > 255 or not self.key_name.isascii()):
            raise ValueError(f"key_name {self.key_name!r} is not 1-255 ASCII characters")
        return self


def _not_a_bool(value: Any) -> Any:
    """A number of the spec given as true/false (YAML's `yes`, `no`, `on`, `off` too) is refused,
    not read as 1 or 0: `autostop_minutes: on` would stop the cluster after one idle minute."""
    if isinstance(value, bool):
        raise ValueError(f"a number, not {str(value).lower()}")
    return value


def _check_hosts(hosts: list[str]) -> None:
    """Each host an SSH address (``[user@]host[:port]``), none twice."""
    seen: dict[tuple[str, int], str] = {}
    for k, text in enumerate(hosts):
        name = "master" if k == 0 else f"worker-{k}"
        try:
            endpoint = parse_address(name, text)
        except SparknetError as exc:
            raise ValueError(str(exc)) from exc
        where = (endpoint.host, endpoint.port)
        if where in seen:
            raise ValueError(f"hosts: {text!r} is {seen[where]!r} again; give each machine once")
        seen[where] = text


def check_prefixes(data_prefix: str, runs_prefix: str) -> None:
    """The one rule for the bucket's two key prefixes, for both foundations (infra/variables.tf
    holds the same pattern and words): each a prefix such as ``datasets/`` (`PREFIX_PATTERN`, at
    most `PREFIX_MAX_LENGTH` characters), and neither inside the other nor equal to it. A
    ValueError with the rule's words and the value refused.

    >>> check_prefixes("datasets/", "runs/")
    >>> check_prefixes("r", "runs/")
    Traceback (most recent call last):
    ...
    ValueError: data_prefix must be a key prefix such as datasets/: ... Got 'r'.
    """
    for name, value in (("data_prefix", data_prefix), ("runs_prefix", runs_prefix)):
        if len(value) > PREFIX_MAX_LENGTH or not re.fullmatch(PREFIX_PATTERN, value):
            rule = PREFIX_RULE.format(name=name, example=PREFIX_EXAMPLES[name])
            raise ValueError(f"{rule} Got {value!r}.")
    if data_prefix.startswith(runs_prefix) or runs_prefix.startswith(data_prefix):
        raise ValueError(f"{PREFIXES_APART_RULE} Got {data_prefix!r} and {runs_prefix!r}.")


def check_ssh_cidr(cidr: str) -> str:
    """`cidr` as a normalized IPv4 network no wider than /16, as `infra/variables.tf` checks it.

    The cluster's VPC has no IPv6, so an IPv6 source could reach nothing and is refused too.
    """
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError as exc:
        raise ValueError(f"{cidr!r} is not an IPv4 CIDR such as 203.0.113.7/32") from exc
    if net.version == 6:
        raise ValueError(
            f"{cidr!r} is IPv6; the cluster's network is IPv4 only: give an IPv4 CIDR such as "
            "203.0.113.7/32"
        )
    if net.prefixlen < MIN_SSH_PREFIX:
        raise ValueError(
            f"SSH from {net} is open to {net.num_addresses:,} addresses; give your own /32 or "
            f"a network of /{MIN_SSH_PREFIX} or narrower"
        )
    return str(net)


def tag_value(text: str) -> str:
    """`text` as a tag value every service accepts: characters outside IAM's and S3's set
    (letters, digits, spaces, ``_ . : / = + - @``) become ``_``; at most 256 characters.

    An STS ARN fits as it is (``arn:aws:sts::123456789012:assumed-role/Dev/alice@example.com``);
    a session name may hold a ``,`` which IAM refuses in tags.
    """
    return _TAG_VALUE_BAD.sub("_", text)[:TAG_VALUE_MAX]
