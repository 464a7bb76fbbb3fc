"""A cluster's life: `up` (idempotent; tears down what it made on error or Ctrl-C), `down`,
`status`, `list`, `sweep`, and the local registry of clusters under `~/.sparknet/clusters/`.

The registry is a convenience, never the truth: `down`, `status` and `sweep` find everything by
the `sparknet:cluster` tag, so a lost laptop or a deleted registry still leaves no instance
running by accident.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sparknet import aws
from sparknet.cluster import foundation, instances
from sparknet.cluster.instances import Instance
from sparknet.cluster.spec import TAG_CLUSTER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError

#: where the registry lives; SPARKNET_HOME moves it (tests, several accounts)
HOME_ENV = "SPARKNET_HOME"

Say = Callable[[str], None]


def registry_dir() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".sparknet") / "clusters"


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    region: str
    master: Instance | None
    workers: list[Instance]
    hourly_usd: float | None

    @property
    def instances(self) -> list[Instance]:
        return ([self.master] if self.master else []) + self.workers


@dataclass(frozen=True)
class DownReport:
    name: str
    terminated: list[str]
    deleted: list[str]
    #: the estimated cost of the instances' lives, where prices are known
    cost_usd: float | None


def _save(spec: ClusterSpec, endpoint_url: str | None) -> None:
    path = registry_dir() / f"{spec.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "spec": spec.model_dump(mode="json"),
        "endpoint_url": endpoint_url,
        "saved": datetime.now(timezone.utc).isoformat(),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def registered() -> dict[str, ClusterSpec]:
    """The clusters this machine brought up and has not taken down."""
    out = {}
    for path in sorted(registry_dir().glob("*.json")):
        try:
            out[path.stem] = ClusterSpec.model_validate(json.loads(path.read_text())["spec"])
        except (ValueError, KeyError):
            continue  # a damaged entry: `list` and `sweep` still see the cluster by its tags
    return out


def _forget(name: str) -> None:
    (registry_dir() / f"{name}.json").unlink(missing_ok=True)


def hourly_cost(spec: ClusterSpec, ec2: Any) -> float | None:
    """Estimated $/hour of the spec's instances (on-demand table; spot price history)."""
    master = instances.hourly_price(spec.master_type, False, None, ec2)
    worker = instances.hourly_price(spec.instance_types[0], spec.spot, None, ec2)
    if master is None or (worker is None and spec.workers):
        return None
    return master + (worker or 0.0) * spec.workers


def _by_role(found: list[Instance], role: str) -> list[Instance]:
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


def terraform_state_dir(spec: ClusterSpec) -> Path:
    """Where a cluster's Terraform state lives, unless `terraform_backend` names another."""
    return registry_dir() / spec.name / "terraform"


def _ensure_foundation(
    spec: ClusterSpec, cidr: str, endpoint_url: str | None
) -> foundation.Foundation:
    if spec.foundation == "terraform":
        return foundation.ensure_terraform(
            spec, allowed_cidr=cidr, state_dir=terraform_state_dir(spec), endpoint_url=endpoint_url
        )
    return foundation.ensure_boto3(spec, allowed_cidr=cidr, endpoint_url=endpoint_url)


def _destroy_foundation(spec: ClusterSpec, endpoint_url: str | None) -> list[str]:
    """Terraform's destroy where its state is known; else by tag with boto3 (a lost state dir,
    or a foundation another backend made)."""
    state = terraform_state_dir(spec)
    if spec.foundation == "terraform" and (
        spec.terraform_backend is not None or (state / "terraform.tfstate").is_file()
    ):
        return foundation.destroy_terraform(spec, state_dir=state)
    return foundation.destroy_boto3(spec, endpoint_url=endpoint_url)


def up(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
    wait_timeout_s: float = 900.0,
    wait_delay_s: float = 15.0,
) -> ClusterInfo:
    """Bring the cluster to its spec: foundation, master, workers, all running and checked.

    Idempotent: what already runs (found by tag) is kept and only what is missing is launched.
    On any error, or Ctrl-C, everything this call created is removed again before it re-raises.
    """
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    ssm = instances.ssm_client(spec.region, endpoint_url)
    # everything that can fail without cost fails first
    instances.check_offered(ec2, [spec.master_type, *spec.instance_types])
    ami = instances.resolve_ami(spec, ssm)
    cidr = spec.allowed_cidr or instances.caller_cidr()
    before = {i.id for i in instances.find(ec2, spec.name)}
    had_foundation = _foundation_exists(spec, ec2)
    try:
        base = _ensure_foundation(spec, cidr, endpoint_url)
        _save(spec, endpoint_url)
        say(f"foundation ready: {base.vpc_id}, security group {base.security_group_id}")
        running = instances.find(ec2, spec.name)
        common = dict(
            subnet_by_az=base.subnet_by_az, security_group_id=base.security_group_id,
            instance_profile_arn=base.instance_profile_arn, ami=ami,
            client_token_prefix=f"{spec.name}-{int(time.time())}",
        )  # fmt: skip
        if not _by_role(running, "master"):
            say(f"launching the master ({spec.master_type})")
            instances.launch(
                ec2, spec, role="master", count=1, spot=False,
                instance_types=[spec.master_type], **common,
            )  # fmt: skip
        missing = spec.workers - len(_by_role(running, "worker"))
        if missing > 0:
            market = "spot" if spec.spot else "on-demand"
            say(f"launching {missing} {market} workers ({', '.join(spec.instance_types)})")
            instances.launch(
                ec2, spec, role="worker", count=missing, spot=spec.spot,
                instance_types=list(spec.instance_types), **common,
            )  # fmt: skip
        ids = [i.id for i in instances.find(ec2, spec.name)]
        ready = instances.wait_ready(ec2, ids, wait_timeout_s, delay_s=wait_delay_s)
    except BaseException as exc:
        try:
            _undo(spec, ec2, before, had_foundation, endpoint_url, say)
        except Exception as undo_exc:
            # the one case where something may be left running: say so, and what ends it
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc)
            raise SparknetError(
                f"{why}; removing what this `up` made then failed too ({undo_exc}); run "
                f"`sparknet cluster down {spec.name} --region {spec.region}` to remove the rest"
            ) from exc
        if isinstance(exc, KeyboardInterrupt):
            raise SparknetError(
                "interrupted; everything this `up` created was removed again"
            ) from exc
        raise
    masters = _by_role(ready, "master")
    return ClusterInfo(
        spec.name, spec.region, masters[0] if masters else None, _by_role(ready, "worker"),
        hourly_cost(spec, ec2),
    )  # fmt: skip


def _undo(
    spec: ClusterSpec,
    ec2: Any,
    before: set[str],
    had_foundation: bool,
    endpoint_url: str | None,
    say: Say,
) -> None:
    """Remove what one `up` created: its instances, and the foundation if it made it."""
    new = [i.id for i in instances.find(ec2, spec.name) if i.id not in before]
    if new:
        say(f"removing the {len(new)} instances this run launched")
        instances.terminate(ec2, new, wait=True, delay_s=1.0)
    if not had_foundation:
        _destroy_foundation(spec, endpoint_url)
        if not before:
            _forget(spec.name)


def down(
    spec: ClusterSpec, *, endpoint_url: str | None = None, say: Say = lambda _: None
) -> DownReport:
    """Terminate the cluster's instances (waiting until they are gone), delete its foundation,
    and estimate what its instances cost. Works from tags alone."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = instances.find(ec2, spec.name)
    now = datetime.now(timezone.utc)
    cost: float | None = 0.0
    for inst in found:
        price = instances.hourly_price(inst.type, inst.spot, inst.az, ec2)
        if price is None or cost is None:
            cost = None
            continue
        cost += price * max(0.0, (now - inst.launched_at).total_seconds()) / 3600
    say(f"terminating {len(found)} instances")
    terminated = instances.terminate_cluster(ec2, spec.name, wait=True, delay_s=1.0)
    deleted = _destroy_foundation(spec, endpoint_url)
    _forget(spec.name)
    return DownReport(spec.name, terminated, deleted, cost)


def status(spec: ClusterSpec, *, endpoint_url: str | None = None) -> ClusterInfo:
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = instances.find(ec2, spec.name)
    masters = _by_role(found, "master")
    return ClusterInfo(
        spec.name, spec.region, masters[0] if masters else None, _by_role(found, "worker"),
        hourly_cost(spec, ec2) if found else None,
    )  # fmt: skip


#: (describe call, response key, id key, kind) of each tagged EC2 resource type of a foundation
_TAGGED_EC2 = (
    ("describe_vpcs", "Vpcs", "VpcId", "vpc"),
    ("describe_subnets", "Subnets", "SubnetId", "subnet"),
    ("describe_security_groups", "SecurityGroups", "GroupId", "security-group"),
    ("describe_internet_gateways", "InternetGateways", "InternetGatewayId", "internet-gateway"),
    ("describe_route_tables", "RouteTables", "RouteTableId", "route-table"),
)


def tagged_resources(region: str, *, endpoint_url: str | None = None) -> dict[str, list[str]]:
    """Every cluster with resources in `region` -> "kind:id" of each: live instances, the
    foundation's network and security group (by the `sparknet:cluster` tag), and its IAM role
    and instance profile (IAM is global: by the name that carries the region, then the tag).
    The bucket is not listed: it outlives clusters."""
    ec2 = instances.ec2_client(region, endpoint_url)
    out: dict[str, list[str]] = {}

    def add(tags: list[dict[str, str]], item: str) -> None:
        name = {t["Key"]: t["Value"] for t in tags}.get(TAG_CLUSTER)
        if name is not None:
            out.setdefault(name, []).append(item)

    tag_key = {"Name": "tag-key", "Values": [TAG_CLUSTER]}
    live = {"Name": "instance-state-name", "Values": list(instances.LIVE_STATES)}
    with aws.aws_call("DescribeInstances", region):
        for page in ec2.get_paginator("describe_instances").paginate(Filters=[tag_key, live]):
            for reservation in page["Reservations"]:
                for raw in reservation["Instances"]:
                    add(raw.get("Tags", []), f"instance:{raw['InstanceId']}")
    for call, key, id_key, kind in _TAGGED_EC2:
        with aws.aws_call(call, region):
            for page in ec2.get_paginator(call).paginate(Filters=[tag_key]):
                for item in page[key]:
                    add(item.get("Tags", []), f"{kind}:{item[id_key]}")
    iam = aws.client("iam", region, endpoint_url)
    with aws.aws_call("ListRoles", region):
        for page in iam.get_paginator("list_roles").paginate():
            for role in page["Roles"]:
                name = role["RoleName"]
                if name.startswith("sparknet-") and name.endswith(f"-{region}"):
                    tags = iam.list_role_tags(RoleName=name)["Tags"]
                    add(tags, f"iam-role:{name}")
                    profiles = iam.list_instance_profiles_for_role(RoleName=name)
                    for profile in profiles["InstanceProfiles"]:
                        add(tags, f"instance-profile:{profile['InstanceProfileName']}")
    return out


def orphans(region: str, wanted: set[str], *, endpoint_url: str | None = None) -> dict:
    """Clusters with resources in `region` that nobody wants (not in `wanted`) -> "kind:id"."""
    return {
        name: items
        for name, items in tagged_resources(region, endpoint_url=endpoint_url).items()
        if name not in wanted
    }
