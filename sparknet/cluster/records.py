"""The records every provider returns and the errors every provider raises.

`aws` (ec2.py) and `static` (static.py) answer `up`, `status`, `bootstrap` and `down` with these,
so the commands above cluster/ read one shape of cluster whichever provider made it: a record
carries what each needs to print (instances and their price for EC2, the user's hosts for a
static cluster, which sparknet has no price of).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparknet.cluster.address import Endpoint
from sparknet.cluster.aws.instances import Instance
from sparknet.cluster.aws.prices import Hourly
from sparknet.errors import SparknetError


class ClusterNotFound(SparknetError):
    """Nothing of the named cluster is there: no tagged resource in the region and no registry
    entry (EC2), or no registry entry here (a static cluster)."""


class Interrupted(SparknetError):
    """Ctrl-C or SIGTERM stopped `up` (after its clean-up), `down` or a bootstrap."""


@dataclass(frozen=True)
class ClusterInfo:
    """A cluster as it is: the instances sparknet launched for it, or the user's own hosts."""

    name: str
    region: str
    master: Instance | None
    workers: list[Instance]
    #: what the instances cost per hour as they run (type, market, EBS, public IPv4); None
    #: where nothing was priced (the user's own hosts, a bootstrap)
    cost: Hourly | None
    #: the machines the user gave (a static cluster's hosts, master first), reached as they
    #: are; empty where sparknet launched instances
    hosts: list[Endpoint] = field(default_factory=list)

    @property
    def instances(self) -> list[Instance]:
        return ([self.master] if self.master else []) + self.workers

    @property
    def hourly_usd(self) -> float | None:
        return self.cost.total if self.cost is not None and self.instances else None


@dataclass(frozen=True)
class Planned:
    """Machines of one role a cluster to make would have, priced before launch: what
    `sparknet-submit --dry-run` shows. A static cluster's hosts are the user's: no type of
    sparknet's choosing and no price (`cost` None)."""

    #: master, workers, or hosts (the user's own)
    role: str
    count: int
    #: the types in the order tried (the first priced); empty for the user's own hosts
    instance_types: list[str]
    spot: bool
    #: all `count` together, per hour; None where sparknet pays nothing (the user's hosts)
    cost: Hourly | None
    #: why the types are these, where sparknet chose them (`preflight.in_region`'s line)
    why: str = ""


@dataclass(frozen=True)
class DownReport:
    """What a `down` ended: the instances it terminated and the resources it deleted, or, where
    the machines stay (a static cluster), the nodes whose Spark it stopped."""

    name: str
    region: str
    terminated: list[str]
    deleted: list[str]
    #: the estimated cost of the instances' lives, where prices are known
    cost_usd: float | None
    #: the nodes whose Spark was stopped on machines that keep running (None: the machines
    #: themselves were ended)
    stopped: list[str] | None = None
