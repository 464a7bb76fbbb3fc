"""The EC2 vCPU quotas a cluster launches against, checked before `up` makes anything.

New accounts start with 0 vCPUs for the G and P families: without this check RunInstances
refuses the workers (VcpuLimitExceeded) only after the foundation is built and the master
launched. EC2 counts these quotas in vCPUs per region, one quota per (family class, market):
the need is DescribeInstanceTypes' default vCPUs times the count, and the use is that of the
region's running and pending instances of the class (DescribeInstances; the cluster's own are
left out, since `up` counts the whole cluster as needed). Service Quotas answers the limit; a
caller without `servicequotas:GetServiceQuota` gets one warning line and the launch goes on.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster.aws.instances import describe
from sparknet.cluster.spec import TAG_CLUSTER, ClusterSpec
from sparknet.errors import InputError
from sparknet.say import Say

#: Service Quotas' EC2 codes and names of the running-instance vCPU quotas, by (spot, class);
#: as AWS lists them (`aws service-quotas list-aws-default-service-quotas --service-code ec2`)
QUOTAS: dict[tuple[bool, str], tuple[str, str]] = {
    (False, "standard"): (
        "L-1216C47A",
        "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
    ),
    (False, "g"): ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    (False, "p"): ("L-417A185B", "Running On-Demand P instances"),
    (True, "standard"): (
        "L-34B43A08",
        "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
    ),
    (True, "g"): ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    (True, "p"): ("L-7212CCBC", "All P Spot Instance Requests"),
}
#: an instance type's leading letters -> its quota class; families with quotas of their own
#: that sparknet does not launch (F, Inf, Trn, DL, X, HPC, high memory) are not checked
_CLASSES = {
    **dict.fromkeys(("a", "c", "d", "h", "i", "im", "is", "m", "r", "t", "z"), "standard"),
    **dict.fromkeys(("g", "gr", "vt"), "g"),
    "p": "p",
}
_LIVE = ["pending", "running"]


def quota_class(instance_type: str) -> str | None:
    """The quota class of `instance_type` (g5.xlarge -> "g", p4d.24xlarge -> "p", m5.large ->
    "standard"); None for a family with a quota of its own."""
    letters = re.match(r"[a-z]+", instance_type.lower())
    return _CLASSES.get(letters.group(0)) if letters else None


def quota_of(instance_type: str, spot: bool) -> tuple[str, str] | None:
    """(code, name) of the vCPU quota `instance_type` launches against, on spot or on-demand."""
    klass = quota_class(instance_type)
    return QUOTAS.get((spot, klass)) if klass else None


def increase_command(region: str, code: str, desired: int) -> str:
    """The CLI call that asks AWS for a quota of `desired` vCPUs."""
    return (
        f"aws service-quotas request-service-quota-increase --region {region} "
        f"--service-code ec2 --quota-code {code} --desired-value {desired}"
    )


@dataclass(frozen=True)
class Need:
    """vCPUs one role of the cluster takes from one quota."""

    role: str
    instance_type: str
    count: int
    vcpus_each: int
    spot: bool

    @property
    def key(self) -> tuple[bool, str | None]:
        return self.spot, quota_class(self.instance_type)

    @property
    def vcpus(self) -> int:
        return self.count * self.vcpus_each


class QuotasUnreadable(Exception):
    """Service Quotas did not answer (no permission, or an endpoint without it): the message
    is AWS's error code (or the error's type); `denied` says a permission of the caller is what
    is missing."""

    def __init__(self, why: str, denied: bool = False) -> None:
        super().__init__(why)
        self.denied = denied


def default_vcpus(ec2: Any, types: Iterable[str]) -> dict[str, int]:
    """DescribeInstanceTypes' default vCPUs of each type (what EC2 counts against a quota)."""
    wanted = sorted(set(types))
    found: dict[str, int] = {}
    region = aws.region_of(ec2)
    with aws.aws_call("DescribeInstanceTypes", region):
        for start in range(0, len(wanted), 100):  # at most 100 types a call
            pages = ec2.get_paginator("describe_instance_types").paginate(
                InstanceTypes=wanted[start : start + 100]
            )
            for page in pages:
                for info in page["InstanceTypes"]:
                    found[info["InstanceType"]] = int(info["VCpuInfo"]["DefaultVCpus"])
    return found


def vcpus_in_use(
    ec2: Any, cluster: str, classes: Iterable[str] = ("standard", "g", "p")
) -> dict[tuple[bool, str], int]:
    """vCPUs of the region's pending and running instances of `classes` by (spot, class), the
    cluster's own left out. Counted from DescribeInstances (the measure the caller can read
    with EC2's permissions alone); Service Quotas' console shows the same from CloudWatch's
    AWS/Usage."""
    wanted = set(classes)
    raw = [
        r
        for r in describe(ec2, [{"Name": "instance-state-name", "Values": _LIVE}])
        if quota_class(r["InstanceType"]) in wanted
        and not any(t["Key"] == TAG_CLUSTER and t["Value"] == cluster for t in r.get("Tags", []))
    ]
    if not raw:
        return {}
    each = default_vcpus(ec2, {r["InstanceType"] for r in raw})
    used: dict[tuple[bool, str], int] = defaultdict(int)
    for r in raw:
        klass = str(quota_class(r["InstanceType"]))
        used[(r.get("InstanceLifecycle") == "spot", klass)] += each.get(r["InstanceType"], 0)
    return dict(used)


def applied_quota(quotas: Any, code: str) -> float:
    """The account's quota `code` in the client's region: the applied value, else AWS's default
    (GetServiceQuota answers NoSuchResourceException for a quota never changed)."""
    try:
        return float(quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
    except bx.ClientError as exc:
        if aws.error_code(exc) != "NoSuchResourceException":
            raise _unreadable(exc) from exc
    except bx.BotoCoreError as exc:
        raise _unreadable(exc) from exc
    try:
        answer = quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)
        return float(answer["Quota"]["Value"])
    except (bx.ClientError, bx.BotoCoreError) as exc:
        raise _unreadable(exc) from exc


def _unreadable(exc: BaseException) -> QuotasUnreadable:
    if isinstance(exc, bx.ClientError):
        code = aws.error_code(exc)
        return QuotasUnreadable(code or "no answer", denied=code in aws.DENIED_CODES)
    return QuotasUnreadable(type(exc).__name__)


def needs(spec: ClusterSpec, vcpus: dict[str, int]) -> tuple[Need, list[Need]]:
    """The master's need, and the workers' need for each of their types (one is launched: the
    first whose capacity and quota allow, `launcher.launch`)."""
    master = Need("master", spec.master_type, 1, vcpus.get(spec.master_type, 0), False)
    workers = [
        Need("worker", t, spec.workers, vcpus.get(t, 0), spec.spot) for t in spec.instance_types
    ]
    return master, workers


def check_quotas(spec: ClusterSpec, ec2: Any, quotas: Any, say: Say) -> None:
    """Refuse, in one line and before anything is made, a cluster whose master or workers
    exceed their vCPU quota with what already runs in the region; the line names the quota,
    the need, the use, the quota and the command that asks for more. When Service Quotas
    cannot be read, say so in one line and go on (RunInstances still refuses, later)."""
    types: Sequence[str] = [spec.master_type, *(spec.instance_types if spec.workers else [])]
    if not any(quota_class(t) for t in types):
        return
    master, workers = needs(spec, default_vcpus(ec2, types))
    workers = workers if spec.workers else []
    limits: dict[tuple[bool, str], float] = {}
    try:
        for need in [master, *workers]:
            spot, klass = need.key
            if klass and (spot, klass) not in limits:
                limits[(spot, klass)] = applied_quota(quotas, QUOTAS[(spot, klass)][0])
    except QuotasUnreadable as exc:
        fix = (
            "; allow the caller servicequotas:GetServiceQuota and GetAWSDefaultServiceQuota "
            "to check them first"
            if exc.denied
            else ""
        )
        say(
            f"could not read the EC2 vCPU quotas in {spec.region} ({exc}): the launch goes on "
            f"without checking them{fix}"
        )
        return
    used = vcpus_in_use(ec2, spec.name, {klass for _spot, klass in limits})
    short = _short(master, 0, used, limits)
    if short:
        raise InputError(_refusal(spec, short, used, limits, {}))
    beside = {t: master.vcpus if workers and t.key == master.key else 0 for t in workers}
    fits = [w for w in workers if not _short(w, beside[w], used, limits)]
    if workers and not fits:
        raise InputError(_refusal(spec, workers[0], used, limits, beside, others=workers[1:]))


def _short(need: Need, beside: int, used: dict, limits: dict) -> Need | None:
    """`need` when it does not fit its quota next to `beside` vCPUs of the same cluster."""
    spot, klass = need.key
    if not klass:
        return None
    over = need.vcpus + beside + used.get((spot, klass), 0) > limits[(spot, klass)]
    return need if over else None


def _refusal(
    spec: ClusterSpec,
    need: Need,
    used: dict,
    limits: dict,
    beside: dict[Need, int],
    others: Sequence[Need] = (),
) -> str:
    """The one line that refuses `need` (and each of `others`, the worker types the launch
    would try instead): for each, its quota's code, the vCPUs it needs, those in use, the
    quota, and the command that asks for enough."""
    first = f"cluster {spec.name} needs {_shortfall(spec, need, used, limits, beside.get(need, 0))}"
    rest = [
        f"instead, {other.instance_type} needs "
        f"{_shortfall(spec, other, used, limits, beside.get(other, 0))}"
        for other in others
    ]
    return "; ".join([first, *rest])


def _shortfall(spec: ClusterSpec, need: Need, used: dict, limits: dict, beside: int) -> str:
    spot, klass = need.key
    code, name = QUOTAS[(spot, str(klass))]
    in_use = used.get((spot, str(klass)), 0)
    limit = int(limits[(spot, str(klass))])
    total = need.vcpus + beside
    what = f"{need.count} x {need.instance_type} ({need.vcpus_each} vCPUs each)"
    if beside:
        what += f" and the master's {beside}"
    return (
        f"{total} vCPUs of EC2 quota {code} '{name}' in {spec.region} for {what}, {in_use} are "
        f"in use by other instances, and the quota is {limit}; ask for more: "
        f"{increase_command(spec.region, code, total + in_use)}"
    )
