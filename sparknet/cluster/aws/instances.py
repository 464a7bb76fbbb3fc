"""Ephemeral cluster instances with boto3.

The `Instance` record, clients, and the life after a launch: wait until ready, find by tag,
start, terminate.

A handful of functions over plain boto3 clients, with results as small frozen dataclasses, so
the `aws` provider (`ec2.py`, `ec2_up.py`) can drive them without knowing EC2's response shapes.
Every failure a user can fix reaches them as a one-line `SparknetError`. What comes before a
launch (`preflight.py`), the launch itself (`launcher.py`) and what instances cost
(`prices.py`) are modules of their own: most callers need only this one, to find a cluster's
instances and act on them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster.spec import TAG_CLUSTER, TAG_OWNER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError

#: how long an instance id RunInstances gave may be unknown to the rest of EC2's API
FRESH_ID_WAIT_S = 60.0
#: instance states that still cost money or may come back; everything but "terminated"
LIVE_STATES = ("pending", "running", "shutting-down", "stopping", "stopped")


@dataclass(frozen=True)
class Instance:
    """One EC2 instance of a cluster, as `ec2.py` and `nodes.py` need it.

    `role` is the instance's `sparknet:role` tag; `public_ip` is None until AWS assigns one (or
    never, in a private subnet), so refresh through `wait_ready` or `find` after a launch.
    """

    id: str
    role: str
    type: str
    az: str
    private_ip: str | None
    public_ip: str | None
    spot: bool
    launched_at: datetime
    #: EC2's state name (pending, running, stopping, stopped, ...) when the record was read: a
    #: snapshot, so two records of one instance compare equal whatever its state did meanwhile
    state: str = field(default="running", compare=False)

    @property
    def stopped(self) -> bool:
        """Stopped or on its way there: no compute is billed, and it must be started to serve."""
        return self.state in ("stopping", "stopped")

    @classmethod
    def from_ec2(cls, raw: Mapping[str, Any]) -> Instance:
        """Build from one `Instances[]` item of DescribeInstances / RunInstances."""
        tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
        return cls(
            id=raw["InstanceId"],
            role=tags.get(TAG_ROLE, ""),
            type=raw["InstanceType"],
            az=raw.get("Placement", {}).get("AvailabilityZone", ""),
            private_ip=raw.get("PrivateIpAddress"),
            public_ip=raw.get("PublicIpAddress"),
            spot=raw.get("InstanceLifecycle") == "spot",
            launched_at=raw["LaunchTime"],
            state=raw.get("State", {}).get("Name", "running"),
        )


def role_tags(spec: ClusterSpec, role: str) -> list[dict[str, str]]:
    """The cluster and role tags, and the owner tag when `up` has set the spec's owner (so
    `sweep` can tell one user's clusters from another's in a shared account)."""
    tags = [
        {"Key": TAG_CLUSTER, "Value": spec.name},
        {"Key": TAG_ROLE, "Value": role},
        {"Key": "Name", "Value": f"{spec.name}-{role}"},
    ]
    if spec.owner:
        tags.append({"Key": TAG_OWNER, "Value": spec.owner})
    return tags


# --- clients and errors ----------------------------------------------------------------------


def ec2_client(region: str, endpoint_url: str | None = None, *, max_attempts: int = 8) -> Any:
    """An EC2 client for `region`; see `aws.client`."""
    return aws.client("ec2", region, endpoint_url, max_attempts=max_attempts)


def ssm_client(region: str, endpoint_url: str | None = None, *, max_attempts: int = 8) -> Any:
    """An SSM client for `region` (where `preflight.resolve_ami` reads the AMI parameter)."""
    return aws.client("ssm", region, endpoint_url, max_attempts=max_attempts)


# --- wait, find, terminate -------------------------------------------------------------------


def describe(
    ec2: Any, filters: list[dict[str, Any]] | None = None, ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Every `Instances[]` item matching, across pages and reservations."""
    kwargs: dict[str, Any] = {}
    if filters:
        kwargs["Filters"] = filters
    if ids:
        kwargs["InstanceIds"] = list(ids)
    with aws.aws_call("DescribeInstances", aws.region_of(ec2)):
        return _describe_pages(ec2, kwargs)


def _describe_pages(ec2: Any, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for page in ec2.get_paginator("describe_instances").paginate(**kwargs):
        for reservation in page["Reservations"]:
            found.extend(reservation["Instances"])
    return found


def wait_for(
    ec2: Any, waiter: str, deadline: float, delay_s: float, *, what: str, **params: Any
) -> None:
    """Run the EC2 waiter `waiter` with `params` (``InstanceIds=...``, ``ImageIds=...``) until
    `deadline` (time.monotonic()), polling every `delay_s`: the one wrapper of boto3's waiters,
    so every wait is bounded the same way and fails in one line naming `what` (e.g. "instances
    i-1, i-2") and the state it did not reach."""
    remaining = max(deadline - time.monotonic(), delay_s)
    config = {"Delay": delay_s, "MaxAttempts": max(1, math.ceil(remaining / delay_s))}
    try:
        ec2.get_waiter(waiter).wait(**params, WaiterConfig=config)
    except bx.WaiterError as exc:
        reason = aws.one_line(exc.kwargs.get("reason", exc))
        state = waiter.split("_", 1)[-1]
        raise SparknetError(
            f"{what} did not reach {state} ({reason}); see the EC2 console for their state"
        ) from exc
    except (bx.BotoCoreError, bx.ClientError) as exc:
        raise aws.describe_error(exc, f"waiting for {waiter} in {aws.region_of(ec2)}") from exc


def wait_instances(
    ec2: Any, waiter: str, ids: Sequence[str], deadline: float, delay_s: float
) -> None:
    """`wait_for` an instance waiter ("instance_running", "instance_stopped", ...) on `ids`."""
    what = f"instances {', '.join(ids)}"
    wait_for(ec2, waiter, deadline, delay_s, what=what, InstanceIds=list(ids))


def wait_ready(
    ec2: Any, ids: Sequence[str], timeout_s: float = 900.0, *, delay_s: float = 15.0
) -> list[Instance]:
    """Wait until the instances run and pass EC2's status checks, then return them afresh.

    "running" only means the hypervisor started the machine; sshd answers after the status
    checks pass, so both are waited for, within one `timeout_s` together. The refreshed records
    carry the public IPs, which a launch response may lack. EC2's API is eventually consistent:
    an id RunInstances just gave may be `InvalidInstanceID.NotFound` for a while; the waiters
    poll on through that (botocore's acceptors), and so does the last describe, all until the
    same deadline.
    """
    if not ids:
        return []
    deadline = time.monotonic() + timeout_s
    wait_instances(ec2, "instance_running", ids, deadline, delay_s)
    wait_instances(ec2, "instance_status_ok", ids, deadline, delay_s)
    raw = describe_fresh(ec2, ids, deadline, delay_s)
    return sorted((Instance.from_ec2(r) for r in raw), key=lambda i: i.id)


def describe_fresh(
    ec2: Any, ids: Sequence[str], deadline: float, delay_s: float
) -> list[dict[str, Any]]:
    """`describe` of `ids`, asked again while EC2 answers `InvalidInstanceID.NotFound` for an
    instance launched a moment ago, until `deadline` (time.monotonic())."""
    with aws.aws_call("DescribeInstances", aws.region_of(ec2)):
        return aws.retrying(
            lambda: _describe_pages(ec2, {"InstanceIds": list(ids)}),
            _not_found,
            within_s=max(0.0, deadline - time.monotonic()),
            pause_s=delay_s,
        )


def find(ec2: Any, cluster: str) -> list[Instance]:
    """Every instance tagged with `cluster` that is not terminated, master first.

    By tag, not from a local registry, so `down` and the orphan sweep work from any machine."""
    raw = describe(
        ec2,
        [
            {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]},
            {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
        ],
    )
    found = (Instance.from_ec2(r) for r in raw)
    return sorted(found, key=lambda i: (i.role != "master", i.role, i.id))


def start_stopped(
    ec2: Any, found: Sequence[Instance], *, timeout_s: float = 600.0, delay_s: float = 5.0
) -> list[str]:
    """Start the stopped instances among `found` (a stopping one once it has stopped); the ids
    started. A stopped node never passes `wait_ready`: `up` starts it (its disk, and whatever
    was installed on it, are kept) rather than waiting for it until the timeout."""
    stopping = [i.id for i in found if i.state == "stopping"]
    if stopping:
        wait_instances(ec2, "instance_stopped", stopping, time.monotonic() + timeout_s, delay_s)
    ids = [i.id for i in found if i.stopped]
    if ids:
        with aws.aws_call("StartInstances", aws.region_of(ec2)):
            ec2.start_instances(InstanceIds=ids)
    return ids


def terminate(
    ec2: Any,
    ids: Sequence[str],
    wait: bool = True,
    *,
    timeout_s: float = 600.0,
    delay_s: float = 5.0,
) -> None:
    """Terminate the instances and, with `wait`, return once EC2 reports them terminated (so a
    following security-group or subnet deletion does not fail on attached interfaces)."""
    if not ids:
        return
    with aws.aws_call("TerminateInstances", aws.region_of(ec2)):
        # a clean-up right after RunInstances names ids EC2 may not know yet (it is eventually
        # consistent): the call is made again until they are known, or FRESH_ID_WAIT_S passed
        aws.retrying(
            lambda: ec2.terminate_instances(InstanceIds=list(ids)),
            _not_found,
            within_s=FRESH_ID_WAIT_S,
        )
    if wait:
        wait_instances(ec2, "instance_terminated", ids, time.monotonic() + timeout_s, delay_s)


def _not_found(exc: bx.ClientError) -> bool:
    return aws.error_code(exc) == "InvalidInstanceID.NotFound"


def terminate_cluster(
    ec2: Any, cluster: str, wait: bool = True, *, timeout_s: float = 600.0, delay_s: float = 5.0
) -> list[str]:
    """Terminate every live instance tagged with `cluster`; the ids it terminated."""
    ids = [i.id for i in find(ec2, cluster)]
    terminate(ec2, ids, wait, timeout_s=timeout_s, delay_s=delay_s)
    return ids
