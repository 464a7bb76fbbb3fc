"""What `up` (and an AMI bake) learns and checks before anything is made.

The AMI, that the instance types, AZs, key pair and root volume fit the region, that the bucket
is in it, and the caller's address.

Apart from the launch itself (`launcher.py`) because these run first, on their own, so that a
wrong input fails in one line before a foundation or a master exists to clean up.
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster.aws.foundation import launch_zones
from sparknet.cluster.spec import DEFAULT_INSTANCE_TYPES, ClusterSpec
from sparknet.data import s3
from sparknet.errors import InputError, SparknetError
from sparknet.say import Say, command_line

#: AWS's own "what is my IP" endpoint; `SPARKNET_CHECKIP_URL` overrides it (tests, proxies)
CHECKIP_URL = "https://checkip.amazonaws.com"
CHECKIP_ENV = "SPARKNET_CHECKIP_URL"

#: what AWS's AMI ids look like (older ones have 8 hex digits, newer ones 17)
AMI_ID = re.compile(r"ami-(?:[0-9a-f]{8}|[0-9a-f]{17})")


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
                "SSM parameter {parameter} does not exist in {region}; pass {@ami=image} to "
                "`cluster up` (e.g. one `make ami` baked), or set ami or ami_parameter in the "
                "cluster's `clusters:` entry",
                parameter=spec.ami_parameter,
                region=region,
                image="AMI_ID",
            ) from exc
        raise aws.describe_error(
            exc, f"reading SSM parameter {spec.ami_parameter} in {region}"
        ) from exc
    except bx.BotoCoreError as exc:
        raise aws.describe_error(
            exc, f"reading SSM parameter {spec.ami_parameter} in {region}"
        ) from exc


def offerings(ec2: Any, instance_types: Sequence[str]) -> dict[str, set[str]]:
    """The AZs of the region that offer each instance type (an empty set: none)."""
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
    return found


def check_offered(
    ec2: Any,
    instance_types: Sequence[str],
    azs: Sequence[str] | None = None,
    found: Mapping[str, set[str]] | None = None,
) -> dict[str, list[str]]:
    """For each instance type, the AZs among `azs` (every AZ of the region when empty) that
    offer it, in the order given; `found`: `offerings` already read for them.

    A type offered in none of them is a typo or a region without it: that is an error now,
    before anything is launched, rather than a launch failure after the master is already up.
    """
    region = aws.region_of(ec2)
    found = offerings(ec2, instance_types) if found is None else found
    offered: dict[str, list[str]] = {}
    for itype in instance_types:
        region_azs = found[itype]
        usable = [az for az in azs if az in region_azs] if azs else sorted(region_azs)
        if not region_azs:
            raise InputError(
                f"instance type {itype} is not offered in {region}; choose another "
                f"({command_line('aws ec2 describe-instance-type-offerings', region=region)})"
            )
        if not usable:
            raise InputError(
                f"instance type {itype} is offered in {region} only in "
                f"{', '.join(sorted(region_azs))}, none of the cluster's AZs "
                f"({', '.join(azs or [])}); add one of those AZs or choose another type"
            )
        offered[itype] = usable
    return offered


def in_region(spec: ClusterSpec, ec2: Any, say: Say = lambda _: None) -> ClusterSpec:
    """The spec with the instance types it launches in its region, each checked offered in
    the AZs it launches into (`foundation.launch_zones`; a one-line refusal otherwise).

    Types left at their defaults (not set in the settings or by a flag: pydantic's
    `model_fields_set`) narrow to those offered there: no region offers them all (moto's copy
    of AWS's offerings: us-west-1 has no g5 or g6, eu-west-1 no g6), and the defaults must
    launch wherever one of them can. A default master the zones lack becomes the first default
    worker type they offer; a cluster without workers needs no worker type. What changed is
    said. Types the user chose are never changed: where they are not offered they are refused,
    as a typo must be. A registered cluster's spec has every field set: it launches what it was
    registered with.
    """
    region = aws.region_of(ec2)
    zones = launch_zones(ec2, spec)
    defaults = list(DEFAULT_INSTANCE_TYPES)
    narrow_workers = spec.workers > 0 and "instance_types" not in spec.model_fields_set
    narrow_master = "master_type" not in spec.model_fields_set
    where = f"{region} ({'AZ' if len(zones) == 1 else 'AZs'} {', '.join(zones)})"
    # one read for the defaults and the spec's own types
    found = offerings(ec2, list(dict.fromkeys([*defaults, spec.master_type, *spec.instance_types])))
    update: dict[str, Any] = {}
    if narrow_workers or narrow_master:
        offered = [t for t in defaults if found[t] & set(zones)]
        if not offered:
            picked = spec.availability_zones or spec.subnet_ids
            raise InputError(
                f"none of the default instance types ({', '.join(defaults)}) is offered in "
                f"{where}; set master_type and instance_types to types offered there"
                + ("" if picked else ", or availability_zones to AZs that offer one")
                + f" ({command_line('aws ec2 describe-instance-type-offerings', region=region)})"
            )
        if narrow_workers and offered != defaults:
            update["instance_types"] = offered
        if narrow_master and spec.master_type not in offered:
            update["master_type"] = offered[0]
    spec = spec.model_copy(update=update)
    launched = [spec.master_type, *(spec.instance_types if spec.workers else [])]
    check_offered(ec2, launched, zones, found)
    if update:
        chosen = [f"master {spec.master_type}"] if "master_type" in update else []
        if "instance_types" in update:
            chosen.append(f"workers {', '.join(spec.instance_types)}")
        lacking = ", ".join(t for t in defaults if t not in offered)
        say(f"{where} offers no {lacking}: of the default types, {' and '.join(chosen)}")
    return spec


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


def check_bucket_region(
    spec: ClusterSpec,
    endpoint_url: str | None = None,
    bucket: str | None = None,
    say: Say | None = None,
) -> None:
    """`bucket` (default: the cluster's `bucket:`) is in the cluster's region, unless the spec
    sets `cross_region_data`: every read of a dataset in another region is billed per GB (each
    epoch again) and slower. One line naming both regions otherwise. A bucket S3 answers 404
    for (one the foundation will make) passes; so does one on a store that is not AWS's S3
    (`s3.on_aws_s3`: MinIO and the like report a region of their configuration, and bill no
    transfer). A HeadBucket that fails otherwise (throttled after its retries, a 5xx) leaves
    the region unknown: `say` is told so in one line and the check passes; without `say`, the
    one-line error is raised."""
    bucket = bucket or spec.bucket
    if bucket is None or spec.cross_region_data or not s3.on_aws_s3(endpoint_url):
        return
    try:
        where = s3.bucket_region(bucket, endpoint_url)
    except SparknetError as exc:
        if say is None:
            raise
        say(f"warning: the region of bucket {bucket} is unknown, so not checked: {exc}")
        return
    if where is None or where == spec.region:
        return
    raise InputError(
        f"bucket {bucket} is in {where} and cluster {spec.name} in {spec.region}: every read "
        f"of its data would cross regions, and AWS bills cross-region transfer per GB (each "
        f"epoch again); launch the cluster in {where} (region: {where}), copy the data to a "
        f"bucket in {spec.region}, or set cross_region_data: true to accept the cost"
    )


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
            "could not learn your public IPv4 address from {url} ({why}); pass "
            "{@allowed_cidr} (e.g. 203.0.113.7/32)",
            url=url,
            why=aws.one_line(exc),
        ) from exc
    return f"{address}/32"
