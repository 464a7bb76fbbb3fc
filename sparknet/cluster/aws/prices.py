"""What running instances cost per hour: the estimates `up`, `status` and `down` print.

From the bundled price table (`prices.json`) and EC2's spot price history.

Apart from `instances.py` because an estimate is never needed to run a cluster, and a failed
price lookup is None, never an error that could stop one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster.aws.instances import Instance


@functools.cache
def _price_table() -> dict[str, Any]:
    """prices.json, read once on first use (not at import)."""
    text = resources.files("sparknet.cluster.aws").joinpath("prices.json").read_text("utf-8")
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


def planned_hourly(ec2: Any, instance_type: str, spot: bool, count: int, volume_gb: int) -> Hourly:
    """What `count` instances of a type would cost per hour once launched as sparknet launches
    them (`launcher`: a gp3 root volume of `volume_gb` and a public IPv4 address each): the
    estimate before launch that `hourly_costs` makes of what runs."""
    price = hourly_price(instance_type, spot, None, ec2)
    return Hourly(
        compute=None if price is None else price * count,
        ebs_gib=volume_gb * count,
        ebs=_ebs_hourly(ec2, [("gp3", volume_gb)] * count),
        public_ipv4=count,
    )


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
        "StartTime": datetime.now(UTC),
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
    # a price of 0 is no price (an S3-compatible stand-in's placeholder): unknown, never free
    return min((price for _, price in latest.values() if price > 0), default=None)
