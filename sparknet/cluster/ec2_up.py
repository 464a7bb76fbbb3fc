"""Bringing an EC2 cluster up, with its checks before and its bootstrap at the end.

`up` is idempotent and removes what it made on error or Ctrl-C; the checks it makes come before
it writes or launches anything.

The `aws` provider (ec2.py) calls it; it is a module of its own as the longest part of an EC2
cluster's life. `up` holds the cluster's lock in the registry dir, so two of them on one machine
never work on one cluster at once; what runs on the nodes (the bootstrap) is spark_nodes.py's.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparknet import aws
from sparknet.cluster import inventory, registry, spark_nodes, sshkeys
from sparknet.cluster.aws import (
    boto3_foundation,
    boto3_teardown,
    foundation,
    images,
    instances,
    keys,
    launcher,
    preflight,
    prices,
    quotas,
    terraform_foundation,
)
from sparknet.cluster.aws.instances import Instance
from sparknet.cluster.aws.owner import caller_owner
from sparknet.cluster.records import ClusterInfo, Interrupted
from sparknet.cluster.spark import bootstrap as boot
from sparknet.cluster.spec import TAG_CLUSTER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError
from sparknet.say import Say, command_line

# --- up ----------------------------------------------------------------------------------------


def by_role(found: list[Instance], role: str) -> list[Instance]:
    return [i for i in found if i.role == role]


def _foundation_exists(spec: ClusterSpec, ec2: Any) -> bool:
    with aws.aws_call("DescribeVpcs", spec.region):
        vpcs = ec2.describe_vpcs(
            Filters=[
                {"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]},
                {"Name": f"tag:{TAG_ROLE}", "Values": ["foundation"]},
            ]
        )["Vpcs"]
    return bool(vpcs)


def _ensure_foundation(
    spec: ClusterSpec, cidr: str, endpoint_url: str | None, created: list[str]
) -> foundation.Foundation:
    """The foundation, found or made; boto3 appends "kind:id" of what it makes to `created` as
    it goes, so a failure half-way still knows what to remove."""
    if spec.foundation == "terraform":
        return terraform_foundation.ensure_terraform(
            spec,
            allowed_cidr=cidr,
            state_dir=inventory.terraform_state_dir(spec),
            endpoint_url=endpoint_url,
        )
    return boto3_foundation.ensure_boto3(
        spec, allowed_cidr=cidr, endpoint_url=endpoint_url, created=created
    )


def _has_terraform_state(spec: ClusterSpec) -> bool:
    """Terraform holds this cluster's foundation: a backend of the user's, or local state of
    this region."""
    state = inventory.terraform_state_dir(spec) / "terraform.tfstate"
    return spec.foundation == "terraform" and (
        spec.terraform_backend is not None or state.is_file()
    )


def destroy_foundation(spec: ClusterSpec, endpoint_url: str | None) -> list[str]:
    """Terraform's destroy where its state is known; else by tag with boto3 (a lost state dir,
    or a foundation another backend made)."""
    if _has_terraform_state(spec):
        return terraform_foundation.destroy_terraform(
            spec, state_dir=inventory.terraform_state_dir(spec), endpoint_url=endpoint_url
        )
    return boto3_teardown.destroy_boto3(spec, endpoint_url=endpoint_url)


def launch_prefix(name: str) -> str:
    """The ClientToken prefix of one `up`: unique to it (time and 24 random bits), so the
    instances carrying it are exactly the ones this `up` launched, and never another's."""
    return f"{name}-{int(time.time())}-{secrets.token_hex(3)}"


@dataclass
class _MadeByUp:
    """What one `up` made so far: the only things its clean-up may remove."""

    prefix: str
    had_foundation: bool
    had_entry: bool
    launched: list[str] = field(default_factory=list)
    #: "kind:id" of the foundation resources the boto3 foundation made, as it makes them
    created: list[str] = field(default_factory=list)
    #: the EC2 key pair this `up` imported (None: it existed, or the user's own)
    key_pair: str | None = None


def check_before_up(
    spec: ClusterSpec,
    ec2: Any,
    ssm: Any,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
) -> tuple[ClusterSpec, str]:
    """What `up` checks before it writes or launches anything (region, zones, instance types,
    key pair and file, the AMI and its root volume, the vCPU quotas, the bucket's region); the
    spec with its default types those the region offers (`preflight.in_region`), and the AMI
    to launch. `sparknet-submit`'s preflight runs it too, before it says it brings a cluster
    up."""
    inventory.check_region(spec)
    preflight.check_zones(ec2, spec.availability_zones)
    spec = preflight.in_region(spec, ec2, say)  # the types checked offered where it launches
    preflight.check_key_pair(ec2, spec.key_name)
    if spec.key_name:
        sshkeys.check_key_file(sshkeys.access_for(spec))
    ami = images.ami_for(spec, ec2, ssm)
    preflight.check_ami(ec2, ami, spec.root_volume_gb)
    # a refused read warns and goes on, and fails fast: two attempts, not the usual eight
    service_quotas = aws.client("service-quotas", spec.region, endpoint_url, max_attempts=2)
    quotas.check_quotas(spec, ec2, service_quotas, say)
    preflight.check_bucket_region(spec, endpoint_url, say=say)
    return spec, ami


def up(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
    wait_timeout_s: float = 900.0,
    wait_delay_s: float = 15.0,
    any_owner: bool = False,
    bootstrap: bool = False,
) -> ClusterInfo:
    """Bring the cluster to its spec: foundation, master, workers, all running and checked;
    with `bootstrap`, then Spark on them (`bootstrap_nodes`, its lines through `say`).

    Idempotent: what already runs (found by tag) is kept and only what is missing is launched.
    On any error, or Ctrl-C, before the bootstrap, what this call created (and only that) is
    removed again before it re-raises. A failed or interrupted bootstrap removes nothing: the
    instances run until their backstop ends them (`userdata`), and the error
    (`BootstrapIncomplete`) says they are billed, when the backstop ends them, and how to go on.
    The AMI is `ami.ami_for`'s: the spec's, else its own parameter's, else the region's baked
    image, else the default Deep Learning AMI. Holds the cluster's lock throughout; every
    resource it makes is tagged with the caller's identity (`sparknet:owner`), and it refuses
    (`NotYours`) a cluster of that name tagged with another owner unless `any_owner`.
    """
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    ssm = instances.ssm_client(spec.region, endpoint_url)
    # everything that can fail without cost fails first, and before the lock, whose file is the
    # first thing `up` writes
    spec, ami = check_before_up(spec, ec2, ssm, endpoint_url=endpoint_url, say=say)
    cidr = spec.allowed_cidr or preflight.caller_cidr()
    spec = spec.model_copy(update={"owner": caller_owner(spec.region, endpoint_url)})
    if not any_owner:
        inventory.check_owner(spec, str(spec.owner), endpoint_url)
    with (
        registry.cluster_lock(spec.name),
        tempfile.TemporaryDirectory(prefix="sparknet-wheel-") as tmp,
    ):
        # what the bootstrap brings from here is ready before anything is launched: a broken
        # checkout or a secret others can read fails before any money is spent
        carried = spark_nodes.carry_or_unlock(spec, Path(tmp)) if bootstrap else None
        info = _build(spec, ec2, ami, cidr, endpoint_url, say, wait_timeout_s, wait_delay_s)
        if carried is not None:
            _bootstrap_after_up(spec, ec2, info, say, carried)
        return info


def _bootstrap_after_up(
    spec: ClusterSpec, ec2: Any, info: ClusterInfo, say: Say, carried: spark_nodes.BootstrapPayload
) -> None:
    """The bootstrap as the last part of `up`. Its failure or Ctrl-C leaves the instances as
    they are (a step fails far more often for a reason the user fixes, such as a package
    mirror, than for one a fresh instance cures, and relaunching costs minutes each time): the
    one-line error says they run and are billed until their backstop (`userdata`) ends them,
    and what finishes or ends them before that."""
    name, region = spec.name, spec.region
    stay = (
        f"the cluster's {len(info.instances)} instances stay up and registered (and are "
        f"billed) until their backstop powers them off (terminates them) "
        f"{spec.backstop_minutes} minutes after their last boot: "
        f"`{command_line('sparknet cluster bootstrap', name, region=region)}` before then "
        f"finishes it, `{command_line('sparknet cluster down', name, region=region)}` ends "
        "them now"
    )
    try:
        report = spark_nodes.bootstrap_instances(spec, ec2, info.instances, say, carried)
    except KeyboardInterrupt as exc:
        raise Interrupted(f"interrupted during the bootstrap; {stay}") from exc
    except boot.JobRunning:
        raise  # refused before anything changed: nothing is incomplete
    except SparknetError as exc:
        raise spark_nodes.BootstrapIncomplete(
            "{cause:line}; {stay}", cause=exc, stay=stay
        ).with_details(exc.details) from exc
    spark_nodes.say_report(report, say)


def _build(
    spec: ClusterSpec,
    ec2: Any,
    ami: str,
    cidr: str,
    endpoint_url: str | None,
    say: Say,
    wait_timeout_s: float,
    wait_delay_s: float,
) -> ClusterInfo:
    """`up` once the checks passed, under the cluster's lock."""
    made = _MadeByUp(
        prefix=launch_prefix(spec.name),
        had_foundation=_foundation_exists(spec, ec2),
        had_entry=registry.entry_path(spec.name).exists(),
    )
    try:
        base = _ensure_foundation(spec, cidr, endpoint_url, made.created)
        registry.save_entry(spec, endpoint_url)
        say(f"foundation ready: {base.vpc_id}, security group {base.security_group_id}")
        # a shutting-down instance is going away: it is no member, and one is launched for it
        running = [i for i in instances.find(ec2, spec.name) if i.state != "shutting-down"]
        running = _shrink(ec2, spec, running, say, wait_delay_s)
        started = instances.start_stopped(ec2, running, delay_s=wait_delay_s)
        if started:
            say(f"starting {len(started)} stopped instances: {', '.join(started)}")
        made.key_pair = keys.ensure_key_pair(ec2, spec, say)
        common = dict(
            subnet_by_az=base.subnet_by_az, security_group_id=base.security_group_id,
            instance_profile_arn=base.instance_profile_arn, ami=ami,
            client_token_prefix=made.prefix,
            key_name=spec.key_name or keys.key_pair_name(spec.name),
        )  # fmt: skip
        if not by_role(running, "master"):
            say(f"launching the master ({spec.master_type})")
            master = launcher.launch(
                ec2, spec, role="master", count=1, spot=False,
                instance_types=[spec.master_type],
                user_data=keys.host_key_user_data(spec.backstop_minutes)[0],
                **common,
            )  # fmt: skip
            made.launched += [i.id for i in master]
        missing = spec.workers - len(by_role(running, "worker"))
        if missing > 0:
            market = "spot" if spec.spot else "on-demand"
            say(f"launching {missing} {market} workers ({', '.join(spec.instance_types)})")
            # one host key for the workers of one launch request: RunInstances gives all of them
            # the same user data, and a launch stays all-or-nothing (see `launcher.launch`)
            workers = launcher.launch(
                ec2, spec, role="worker", count=missing, spot=spec.spot,
                instance_types=list(spec.instance_types),
                user_data=keys.host_key_user_data(spec.backstop_minutes)[0], **common,
            )  # fmt: skip
            made.launched += [i.id for i in workers]
        # EC2's tag-filtered describe may not list an instance launched a moment ago: what
        # the launches answered counts too, or a fresh worker would bill unwaited and unused
        found = {i.id for i in instances.find(ec2, spec.name) if i.state != "shutting-down"}
        ids = sorted(found | set(made.launched))
        ready = instances.wait_ready(ec2, ids, wait_timeout_s, delay_s=wait_delay_s)
        _pin(spec, ec2, ready, say)
    except BaseException as exc:
        try:
            _undo(spec, ec2, made, endpoint_url, say)
        except Exception as undo_exc:
            # the one case where something may be left running: say so, and what ends it
            interrupted = isinstance(exc, KeyboardInterrupt)
            raise (Interrupted if interrupted else SparknetError)(
                "{why}; removing what this `up` made then failed too ({undo}); run "
                "`{down}` to remove the rest",
                why="interrupted" if interrupted else exc,
                undo=undo_exc,
                down=command_line("sparknet cluster down", spec.name, region=spec.region),
            ) from exc
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted(
                "interrupted; everything this `up` created was removed again"
            ) from exc
        raise
    masters = by_role(ready, "master")
    return ClusterInfo(
        spec.name, spec.region, masters[0] if masters else None, by_role(ready, "worker"),
        prices.hourly_cost(ec2, ready),
    )  # fmt: skip


def _pin(spec: ClusterSpec, ec2: Any, ready: list[Instance], say: Say) -> None:
    """Pin the nodes' host keys (from their user data) in the cluster's known_hosts, before
    anything connects to them; say which nodes have none (they will be refused)."""
    known_hosts = sshkeys.access_for(spec).known_hosts
    unpinned = keys.pin_cluster(ec2, spec.name, ready, known_hosts)
    if unpinned:
        say(
            f"no host key to pin for {', '.join(unpinned)} (launched without sparknet's host "
            "key): SSH to them is refused; terminate them and run `up` again to replace them"
        )


def _shrink(
    ec2: Any, spec: ClusterSpec, running: list[Instance], say: Say, delay_s: float
) -> list[Instance]:
    """Terminate the workers beyond `spec.workers`, newest first, and return what is left.

    `up --workers 1` of a cluster with 4 workers means 1 worker: the spec is what the user pays
    for, and the registry records it. The newest go first: the oldest have the warmest caches
    and the settled host keys."""
    workers = by_role(running, "worker")
    extra = len(workers) - spec.workers
    if extra <= 0:
        return running
    newest = sorted(workers, key=lambda i: (i.launched_at, i.id), reverse=True)[:extra]
    ids = [i.id for i in newest]
    say(f"terminating {extra} surplus workers (newest first): {', '.join(ids)}")
    instances.terminate(ec2, ids, wait=True, delay_s=delay_s)
    return [i for i in running if i.id not in ids]


def _undo(spec: ClusterSpec, ec2: Any, made: _MadeByUp, endpoint_url: str | None, say: Say) -> None:
    """Remove what one `up` made, and nothing else: the instances it launched (the ids
    `launch` returned, and any carrying its unique ClientToken prefix: a launch whose answer a
    Ctrl-C cut off), the foundation resources it created, and the registry entry it wrote.
    Another `up` of the same cluster from another machine may have launched instances or made
    the foundation meanwhile; those stay."""
    ours = set(made.launched)
    ours |= {i.id for i in launcher.launched_with(ec2, spec.name, made.prefix)}
    if ours:
        say(f"removing the {len(ours)} instances this run launched")
        instances.terminate(ec2, sorted(ours), wait=True, delay_s=1.0)
    if made.key_pair:
        with aws.aws_call("DeleteKeyPair", spec.region):
            ec2.delete_key_pair(KeyName=made.key_pair)
    if spec.foundation == "terraform":
        if not made.had_foundation:
            # the lock keeps other `up`s on this machine out of the state this run applied
            destroy_foundation(spec, endpoint_url)
    elif made.created:
        boto3_teardown.destroy_boto3(spec, endpoint_url=endpoint_url, only=made.created)
    if not made.had_entry:
        registry.forget_entry(spec.name, spec.region)
        registry.forget_local(spec.name)
        registry.remove_lock(spec.name)
