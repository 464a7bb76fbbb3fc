"""What the job side (sparknet-submit, its jobs, the repair of a cluster in use) asks of a
cluster, whichever provider made it, in one place (design.md, section 1): `aws` is
lifecycle.py's EC2 cluster, found by its tag; `static` is static.py's hosts of the user's,
whose registry entry here is the record. The cluster CLI keeps its own per-provider output."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import UTC, datetime

from sparknet.cluster import lifecycle, sparkops, static
from sparknet.cluster.aws import instances
from sparknet.cluster.nodes import Access
from sparknet.cluster.spark.plan import Node
from sparknet.cluster.spec import ClusterSpec

Say = Callable[[str], None]


def is_static(spec: ClusterSpec) -> bool:
    return spec.provider == "static"


def in_use(spec: ClusterSpec, endpoint_url: str | None) -> bool:
    """Anything of the cluster is there: an instance with its tag in any live state, or a
    static cluster registered here (its hosts run Spark)."""
    if is_static(spec):
        return static.registered_spec(spec.name) is not None
    return bool(instances.find(instances.ec2_client(spec.region, endpoint_url), spec.name))


def master_running(spec: ClusterSpec, endpoint_url: str | None) -> bool:
    """The cluster can run a job now: its master instance runs (one EC2 call, by tag), or the
    static cluster is up here."""
    if is_static(spec):
        return static.registered_spec(spec.name) is not None
    found = instances.find(instances.ec2_client(spec.region, endpoint_url), spec.name)
    return any(i.role == "master" and i.state == "running" for i in found)


def check_running(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """`ClusterNotFound`, one line saying what starts it, unless `master_running`."""
    if is_static(spec):
        static.status(spec)
        return
    info = lifecycle.status(spec, endpoint_url=endpoint_url)
    if info.master is None or info.master.state != "running":
        raise lifecycle.ClusterNotFound(
            f"its master is not running; `sparknet cluster up {spec.name}` starts it"
        )


def check_launch(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """What can fail before `up` costs or starts anything, checked without writing: `up`'s own
    checks (`lifecycle.check_before_up`: types, zones, key, the AMI, the vCPU quotas, the
    bucket's region); a static cluster's name, hosts, key and the hosts' keys."""
    if is_static(spec):
        static.preflight(spec)
        return
    lifecycle.check_before_up(
        spec,
        instances.ec2_client(spec.region, endpoint_url),
        instances.ssm_client(spec.region, endpoint_url),
        endpoint_url=endpoint_url,
    )


def up(spec: ClusterSpec, *, endpoint_url: str | None, say: Say) -> None:
    """`cluster up` with its bootstrap: EC2 instances launched, or a static cluster's hosts."""
    if is_static(spec):
        static.up(spec, say=say, bootstrap=True)
    else:
        lifecycle.up(spec, endpoint_url=endpoint_url, say=say, bootstrap=True)


def down(spec: ClusterSpec, *, endpoint_url: str | None, say: Say) -> None:
    """`cluster down`: the EC2 cluster terminated and deleted, or Spark stopped on a static
    cluster's hosts (the machines stay). Nothing there is no error: no resource with the
    cluster's tag, or a static cluster not registered here (its hosts are then none of
    sparknet's business: they may be another cluster's)."""
    if is_static(spec):
        if static.registered_spec(spec.name) is not None:
            static.down(spec, say=say)
        return
    with contextlib.suppress(lifecycle.ClusterNotFound):
        lifecycle.down(spec, endpoint_url=endpoint_url, say=say)


def nodes_of(spec: ClusterSpec, endpoint_url: str | None) -> tuple[Access, list[Node]]:
    """How to reach the running cluster's nodes (their host keys pinned), and the nodes as the
    bootstrap laid them out, master first."""
    if is_static(spec):
        spec = static.current(spec)
        access = static.access(spec)
        return access, static.plan_nodes(spec, access)
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = [i for i in instances.find(ec2, spec.name) if i.state == "running"]
    return sparkops.reach(spec, ec2, found), sparkops.plan_nodes(spec, ec2, found)


def cost_so_far(spec: ClusterSpec, endpoint_url: str | None) -> float | None:
    """USD the cluster's instances have cost since launch (lifecycle's pricing); None for a
    static cluster (machines sparknet knows no price of)."""
    if is_static(spec):
        return None
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = instances.find(ec2, spec.name)
    return lifecycle.lifetime_cost(ec2, found, datetime.now(UTC))
