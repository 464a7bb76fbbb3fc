"""The `aws` provider: a cluster of EC2 instances sparknet launches, found by its tag.

It implements provider.py's interface: `up` (ec2_up.py), `down`, `status`, the bootstrap again,
and what the job side asks of a running cluster (its nodes, its master, its cost so far).

The registry is a convenience, never the truth: `down`, `status` and `sweep` find everything by
the `sparknet:cluster` tag (inventory.py), so a lost laptop or a deleted registry still leaves no
instance running by accident. `up` and `down` of one cluster hold a lock in the registry dir, so
two of them on one machine never work on the same cluster at once. What runs on the nodes (the
bootstrap, stopping Spark before the instances go) is spark_nodes.py's.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Any

from sparknet.cluster import ec2_up, inventory, node_endpoints, registry, spark_nodes, sshkeys
from sparknet.cluster.address import Endpoint
from sparknet.cluster.aws import instances, keys, owner, preflight, prices
from sparknet.cluster.aws.instances import Instance
from sparknet.cluster.nodes import Access
from sparknet.cluster.records import ClusterInfo, ClusterNotFound, DownReport, Planned
from sparknet.cluster.spark.health import ClusterHealth
from sparknet.cluster.spark.plan import Node
from sparknet.cluster.spec import ClusterSpec
from sparknet.say import Say, command_line

#: commands name an EC2 cluster with its region (`--region`): its resources live in one
REGIONAL = True
#: the master carries an autostop timer that terminates the instances once idle
AUTOSTOP = True
#: sparknet launches the machines: their types, market and node role (scoped to the
#: cluster's `bucket:`) are its to choose
LAUNCHES = True


def _quiet(_line: str) -> None:
    """A `say` that tells nobody."""


# --- up ------------------------------------------------------------------------------------------


def up(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = _quiet,
    bootstrap: bool = False,
    any_owner: bool = False,
    wait_timeout_s: float = 900.0,
    wait_delay_s: float = 15.0,
) -> ClusterInfo:
    """`ec2_up.up`: the instances launched (or found), and with `bootstrap` Spark on them."""
    return ec2_up.up(
        spec, endpoint_url=endpoint_url, say=say, bootstrap=bootstrap, any_owner=any_owner,
        wait_timeout_s=wait_timeout_s, wait_delay_s=wait_delay_s,
    )  # fmt: skip


def check_launch(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """What can fail before `up` costs or starts anything, checked without writing
    (`ec2_up.check_before_up`: types, zones, key, the AMI, the vCPU quotas, the bucket's
    region)."""
    ec2_up.check_before_up(
        spec,
        instances.ec2_client(spec.region, endpoint_url),
        instances.ssm_client(spec.region, endpoint_url),
        endpoint_url=endpoint_url,
    )


def gpus_by_type(spec: ClusterSpec, endpoint_url: str | None) -> dict[str, int]:
    """GPUs of each instance type the cluster would launch (the master's and the workers')."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    spec = preflight.in_region(spec, ec2)
    return spark_nodes.instance_gpus(ec2, [spec.master_type, *spec.instance_types])


def planned_nodes(spec: ClusterSpec, endpoint_url: str | None) -> tuple[int, int | None]:
    """(Spark worker nodes, GPUs of each) of the cluster to make: its workers and its master
    (which runs a Spark worker too), with the master type's GPUs unless
    `bootstrap.gpus_per_node` sets them."""
    gpus = spec.bootstrap.gpus_per_node
    if gpus is None:
        ec2 = instances.ec2_client(spec.region, endpoint_url)
        spec = preflight.in_region(spec, ec2)
        gpus = spark_nodes.instance_gpus(ec2, [spec.master_type])[spec.master_type]
    return spec.workers + 1, gpus


def planned(spec: ClusterSpec, endpoint_url: str | None) -> list[Planned]:
    """The master (on-demand, always) and the workers (spot with `spot`), each priced as its
    first type: a fallback type is launched only where the first has no capacity."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    said: list[str] = []
    spec = preflight.in_region(spec, ec2, said.append)
    why = " ".join(said)
    gb = spec.root_volume_gb
    master = prices.planned_hourly(ec2, spec.master_type, False, 1, gb)
    rows = [Planned("master", 1, [spec.master_type], False, master, why)]
    if spec.workers:
        first = spec.instance_types[0]
        cost = prices.planned_hourly(ec2, first, spec.spot, spec.workers, gb)
        rows.append(
            Planned("workers", spec.workers, list(spec.instance_types), spec.spot, cost, why)
        )
    return rows


# --- down and status ---------------------------------------------------------------------------


def _check_exists(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """Refuse `down` of a name that has nothing to take down in the region: no registry entry,
    no Terraform state and no tagged resource there. A typo or a wrong region must not read as
    success while the real cluster runs on, so the error names the clusters that do exist, and
    the region where this machine knows the name."""
    if spec.region in inventory.known_regions(spec.name):
        return
    found = inventory.tagged_clusters(spec.region, endpoint_url=endpoint_url)
    if spec.name in found:
        return
    raise _not_found(spec, sorted(found))


def _not_found(spec: ClusterSpec, there: list[str]) -> ClusterNotFound:
    """One line: no cluster `spec.name` in its region, where it is instead, what is there."""
    elsewhere = sorted(inventory.known_regions(spec.name) - {spec.region})
    if elsewhere:
        return ClusterNotFound(
            "no cluster {name} in {region}; it is in {elsewhere} (registered here): pass "
            "{@region=there}",
            name=spec.name,
            region=spec.region,
            elsewhere=", ".join(elsewhere),
            there=elsewhere[0],
        )
    listed = (
        f"clusters there: {', '.join(there)}"
        if there
        else f"there are no sparknet clusters in {spec.region}"
    )
    return ClusterNotFound(
        "no cluster {name} in {region} (no tagged resources, not registered here); {listed}; "
        "check the name and {@region}",
        name=spec.name,
        region=spec.region,
        listed=listed,
    )


def down(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = _quiet,
    any_owner: bool = False,
    forget_unreachable: bool = False,
) -> DownReport:
    """Terminate the cluster's instances (waiting until they are gone), delete its foundation,
    and estimate what its instances cost as they ran. Works from tags alone; holds the cluster's
    lock; `ClusterNotFound` when there is nothing of that name to take down, `NotYours` when
    another principal's owner tag is on it (unless `any_owner`). A node that does not answer
    is terminated all the same (`forget_unreachable` changes nothing here)."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    if not instances.find(ec2, spec.name):
        _check_exists(spec, endpoint_url)  # before the lock: a typo leaves no file behind
    if not any_owner:
        inventory.check_owner(spec, owner.caller_owner(spec.region, endpoint_url), endpoint_url)
    with registry.cluster_lock(spec.name):
        found = instances.find(ec2, spec.name)
        cost = lifetime_cost(ec2, found, datetime.now(UTC))
        spark_nodes.stop_spark(spec, ec2, found, say)
        say(f"terminating {len(found)} instances")
        terminated = instances.terminate_cluster(ec2, spec.name, wait=True, delay_s=1.0)
        deleted = keys.delete_key_pairs(ec2, spec.name)
        deleted += ec2_up.destroy_foundation(spec, endpoint_url)
        if spec.name not in registry.registered() or registry.registered_in(spec.name, spec.region):
            registry.forget_local(spec.name)  # not the key of the name's cluster in another region
        registry.forget_entry(spec.name, spec.region)
        registry.remove_lock(spec.name)
    return DownReport(spec.name, spec.region, terminated, deleted, cost)


def teardown(spec: ClusterSpec, *, endpoint_url: str | None, say: Say) -> None:
    """`down` after a submit's job: nothing with the cluster's tag there is no error."""
    with contextlib.suppress(ClusterNotFound):
        down(spec, endpoint_url=endpoint_url, say=say)


def lifetime_cost(ec2: Any, found: list[Instance], now: datetime) -> float | None:
    """USD the instances cost from launch to `now` at their current hourly price (type, market,
    EBS, public IPv4); None when any price is unknown."""
    hourly_of = prices.hourly_costs(ec2, found)
    total = 0.0
    for inst in found:
        hourly = hourly_of[inst.id].total
        if hourly is None:
            return None
        total += hourly * max(0.0, (now - inst.launched_at).total_seconds()) / 3600
    return total


def status(spec: ClusterSpec, *, endpoint_url: str | None = None) -> ClusterInfo:
    """The cluster's live instances and what they cost per hour; `ClusterNotFound` (naming the
    clusters that exist) when the region has nothing of that name at all."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = instances.find(ec2, spec.name)
    if not found:
        _check_exists(spec, endpoint_url)
    masters = ec2_up.by_role(found, "master")
    return ClusterInfo(
        spec.name, spec.region, masters[0] if masters else None, ec2_up.by_role(found, "worker"),
        prices.hourly_cost(ec2, found),
    )  # fmt: skip


def leftover_note(name: str, region: str) -> str:
    """What `cluster status` and `list` say of a cluster with no live instance whose registry
    entry, Terraform state or tagged resources are still there: the autostop timer (or a hand)
    terminates instances only, and `down` removes the rest (key pair, security group, node
    role, network, entry)."""
    down = command_line("sparknet cluster down", name, region=region)
    return f"terminated (autostop?); `{down}` cleans up"


# --- the bootstrap again -----------------------------------------------------------------------


def _live(ec2: Any, spec: ClusterSpec) -> list[Instance]:
    """The cluster's running instances; `ClusterNotFound` when it has none."""
    found = [i for i in instances.find(ec2, spec.name) if i.state == "running"]
    if not found:
        raise ClusterNotFound(
            f"cluster {spec.name} has no running instances in {spec.region}; "
            f"`{command_line('sparknet cluster up', spec.name, region=spec.region)}` starts it"
        )
    return found


def bootstrap(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = _quiet,
    force: bool = False,
) -> ClusterInfo:
    """`sparknet cluster bootstrap`: the bootstrap again on the cluster's running instances
    (idempotent: what is done is skipped, its lines and the health through `say`), under the
    cluster's lock; `JobRunning` where it would restart the master under a running job, unless
    `force`. The instances it bootstrapped (not priced)."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = _live(ec2, spec)
    with registry.cluster_lock(spec.name):
        report = spark_nodes.bootstrap_instances(spec, ec2, found, say, force=force)
    spark_nodes.say_report(report, say)
    masters = ec2_up.by_role(found, "master")
    return ClusterInfo(
        spec.name, spec.region, masters[0] if masters else None,
        ec2_up.by_role(found, "worker"), None,
    )  # fmt: skip


def health(spec: ClusterSpec, info: ClusterInfo, *, endpoint_url: str | None) -> ClusterHealth:
    """Spark's health as the master of `info`'s instances tells it (`spark_nodes.spark_health`)."""
    return spark_nodes.spark_health(spec, info.instances, endpoint_url=endpoint_url)


# --- what the job side asks of a running cluster -------------------------------------------------


def current(spec: ClusterSpec) -> ClusterSpec:
    """The spec the cluster is acted on with: `spec` (its instances are found by tag)."""
    return spec


def in_use(spec: ClusterSpec, endpoint_url: str | None) -> bool:
    """An instance with the cluster's tag is there, in any live state."""
    return bool(instances.find(instances.ec2_client(spec.region, endpoint_url), spec.name))


def master_running(spec: ClusterSpec, endpoint_url: str | None) -> bool:
    """The master instance runs (one EC2 call, by tag)."""
    found = instances.find(instances.ec2_client(spec.region, endpoint_url), spec.name)
    return any(i.role == "master" and i.state == "running" for i in found)


def check_running(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """`ClusterNotFound`, one line saying what starts it, unless the master runs."""
    info = status(spec, endpoint_url=endpoint_url)
    if info.master is None or info.master.state != "running":
        raise ClusterNotFound(
            "its master is not running; "
            f"`{command_line('sparknet cluster up', spec.name, region=spec.region)}` starts it"
        )


def check_owner(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """`NotYours` when the cluster's owner tag names another principal than the caller."""
    inventory.check_owner(spec, owner.caller_owner(spec.region, endpoint_url), endpoint_url)


def nodes_of(spec: ClusterSpec, endpoint_url: str | None) -> tuple[Access, list[Node]]:
    """How to reach the running instances (their host keys pinned afresh), and the nodes as the
    bootstrap laid them out, master first."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = [i for i in instances.find(ec2, spec.name) if i.state == "running"]
    return spark_nodes.reach(spec, ec2, found), spark_nodes.plan_nodes(spec, ec2, found)


def reach_node(
    spec: ClusterSpec, node: str, *, endpoint_url: str | None
) -> tuple[Endpoint, Access, ClusterSpec]:
    """Node `node`'s endpoint and the cluster's access, its host keys pinned afresh from EC2
    (the instances' user data: right even after a lost registry or a new public address); only
    that node needs an address (a pending worker must not keep `cluster ssh` from the master)."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = [i for i in instances.find(ec2, spec.name) if i.state in ("pending", "running")]
    if not found:
        raise ClusterNotFound(
            f"cluster {spec.name} has no running instances in {spec.region}; "
            f"`{command_line('sparknet cluster up', spec.name, region=spec.region)}` starts it"
        )
    access = sshkeys.access_for(spec)
    sshkeys.check_key_file(access)
    keys.pin_cluster(ec2, spec.name, found, access.known_hosts)
    return node_endpoints.endpoint_named(spec.name, found, node), access, spec


def cost_so_far(spec: ClusterSpec, endpoint_url: str | None) -> float | None:
    """USD the cluster's instances have cost since launch (`lifetime_cost`)."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    return lifetime_cost(ec2, instances.find(ec2, spec.name), datetime.now(UTC))
