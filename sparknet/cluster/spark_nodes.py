"""Spark on a cluster's EC2 instances: from instances to nodes, the bootstrap, health and stop.

Its instances as the bootstrap's nodes (`plan_nodes`, their GPUs from EC2), their access with the
host keys pinned afresh (`reach`), what the bootstrap carries there (this checkout's wheel, the
cluster's secret), the bootstrap under the cluster's lock, the master's autostop line, Spark's
health, and stopping the daemons before the instances go.

Apart from ec2.py and ec2_up.py, which call it from `up` (the bootstrap) and `down` (stopping
Spark): this works over SSH on machines that already run, and a static cluster's hosts
(static.py), `repair` and sparknet-submit use the same plan, bootstrap and health without any
instance's life being run.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparknet import aws
from sparknet.cluster import node_endpoints, nodes, registry, sshkeys
from sparknet.cluster.aws import autostop, instances, keys
from sparknet.cluster.aws.autostop import Settings as AutostopSettings
from sparknet.cluster.aws.instances import Instance
from sparknet.cluster.remote import run
from sparknet.cluster.spark import bootstrap as boot
from sparknet.cluster.spark.health import ClusterHealth, Expected, cluster_health
from sparknet.cluster.spark.plan import Node, Plan, laid_out
from sparknet.cluster.spark.spark_conf import Ports, load_or_create_secret
from sparknet.cluster.spark.wheel import Wheel, build_wheel, source_checkout
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError, first_line
from sparknet.say import Say, command_line


class BootstrapIncomplete(SparknetError):
    """The instances run but their bootstrap failed or was interrupted: they stay (billed)
    and registered, for `cluster bootstrap` to finish or `cluster down` to end."""


def instance_gpus(ec2: Any, types: list[str]) -> dict[str, int]:
    """GPUs per instance type (DescribeInstanceTypes' GpuInfo; 0 for a type without)."""
    wanted = sorted(set(types))
    if not wanted:
        return {}
    with aws.aws_call("DescribeInstanceTypes", aws.region_of(ec2)):
        found = ec2.describe_instance_types(InstanceTypes=wanted)["InstanceTypes"]
    gpus = {t: 0 for t in wanted}
    for info in found:
        gpus[info["InstanceType"]] = sum(
            int(g.get("Count", 0)) for g in (info.get("GpuInfo") or {}).get("Gpus", [])
        )
    return gpus


def plan_nodes(spec: ClusterSpec, ec2: Any, found: list[Instance]) -> list[Node]:
    """The cluster's instances as the bootstrap's nodes, master first: each reached at its
    endpoint (`node_endpoints`), its daemons bound to its private address, its GPUs those of its
    instance type unless `bootstrap.gpus_per_node` says otherwise."""
    named = node_endpoints.node_names(found)
    if not named or named[0][0] != "master":
        raise SparknetError(
            f"cluster {spec.name} has no running master; "
            f"`{command_line('sparknet cluster up', spec.name)}` launches one"
        )
    override = spec.bootstrap.gpus_per_node
    gpus = {} if override is not None else instance_gpus(ec2, [i.type for _, i in named])
    return [
        laid_out(
            spec.name,
            node_endpoints.endpoint_of(spec.name, name, inst),
            inst.private_ip,
            override if override is not None else gpus[inst.type],
        )
        for name, inst in named
    ]


def ports_of(spec: ClusterSpec) -> Ports:
    s = spec.bootstrap
    return Ports(master=s.master_port, master_ui=s.master_ui_port, worker_ui=s.worker_ui_port)


def reach(spec: ClusterSpec, ec2: Any, found: list[Instance]) -> nodes.Access:
    """The cluster's access with its nodes' host keys pinned afresh from their user data."""
    access = sshkeys.access_for(spec)
    sshkeys.check_key_file(access)
    keys.pin_cluster(ec2, spec.name, found, access.known_hosts)
    return access


@dataclass(frozen=True)
class BootstrapPayload:
    """What the bootstrap brings to the nodes from this machine."""

    #: the sparknet wheel of this checkout (in a directory that lives as long as the bootstrap)
    wheel: Wheel
    #: the cluster's Spark secret (`registry.secret_file`)
    secret: str = field(repr=False)


def carry(spec: ClusterSpec, wheel_dir: Path) -> BootstrapPayload:
    """The wheel of this checkout, built into `wheel_dir`, then the cluster's secret (made
    0600 on first use; one others can read is refused): the wheel first, so a checkout that
    does not build leaves no secret behind."""
    wheel = build_wheel(source_checkout(), wheel_dir)
    return BootstrapPayload(wheel, load_or_create_secret(registry.secret_file(spec.name)))


def carry_or_unlock(spec: ClusterSpec, wheel_dir: Path) -> BootstrapPayload:
    """`carry` as `up`'s first step under the lock; when it fails, a cluster this machine
    has no entry for is left without the lock file just made (nothing else was written)."""
    had_entry = registry.entry_path(spec.name).exists()
    try:
        return carry(spec, wheel_dir)
    except BaseException:
        if not had_entry:
            registry.remove_lock(spec.name)
        raise


def bootstrap_instances(
    spec: ClusterSpec,
    ec2: Any,
    found: list[Instance],
    say: Say,
    carried: BootstrapPayload | None = None,
    force: bool = False,
) -> boot.BootstrapReport:
    """The bootstrap of the cluster's `found` instances, under its lock."""
    access = reach(spec, ec2, found)
    return bootstrap_locked(spec, plan_nodes(spec, ec2, found), access, say, carried, force)


def bootstrap_locked(
    spec: ClusterSpec,
    planned: list[Node],
    access: nodes.Access,
    say: Say,
    carried: BootstrapPayload | None = None,
    force: bool = False,
) -> boot.BootstrapReport:
    """The bootstrap of the cluster's `planned` nodes (any provider's), under its lock:
    `carried` (else the wheel of this checkout and the cluster's secret, made on first use),
    the spec's settings; `BootstrapIncomplete` when it fails. Unless `force`, `JobRunning`
    (before anything changes) where it would restart the master under a running job."""
    settings = spec.bootstrap
    with tempfile.TemporaryDirectory(prefix="sparknet-wheel-") as wheel_dir:
        carried = carried or carry(spec, Path(wheel_dir))
        plan = Plan(
            tuple(planned), carried.wheel, carried.secret,
            ports=ports_of(spec), python_env=settings.python_env,
            package_index=settings.package_index,
            worker_cores=settings.worker_cores, worker_memory_mb=settings.worker_memory_mb,
            install_drivers=spec.provider == "aws", autostop=autostop_settings(spec),
            region=spec.region if spec.provider == "aws" else None,
        )  # fmt: skip
        say(f"bootstrapping {len(plan.nodes)} nodes (sparknet {plan.wheel.version})")
        try:
            return boot.bootstrap(plan, access, say=say, force=force)
        except boot.JobRunning as exc:
            raise boot.JobRunning("cluster {name}: {cause}", name=spec.name, cause=exc) from None
        except SparknetError as exc:  # a step failed, a node is unreachable, or not healthy
            raise BootstrapIncomplete("{cause}", cause=exc).with_details(exc.details) from exc


def autostop_settings(spec: ClusterSpec) -> AutostopSettings | None:
    """The master's autostop timer of an EC2 cluster; none on a static one (its machines are
    the user's: nothing to terminate)."""
    if spec.provider != "aws":
        return None
    return AutostopSettings(spec.name, spec.region, spec.autostop_minutes)


def autostop_status(
    spec: ClusterSpec, found: list[Instance], *, endpoint_url: str | None = None
) -> str:
    """`cluster status`'s autostop line, from the deadline file on the master (over SSH);
    ``autostop: unknown: <why>`` when the master does not answer."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    running = [i for i in found if i.state == "running"]
    if not any(i.role == "master" for i in running):
        return "autostop: unknown: the master is not running"
    try:
        access = reach(spec, ec2, running)
        master = plan_nodes(spec, ec2, running)[0]
        conn = nodes.connect(master.endpoint, access, 5)
        try:
            text = run(conn, autostop.read_command(master.prefix), timeout=30)
        finally:
            conn.close()
    except SparknetError as exc:
        return f"autostop: unknown: {first_line(exc)}"
    return autostop.status_line(text or None, time.time())


def say_report(report: boot.BootstrapReport, say: Say) -> None:
    """Per node what the bootstrap applied (or that there was nothing to do), then the
    cluster's health."""
    for line in report.lines() + report.health.lines():
        say(line)


def spark_health(
    spec: ClusterSpec, found: list[Instance], *, endpoint_url: str | None = None
) -> ClusterHealth:
    """The Spark cluster's health as its master tells it (workers registered, cores, GPUs);
    a SparknetError when the master node takes no SSH connection within 5 s."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    running = [i for i in found if i.state == "running"]
    access = reach(spec, ec2, running)
    plan = plan_nodes(spec, ec2, running)
    expected = [Expected(n.name, n.rpc_host, spec.bootstrap.worker_cores, n.gpus) for n in plan]
    return cluster_health(plan[0], ports_of(spec), expected, access, connect_timeout=5)


def stop_spark(spec: ClusterSpec, ec2: Any, found: list[Instance], say: Say) -> None:
    """Stop the Spark daemons before the instances go, where this machine bootstrapped them
    (the cluster's secret is here): a daemon outlives nothing on EC2, but on a node that is not
    terminated (one the endpoints file points at, a test's) it would. Best effort: nodes that
    cannot be reached are said and skipped, as terminating ends their daemons anyway."""
    running = [i for i in found if i.state == "running"]
    if not running or not registry.secret_file(spec.name).is_file():
        return
    try:
        access = reach(spec, ec2, running)
        boot.stop_daemons(plan_nodes(spec, ec2, running), access, timeout=60)
    except SparknetError as exc:
        say(f"could not stop the Spark daemons first ({first_line(exc)}); terminating ends them")
    else:
        say(f"stopped the Spark daemons on {len(running)} nodes")
