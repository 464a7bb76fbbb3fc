"""Ephemeral cluster instances with boto3: launch (on-demand or spot, falling back across instance
types and AZs on capacity errors), wait until ready, find by tag, terminate, price.

A handful of functions over plain boto3 clients, with results as small frozen dataclasses, so
`lifecycle.py` (and a `static` provider) can drive them without knowing EC2's response shapes.
Every failure a user can fix reaches them as a one-line `SparknetError`.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import math
import os
import re
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster.spec import TAG_CLUSTER, TAG_OWNER, TAG_ROLE, ClusterSpec
from sparknet.errors import InputError, SparknetError

#: AWS's own "what is my IP" endpoint; `SPARKNET_CHECKIP_URL` overrides it (tests, proxies)
CHECKIP_URL = "https://checkip.amazonaws.com"
CHECKIP_ENV = "SPARKNET_CHECKIP_URL"

#: instance states that still cost money or may come back; everything but "terminated"
LIVE_STATES = ("pending", "running", "shutting-down", "stopping", "stopped")

#: RunInstances errors about one (type, AZ) pair: the same type may fit in the next AZ
CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientFreeAddressesInSubnet",
        "Unsupported",
        "SpotMaxPriceTooLow",
    }
)
#: the Service Quotas names a user has to look for, by instance family letter
_QUOTA_NAMES = {
    (False, "g"): "Running On-Demand G and VT instances",
    (False, "p"): "Running On-Demand P instances",
    (True, "g"): "All G and VT Spot Instance Requests",
    (True, "p"): "All P Spot Instance Requests",
}
#: how long RunInstances may reject a new instance profile as invalid before it is an error:
#: IAM is eventually consistent, and a profile made by the foundation a moment ago is not yet
#: visible to EC2
PROFILE_PROPAGATION_S = 60.0
PROFILE_RETRY_S = 5.0
#: what AWS's AMI ids look like (older ones have 8 hex digits, newer ones 17)
AMI_ID = re.compile(r"ami-(?:[0-9a-f]{8}|[0-9a-f]{17})")
#: a ClientToken is at most 64 ASCII characters; launch appends "-" and a 12-character digest
_MAX_TOKEN_PREFIX = 64 - 13


@dataclass(frozen=True)
class Instance:
    """One EC2 instance of a cluster, as `lifecycle.py` and `nodes.py` need it.

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


# --- clients and errors ----------------------------------------------------------------------


def ec2_client(region: str, endpoint_url: str | None = None, *, max_attempts: int = 8) -> Any:
    """An EC2 client for `region`; see `aws.client`."""
    return aws.client("ec2", region, endpoint_url, max_attempts=max_attempts)


def ssm_client(region: str, endpoint_url: str | None = None, *, max_attempts: int = 8) -> Any:
    """An SSM client for `region` (where `resolve_ami` reads the AMI parameter)."""
    return aws.client("ssm", region, endpoint_url, max_attempts=max_attempts)


# --- what to launch --------------------------------------------------------------------------


def resolve_ami(spec: ClusterSpec, ssm: Any) -> str:
    """The AMI to launch: `spec.ami` when given, else the value of the SSM parameter
    `spec.ami_parameter` (AWS publishes its Deep Learning AMIs that way, so the newest one is
    used without hard-coding ids that differ per region and change every release)."""
    if spec.ami:
        if not AMI_ID.fullmatch(spec.ami):
            raise InputError(
                f"ami {spec.ami!r} is not an AMI id (ami- and 8 or 17 hex digits, as "
                "`aws ec2 describe-images` shows them)"
            )
        return spec.ami
    region = aws.region_of(ssm)
    try:
        return str(ssm.get_parameter(Name=spec.ami_parameter)["Parameter"]["Value"])
    except bx.ClientError as exc:
        if aws.error_code(exc) == "ParameterNotFound":
            raise InputError(
                f"SSM parameter {spec.ami_parameter} does not exist in {region}; pass --ami "
                "AMI_ID to `cluster up` (e.g. one `make ami` baked), or set ami or "
                "ami_parameter in the cluster's `clusters:` entry"
            ) from exc
        raise aws.describe_error(
            exc, f"reading SSM parameter {spec.ami_parameter} in {region}"
        ) from exc
    except bx.BotoCoreError as exc:
        raise aws.describe_error(
            exc, f"reading SSM parameter {spec.ami_parameter} in {region}"
        ) from exc


def check_offered(
    ec2: Any, instance_types: Sequence[str], azs: Sequence[str] | None = None
) -> dict[str, list[str]]:
    """For each instance type, the AZs among `azs` (every AZ of the region when empty) that
    offer it, in the order given.

    A type offered in none of them is a typo or a region without it: that is an error now,
    before anything is launched, rather than a launch failure after the master is already up.
    """
    region = aws.region_of(ec2)
    found: dict[str, set[str]] = {t: set() for t in instance_types}
    with aws.aws_call("DescribeInstanceTypeOfferings", region):
        pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": list(instance_types)}],
        )
        for page in pages:
            for offer in page["InstanceTypeOfferings"]:
                found.setdefault(offer["InstanceType"], set()).add(offer["Location"])
    offered: dict[str, list[str]] = {}
    for itype in instance_types:
        region_azs = found[itype]
        usable = [az for az in azs if az in region_azs] if azs else sorted(region_azs)
        if not region_azs:
            raise InputError(
                f"instance type {itype} is not offered in {region}; choose another "
                f"(aws ec2 describe-instance-type-offerings --region {region})"
            )
        if not usable:
            raise InputError(
                f"instance type {itype} is offered in {region} only in "
                f"{', '.join(sorted(region_azs))}, none of the cluster's AZs "
                f"({', '.join(azs or [])}); add one of those AZs or choose another type"
            )
        offered[itype] = usable
    return offered


def check_zones(ec2: Any, zones: Sequence[str]) -> None:
    """Every AZ the spec names is a regular AZ of the region (not a Local or Wavelength Zone,
    not another region's); a one-line error naming the region's AZs otherwise. `up` calls it
    before anything is made: the foundation would otherwise be built and then fail."""
    if not zones:
        return
    region = aws.region_of(ec2)
    regular = [{"Name": "zone-type", "Values": ["availability-zone"]}]
    with aws.aws_call("DescribeAvailabilityZones", region):
        found = ec2.describe_availability_zones(Filters=regular)["AvailabilityZones"]
    names = sorted(z["ZoneName"] for z in found if z.get("RegionName", region) == region)
    unknown = [z for z in zones if z not in names]
    if unknown:
        raise InputError(
            f"availability_zones: {', '.join(unknown)} is not an AZ of {region}; its AZs are "
            f"{', '.join(names)}"
        )


def check_key_pair(ec2: Any, key_name: str | None) -> None:
    """The spec's EC2 key pair exists in the region; a one-line error before anything is made
    otherwise (RunInstances would refuse it only after the foundation is built)."""
    if not key_name:
        return
    region = aws.region_of(ec2)
    try:
        ec2.describe_key_pairs(KeyNames=[key_name])
    except bx.ClientError as exc:
        if aws.error_code(exc) == "InvalidKeyPair.NotFound":
            raise InputError(
                f"key pair {key_name!r} does not exist in {region}; import your public key "
                f"(aws ec2 import-key-pair --region {region} --key-name {key_name} ...) or "
                "remove key_name"
            ) from exc
        raise aws.describe_error(exc, f"DescribeKeyPairs in {region}") from exc
    except bx.BotoCoreError as exc:
        raise aws.describe_error(exc, f"DescribeKeyPairs in {region}") from exc


def _root_device(ec2: Any, ami: str) -> tuple[str, int]:
    """The AMI's root device name (the block device mapping must name it, and it differs between
    AMIs: /dev/sda1, /dev/xvda) and its snapshot size in GiB (the smallest root volume allowed)."""
    region = aws.region_of(ec2)
    try:
        images = ec2.describe_images(ImageIds=[ami])["Images"]
    except bx.ClientError as exc:
        if aws.error_code(exc).startswith("InvalidAMIID"):
            images = []
        else:
            raise aws.describe_error(exc, f"DescribeImages in {region}") from exc
    except bx.BotoCoreError as exc:
        raise aws.describe_error(exc, f"DescribeImages in {region}") from exc
    if not images:
        raise InputError(f"AMI {ami} does not exist in {region} (or is not shared with you)")
    image = images[0]
    name = image["RootDeviceName"]
    size = next(
        (
            int(m["Ebs"].get("VolumeSize", 0))
            for m in image.get("BlockDeviceMappings", [])
            if m.get("DeviceName") == name and "Ebs" in m
        ),
        0,
    )
    return name, size


def check_ami(ec2: Any, ami: str, root_volume_gb: int) -> str:
    """The AMI's root device name, once the AMI is known to exist in the region and to fit in a
    root volume of `root_volume_gb`; a one-line error otherwise. `up` calls it before anything
    is made, so a wrong `--ami` costs nothing."""
    root_device, snapshot_gb = _root_device(ec2, ami)
    if root_volume_gb < snapshot_gb:
        raise InputError(
            f"root_volume_gb {root_volume_gb} is smaller than AMI {ami}'s {snapshot_gb} GiB "
            f"snapshot; set root_volume_gb to at least {snapshot_gb}"
        )
    return root_device


# --- launch ----------------------------------------------------------------------------------


def client_token(
    prefix: str, *, role: str, instance_type: str, az: str, spot: bool, count: int
) -> str:
    """The RunInstances ClientToken of one attempt.

    AWS refuses a token reused with other parameters, so each (type, AZ) attempt gets its own
    token: the caller's prefix plus a digest of what differs. The prefix stays readable in the
    instance's ClientToken, which is how `launch` recognizes its own earlier launches.
    """
    _check_prefix(prefix)
    what = f"{role}|{instance_type}|{az}|{'spot' if spot else 'on-demand'}|{count}"
    return f"{prefix}-{hashlib.sha256(what.encode()).hexdigest()[:12]}"


def _check_prefix(prefix: str) -> None:
    if not prefix or len(prefix) > _MAX_TOKEN_PREFIX or not prefix.isascii():
        raise ValueError(f"client_token_prefix must be 1-{_MAX_TOKEN_PREFIX} ASCII characters")


def _tags(spec: ClusterSpec, role: str) -> list[dict[str, str]]:
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


def _run_request(
    spec: ClusterSpec,
    *,
    role: str,
    count: int,
    instance_type: str,
    subnet_id: str,
    security_group_id: str,
    instance_profile_arn: str,
    ami: str,
    root_device: str,
    spot: bool,
    token: str,
    key_name: str | None = None,
    user_data: str | None = None,
) -> dict[str, Any]:
    """The RunInstances arguments of one attempt: the security defaults of design section 5.

    MinCount == MaxCount: a role's instances come up together or not at all, so a capacity
    error never leaves half a cluster behind to clean up. Shutdown from inside the machine
    (autostop, `shutdown -h`) terminates it, for spot and on-demand alike: a stopped GPU node
    still bills its volume and holds its quota.
    """
    tag_types = ["instance", "volume"] + (["spot-instances-request"] if spot else [])
    request: dict[str, Any] = {
        "ImageId": ami,
        "InstanceType": instance_type,
        "MinCount": count,
        "MaxCount": count,
        # the public address is asked for here, not by the subnet: the foundation's subnets (and
        # subnets a user brings) do not hand one out by default, and SSH needs one
        "NetworkInterfaces": [
            {
                "DeviceIndex": 0,
                "SubnetId": subnet_id,
                "Groups": [security_group_id],
                "AssociatePublicIpAddress": True,
                "DeleteOnTermination": True,
            }
        ],
        "IamInstanceProfile": {"Arn": instance_profile_arn},
        "MetadataOptions": {
            "HttpTokens": "required",
            "HttpEndpoint": "enabled",
            "HttpPutResponseHopLimit": 1,
        },
        "BlockDeviceMappings": [
            {
                "DeviceName": root_device,
                "Ebs": {
                    "VolumeSize": spec.root_volume_gb,
                    "VolumeType": "gp3",
                    "Encrypted": True,
                    "DeleteOnTermination": True,
                },
            }
        ],
        "InstanceInitiatedShutdownBehavior": "terminate",
        "TagSpecifications": [
            {"ResourceType": kind, "Tags": _tags(spec, role)} for kind in tag_types
        ],
        "ClientToken": token,
    }
    if spot:
        request["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {
                "SpotInstanceType": "one-time",
                "InstanceInterruptionBehavior": "terminate",
            },
        }
    if key_name or spec.key_name:
        request["KeyName"] = key_name or spec.key_name
    if user_data:
        request["UserData"] = user_data  # boto3 base64-encodes it
    return request


def launched_with(ec2: Any, cluster: str, prefix: str, role: str | None = None) -> list[Instance]:
    """Live instances of this cluster (and role, when given) launched under `prefix`.

    AWS's ClientToken alone does not make a retried `up` safe: after a fallback the retry tries
    the first (type, AZ) again under that attempt's token, which AWS has never seen succeed.
    Looking for any token with the prefix catches every attempt. A prefix that is unique to one
    `up` also names exactly what that `up` launched, even a launch whose answer was lost."""
    filters = [
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]},
        {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
    ]
    if role is not None:
        filters.append({"Name": f"tag:{TAG_ROLE}", "Values": [role]})
    raw = _describe(ec2, filters)
    token = re.compile(rf"{re.escape(prefix)}-[0-9a-f]{{12}}")
    mine = [r for r in raw if token.fullmatch(str(r.get("ClientToken", "")))]
    return sorted((Instance.from_ec2(r) for r in mine), key=lambda i: i.id)


def launch(
    ec2: Any,
    spec: ClusterSpec,
    *,
    role: str,
    count: int,
    subnet_by_az: Mapping[str, str],
    security_group_id: str,
    instance_profile_arn: str,
    ami: str,
    spot: bool,
    instance_types: Sequence[str],
    client_token_prefix: str,
    key_name: str | None = None,
    user_data: str | None = None,
) -> list[Instance]:
    """Launch `count` instances of `role`, all of one type in one AZ, and return them.

    Tries `instance_types` in order and, for each, the AZs of `subnet_by_az` in order (the dict's
    order is the preference); a capacity error moves to the next AZ, a quota error to the next
    type (quotas are regional: another AZ cannot help, another family's quota may). Any other
    error stops at once. When every attempt fails the error lists what was tried.

    Idempotent per `client_token_prefix`: if instances of this cluster and role launched under
    the prefix are still alive they are returned and nothing is launched. Keep the prefix for a
    retried `up` and use a new one for a new cluster generation (after `down`).

    The instances may still be pending; `wait_ready` waits for them. Instances of an earlier
    role are the caller's to clean up if this one fails. `key_name` (else the spec's) is the
    EC2 key pair let in; `user_data` goes to every instance of the request (cloud-init's: the
    host key of `nodes.host_key_user_data`).
    """
    if count < 1:
        return []
    if not subnet_by_az:
        raise ValueError("subnet_by_az must name at least one AZ and its subnet")
    if not instance_types:
        raise ValueError("instance_types must name at least one instance type")
    region = aws.region_of(ec2)
    _check_prefix(client_token_prefix)
    earlier = launched_with(ec2, spec.name, client_token_prefix, role)
    if earlier:
        return earlier
    offered = check_offered(ec2, instance_types, list(subnet_by_az))
    root_device = check_ami(ec2, ami, spec.root_volume_gb)
    failures: list[str] = []
    quota_hits: list[str] = []
    for itype in instance_types:
        for az in offered[itype]:
            request = _run_request(
                spec,
                role=role,
                count=count,
                instance_type=itype,
                subnet_id=subnet_by_az[az],
                security_group_id=security_group_id,
                instance_profile_arn=instance_profile_arn,
                ami=ami,
                root_device=root_device,
                spot=spot,
                key_name=key_name,
                user_data=user_data,
                token=client_token(
                    client_token_prefix,
                    role=role,
                    instance_type=itype,
                    az=az,
                    spot=spot,
                    count=count,
                ),
            )
            try:
                response = _run_instances(ec2, request)
            except bx.ClientError as exc:
                code = aws.error_code(exc)
                if code in CAPACITY_CODES:
                    failures.append(f"{itype} in {az}: {code}")
                    continue
                if code in aws.QUOTA_CODES:
                    quota_hits.append(_quota_hint(itype, spot, code))
                    break
                action = f"RunInstances ({itype} in {az})"
                raise aws.describe_error(exc, f"{action} in {region}") from exc
            except bx.BotoCoreError as exc:
                action = f"RunInstances ({itype} in {az})"
                raise aws.describe_error(exc, f"{action} in {region}") from exc
            return _launched(response, client_token_prefix)
    market = "spot" if spot else "on-demand"
    tried = ", ".join(failures + quota_hits)
    raise SparknetError(
        f"no capacity for {count} {market} {role} instance(s) of {'/'.join(instance_types)} in "
        f"any of {', '.join(subnet_by_az)} ({tried}); add instance types or AZs, "
        + ("request a higher quota, " if quota_hits else "")
        + ("or try on-demand" if spot else "or try again later")
    )


def _run_instances(ec2: Any, request: Mapping[str, Any]) -> dict[str, Any]:
    """RunInstances, repeated while EC2 does not yet see a just-made instance profile (the same
    ClientToken is safe: the refused call launched nothing)."""
    deadline = time.monotonic() + PROFILE_PROPAGATION_S
    while True:
        try:
            return dict(ec2.run_instances(**request))
        except bx.ClientError as exc:
            message = str(exc.response.get("Error", {}).get("Message", ""))
            unseen_profile = (
                aws.error_code(exc) == "InvalidParameterValue" and "iamInstanceProfile" in message
            )
            if not unseen_profile or time.monotonic() >= deadline:
                raise
        time.sleep(PROFILE_RETRY_S)


def _quota_hint(instance_type: str, spot: bool, code: str) -> str:
    """Where a user raises the quota behind `code`: it is per instance family, not per type."""
    name = _QUOTA_NAMES.get((spot, instance_type[:1]), "the EC2 vCPU quota of this family")
    return f"{instance_type}: {code}, quota '{name}'"


def _launched(response: Mapping[str, Any], prefix: str) -> list[Instance]:
    """The instances of a RunInstances response. AWS answers a reused ClientToken with the
    instances it launched the first time, even terminated ones: that is no cluster."""
    raw = response["Instances"]
    if all(r.get("State", {}).get("Name") in ("shutting-down", "terminated") for r in raw):
        raise SparknetError(
            f"launch id {prefix} was used by instances that are already terminated; "
            "start the cluster with a new launch id"
        )
    return sorted((Instance.from_ec2(r) for r in raw), key=lambda i: i.id)


# --- wait, find, terminate -------------------------------------------------------------------


def _describe(
    ec2: Any, filters: list[dict[str, Any]] | None = None, ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Every `Instances[]` item matching, across pages and reservations."""
    kwargs: dict[str, Any] = {}
    if filters:
        kwargs["Filters"] = filters
    if ids:
        kwargs["InstanceIds"] = list(ids)
    found: list[dict[str, Any]] = []
    with aws.aws_call("DescribeInstances", aws.region_of(ec2)):
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
    carry the public IPs, which a launch response may lack.
    """
    if not ids:
        return []
    deadline = time.monotonic() + timeout_s
    wait_instances(ec2, "instance_running", ids, deadline, delay_s)
    wait_instances(ec2, "instance_status_ok", ids, deadline, delay_s)
    return sorted((Instance.from_ec2(r) for r in _describe(ec2, ids=ids)), key=lambda i: i.id)


def find(ec2: Any, cluster: str) -> list[Instance]:
    """Every instance tagged with `cluster` that is not terminated, master first.

    By tag, not from a local registry, so `down` and the orphan sweep work from any machine."""
    raw = _describe(
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
        ec2.terminate_instances(InstanceIds=list(ids))
    if wait:
        wait_instances(ec2, "instance_terminated", ids, time.monotonic() + timeout_s, delay_s)


def terminate_cluster(
    ec2: Any, cluster: str, wait: bool = True, *, timeout_s: float = 600.0, delay_s: float = 5.0
) -> list[str]:
    """Terminate every live instance tagged with `cluster`; the ids it terminated."""
    ids = [i.id for i in find(ec2, cluster)]
    terminate(ec2, ids, wait, timeout_s=timeout_s, delay_s=delay_s)
    return ids


# --- price and caller address ----------------------------------------------------------------


@functools.cache
def _price_table() -> dict[str, Any]:
    """prices.json, read once on first use (not at import)."""
    text = resources.files("sparknet.cluster").joinpath("prices.json").read_text("utf-8")
    return dict(json.loads(text))


#: how AWS turns a per-GB-month EBS price into hours (its pricing pages use 730 hours a month)
HOURS_PER_MONTH = 730


@dataclass(frozen=True)
class Hourly:
    """USD per hour of running instances, by what AWS bills separately: compute (by type and
    market), EBS volumes (by GiB) and public IPv4 addresses (per address).

    `compute` and `ebs` are None where a price is unknown (a region the table lacks, a spot
    type with no price history, a volume type not in the table); `total` is then None too, so
    an estimate is never silently low.
    """

    compute: float | None = 0.0
    ebs_gib: int = 0
    ebs: float | None = 0.0
    public_ipv4: int = 0

    @property
    def ipv4(self) -> float:
        return self.public_ipv4 * float(_price_table()["public_ipv4_usd_per_hour"])

    @property
    def total(self) -> float | None:
        if self.compute is None or self.ebs is None:
            return None
        return self.compute + self.ebs + self.ipv4

    def __add__(self, other: Hourly) -> Hourly:
        def plus(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a + b

        return Hourly(
            compute=plus(self.compute, other.compute),
            ebs_gib=self.ebs_gib + other.ebs_gib,
            ebs=plus(self.ebs, other.ebs),
            public_ipv4=self.public_ipv4 + other.public_ipv4,
        )

    def describe(self) -> str:
        """One line: the total and its parts, e.g. "$2.11/hour (instances $2.058, 360 GiB
        EBS $0.039, 3 public IPv4 $0.015)"."""

        def usd(value: float | None, digits: int = 3) -> str:
            return "unknown" if value is None else f"${value:.{digits}f}"

        total = "unknown" if self.total is None else f"{usd(self.total, 2)}/hour"
        return (
            f"{total} (instances {usd(self.compute)}, {self.ebs_gib} GiB EBS {usd(self.ebs)}, "
            f"{self.public_ipv4} public IPv4 {usd(self.ipv4)})"
        )


def hourly_costs(ec2: Any, found: Sequence[Instance]) -> dict[str, Hourly]:
    """Instance id -> what it costs per hour as it runs now: its own type and market, the EBS
    volumes attached to it, and its public IPv4 address. Priced from EC2's answers, not from a
    spec, so what a fallback or an earlier `up` launched is priced as launched. A stopped
    instance bills only its volumes (AWS releases its public address too)."""
    volumes = _attached_volumes(ec2, [i.id for i in found])
    out = {}
    for inst in found:
        mine = None if volumes is None else volumes.get(inst.id, [])
        out[inst.id] = Hourly(
            compute=0.0 if inst.stopped else hourly_price(inst.type, inst.spot, inst.az, ec2),
            ebs_gib=sum(size for _, size in mine or []),
            ebs=None if mine is None else _ebs_hourly(ec2, mine),
            public_ipv4=1 if inst.public_ip and not inst.stopped else 0,
        )
    return out


def hourly_cost(ec2: Any, found: Sequence[Instance]) -> Hourly:
    """What the instances cost per hour together (see `hourly_costs`)."""
    return sum(hourly_costs(ec2, found).values(), Hourly())


def _attached_volumes(ec2: Any, ids: Sequence[str]) -> dict[str, list[tuple[str, int]]] | None:
    """Instance id -> (volume type, GiB) of each EBS volume attached to it; None when EC2 does
    not answer (an estimate must never stop `up` or `down`)."""
    out: dict[str, list[tuple[str, int]]] = {}
    try:
        for start in range(0, len(ids), 200):  # EC2 takes at most 200 values per filter
            chunk = list(ids[start : start + 200])
            attached = [{"Name": "attachment.instance-id", "Values": chunk}]
            for page in ec2.get_paginator("describe_volumes").paginate(Filters=attached):
                for volume in page["Volumes"]:
                    for att in volume.get("Attachments", []):
                        if att.get("InstanceId") in chunk:
                            item = (volume["VolumeType"], int(volume["Size"]))
                            out.setdefault(att["InstanceId"], []).append(item)
    except (bx.BotoCoreError, bx.ClientError):
        return None
    return out


def _ebs_hourly(ec2: Any, volumes: Sequence[tuple[str, int]]) -> float | None:
    """USD per hour of the volumes (the table's $/GB-month over `HOURS_PER_MONTH`); None for a
    region or volume type the table lacks."""
    table = _price_table()
    if aws.region_of(ec2) != table["region"]:
        return None
    prices = table["ebs_usd_per_gb_month"]
    if any(kind not in prices for kind, _ in volumes):
        return None
    return sum(float(prices[kind]) * size for kind, size in volumes) / HOURS_PER_MONTH


def hourly_price(
    instance_type: str, spot: bool = False, az: str | None = None, ec2: Any | None = None
) -> float | None:
    """USD per hour of one instance's compute, for estimates; None when unknown.

    On-demand from the bundled table (us-east-1 list prices; other regions are unknown, as is
    the region when `ec2` is a client of another). Spot from EC2's spot price history: the
    current price in `az`, or the lowest current price across AZs; it needs `ec2`. A failed
    lookup is None, not an error: a missing estimate must never stop a launch.
    """
    if spot:
        return _spot_price(ec2, instance_type, az) if ec2 is not None else None
    table = _price_table()
    if ec2 is not None and aws.region_of(ec2) != table["region"]:
        return None
    price = table["on_demand"].get(instance_type)
    return None if price is None else float(price)


def _spot_price(ec2: Any, instance_type: str, az: str | None) -> float | None:
    """The newest spot price per AZ (StartTime=now asks for the prices in effect now)."""
    kwargs: dict[str, Any] = {
        "InstanceTypes": [instance_type],
        "ProductDescriptions": ["Linux/UNIX"],
        "StartTime": datetime.now(timezone.utc),
    }
    if az:
        kwargs["AvailabilityZone"] = az
    latest: dict[str, tuple[datetime, float]] = {}
    try:
        for page in ec2.get_paginator("describe_spot_price_history").paginate(**kwargs):
            for item in page["SpotPriceHistory"]:
                zone, when = item["AvailabilityZone"], item["Timestamp"]
                if az and zone != az:
                    continue
                if zone not in latest or when > latest[zone][0]:
                    latest[zone] = (when, float(item["SpotPrice"]))
    except (bx.BotoCoreError, bx.ClientError):
        return None
    return min((price for _, price in latest.values()), default=None)


def caller_cidr(timeout: float = 3.0) -> str:
    """The caller's public IPv4 address as a /32, the default SSH source of a cluster.

    Asked of AWS's own checkip endpoint (the URL in `SPARKNET_CHECKIP_URL`, else `CHECKIP_URL`)
    so no third party learns who runs clusters. Behind NAT or a VPN this is the exit address,
    which is what the security group sees."""
    url = os.environ.get(CHECKIP_ENV) or CHECKIP_URL
    if not url.startswith(("https://", "http://")):
        raise InputError(f"{CHECKIP_ENV}={url!r} is not an http(s) URL")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read(64).decode("ascii", "replace").strip()
        address = ipaddress.IPv4Address(text)
    except (OSError, ValueError) as exc:
        raise SparknetError(
            f"could not learn your public IPv4 address from {url} ({aws.one_line(exc)}); "
            "pass --allowed-cidr (e.g. 203.0.113.7/32)"
        ) from exc
    return f"{address}/32"
