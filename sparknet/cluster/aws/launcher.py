"""Launching a role's instances, on-demand or spot.

Falling back across instance types and AZs on capacity errors, idempotent per ClientToken
prefix.

Its own module because the fallback, the tokens that make a retried `up` safe and the request's
security defaults are one piece that only `up` and an AMI bake use; everything after the launch
is `instances.py`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster.aws import quotas
from sparknet.cluster.aws.instances import LIVE_STATES, Instance, describe, role_tags
from sparknet.cluster.aws.preflight import check_ami, check_offered
from sparknet.cluster.spec import TAG_CLUSTER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError

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
#: how long RunInstances may reject a new instance profile as invalid before it is an error:
#: IAM is eventually consistent, and a profile made by the foundation a moment ago is not yet
#: visible to EC2 (IAM's guide: changes take time to be seen everywhere; Terraform's AWS provider
#: settled on 2 minutes for the same wait)
PROFILE_PROPAGATION_S = 120.0
#: the first pause before asking again; it doubles (see `aws.retrying`)
PROFILE_RETRY_S = 2.0
#: a ClientToken is at most 64 ASCII characters; launch appends "-" and a 12-character digest
_MAX_TOKEN_PREFIX = 64 - 13


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
            {"ResourceType": kind, "Tags": role_tags(spec, role)} for kind in tag_types
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
    raw = describe(ec2, filters)
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
    host key of `keys.host_key_user_data`).
    """
    if count < 1:
        return []
    if not subnet_by_az:
        raise ValueError("subnet_by_az must name at least one AZ and its subnet")
    if not instance_types:
        raise ValueError("instance_types must name at least one instance type")
    region = aws.region_of(ec2)
    # a refused (type, AZ) is answered at once, not retried as a 5xx: the next one may fit
    aws.answer_at_once(ec2, "RunInstances", CAPACITY_CODES | aws.QUOTA_CODES)
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
                    quota_hits.append(_quota_hint(ec2, itype, spot, code, count))
                    break
                action = f"RunInstances ({itype} in {az})"
                raise aws.describe_error(exc, f"{action} in {region}") from exc
            except bx.BotoCoreError as exc:
                action = f"RunInstances ({itype} in {az})"
                raise aws.describe_error(exc, f"{action} in {region}") from exc
            return _launched(response, client_token_prefix)
    market = "spot" if spot else "on-demand"
    tried = ", ".join(failures + quota_hits)
    if quota_hits and not failures:
        # every type met its quota: capacity was never the matter, and waiting does not help
        raise SparknetError(
            f"{count} {market} {role} instance(s) of {'/'.join(instance_types)} exceed the "
            f"account's EC2 vCPU quota in {region} ({tried}); request a higher quota with the "
            "command named, or choose instance types of another family"
        )
    raise SparknetError(
        f"no capacity for {count} {market} {role} instance(s) of {'/'.join(instance_types)} in "
        f"any of {', '.join(subnet_by_az)} ({tried}); add instance types or AZs, "
        + ("request a higher quota, " if quota_hits else "")
        + ("or try on-demand" if spot else "or try again later")
    )


def _run_instances(ec2: Any, request: Mapping[str, Any]) -> dict[str, Any]:
    """RunInstances, repeated while EC2 does not yet see a just-made instance profile (the same
    ClientToken is safe: the refused call launched nothing)."""
    return aws.retrying(
        lambda: dict(ec2.run_instances(**request)),
        _unseen_profile,
        within_s=PROFILE_PROPAGATION_S,
        pause_s=PROFILE_RETRY_S,
    )


def _unseen_profile(exc: bx.ClientError) -> bool:
    """EC2's answer for an instance profile IAM has not shown it yet: `Value (ARN) for parameter
    iamInstanceProfile.arn is invalid. Invalid IAM Instance Profile ARN`."""
    message = str(exc.response.get("Error", {}).get("Message", ""))
    return aws.error_code(exc) == "InvalidParameterValue" and "iamInstanceProfile" in message


def _quota_hint(ec2: Any, instance_type: str, spot: bool, code: str, count: int) -> str:
    """Where a user raises the quota behind `code` (per instance family and region, not per
    type), and the command that asks for what `count` more of `instance_type` need next to the
    region's instances of the family now: the same amount `quotas.check_quotas` asks for."""
    region = aws.region_of(ec2)
    quota = quotas.quota_of(instance_type, spot)
    if quota is None:
        return f"{instance_type}: {code}, the EC2 vCPU quota of its family in {region}"
    klass = str(quotas.quota_class(instance_type))
    hint = f"{instance_type}: {code}, quota {quota[0]} '{quota[1]}' in {region}"
    try:
        need = count * quotas.default_vcpus(ec2, [instance_type])[instance_type]
        in_use = quotas.vcpus_in_use(ec2, "", {klass}).get((spot, klass), 0)
    except (SparknetError, bx.BotoCoreError, bx.ClientError, KeyError):
        # the refusal is what the user needs; without the amount the line still names the quota
        return f"{hint}: it must hold {count} more {instance_type}"
    return (
        f"{hint}: {need} vCPUs more than the {in_use} in use; "
        f"{quotas.increase_command(region, quota[0], need + in_use)}"
    )


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
