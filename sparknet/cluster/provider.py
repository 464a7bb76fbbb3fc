"""The provider interface: what every command asks of a cluster, whichever provider made it.

A provider is a module of the functions and constants `Provider` lists, each returning the
records of records.py: `aws` (ec2.py: EC2 instances sparknet launches, found by their tag) and
`static` (static.py: hosts of the user's, whose registry entry here is the record). `of` is
the one place that picks it, from `spec.provider`; nothing above cluster/ asks which one it has
(as SkyPilot's `sky/provision` routes each call to its cloud's module). What differs in what a
command prints or allows follows from a record (`ClusterInfo.hosts`, a price of None) or a
constant (`REGIONAL`, `AUTOSTOP`, `LAUNCHES`), never from the provider's name.
"""

from __future__ import annotations

from typing import Protocol, cast

from sparknet.cluster import ec2, static
from sparknet.cluster.address import Endpoint
from sparknet.cluster.nodes import Access
from sparknet.cluster.records import ClusterInfo, DownReport, Planned
from sparknet.cluster.spark.health import ClusterHealth
from sparknet.cluster.spark.plan import Node
from sparknet.cluster.spec import ClusterSpec
from sparknet.say import Say


class Provider(Protocol):
    """What a provider module implements (the constants and functions below, same names)."""

    #: commands name the cluster with its region (`--region`): its resources live in one
    REGIONAL: bool
    #: the master carries an autostop timer that ends the cluster once idle
    AUTOSTOP: bool
    #: sparknet launches the machines: instance types, market and a node role are its to choose
    LAUNCHES: bool

    def up(
        self, spec: ClusterSpec, *, endpoint_url: str | None, say: Say, bootstrap: bool,
        any_owner: bool,
    ) -> ClusterInfo:  # fmt: skip
        """Bring the cluster up (idempotent) and, with `bootstrap`, Spark on it."""

    def down(
        self, spec: ClusterSpec, *, endpoint_url: str | None, say: Say, any_owner: bool,
        forget_unreachable: bool,
    ) -> DownReport:  # fmt: skip
        """End the cluster (its instances, or Spark on the user's hosts) and forget it here."""

    def teardown(self, spec: ClusterSpec, *, endpoint_url: str | None, say: Say) -> None:
        """`down` after a submit's job, where nothing of the cluster there is no error."""

    def status(self, spec: ClusterSpec, *, endpoint_url: str | None) -> ClusterInfo:
        """The cluster as it is; `ClusterNotFound` when nothing of it is there."""

    def bootstrap(
        self, spec: ClusterSpec, *, endpoint_url: str | None, say: Say, force: bool
    ) -> ClusterInfo:
        """The bootstrap again on the running cluster (idempotent); `JobRunning` where it would
        restart the master under a running job, unless `force`."""

    def health(
        self, spec: ClusterSpec, info: ClusterInfo, *, endpoint_url: str | None
    ) -> ClusterHealth:
        """Spark's health as the master tells it; a SparknetError when it cannot be asked."""

    def current(self, spec: ClusterSpec) -> ClusterSpec:
        """The spec the running cluster is acted on with (a static cluster's registered one)."""

    def in_use(self, spec: ClusterSpec, endpoint_url: str | None) -> bool:
        """Anything of the cluster is there (an instance in any live state, a registration)."""

    def master_running(self, spec: ClusterSpec, endpoint_url: str | None) -> bool:
        """The cluster can run a job now."""

    def check_running(self, spec: ClusterSpec, endpoint_url: str | None) -> None:
        """`ClusterNotFound`, one line saying what starts it, unless `master_running`."""

    def check_launch(self, spec: ClusterSpec, endpoint_url: str | None) -> None:
        """What can fail before `up` costs or starts anything, checked without writing."""

    def check_owner(self, spec: ClusterSpec, endpoint_url: str | None) -> None:
        """`NotYours` where the cluster is another principal's."""

    def gpus_by_type(self, spec: ClusterSpec, endpoint_url: str | None) -> dict[str, int]:
        """GPUs of each kind of machine known before launch (empty: counted once reached)."""

    def planned_nodes(self, spec: ClusterSpec, endpoint_url: str | None) -> tuple[int, int | None]:
        """(Spark worker nodes, GPUs of each; None: unknown until reached) of a cluster to make."""

    def planned(self, spec: ClusterSpec, endpoint_url: str | None) -> list[Planned]:
        """The machines of a cluster to make, by role, with what they would cost per hour."""

    def nodes_of(self, spec: ClusterSpec, endpoint_url: str | None) -> tuple[Access, list[Node]]:
        """How to reach the running cluster's nodes, and the nodes laid out, master first."""

    def reach_node(
        self, spec: ClusterSpec, node: str, *, endpoint_url: str | None
    ) -> tuple[Endpoint, Access, ClusterSpec]:
        """One node's endpoint, the cluster's access (host keys pinned), and its spec."""

    def cost_so_far(self, spec: ClusterSpec, endpoint_url: str | None) -> float | None:
        """USD the cluster has cost since launch; None where no price is known."""


#: the implementations by `ClusterSpec.provider`
PROVIDERS: dict[str, Provider] = {"aws": cast(Provider, ec2), "static": cast(Provider, static)}


def of(spec: ClusterSpec) -> Provider:
    """The provider that made (or makes) the cluster: the one place that reads
    `spec.provider`."""
    return PROVIDERS[spec.provider]


def named(kind: str | None) -> Provider:
    """The provider a raw `provider:` setting names (None: the default, `aws`), for settings
    not validated into a spec; an unknown name is taken as `aws`, whose checks refuse it."""
    return PROVIDERS.get(kind or "aws", PROVIDERS["aws"])
