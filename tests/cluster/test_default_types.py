"""The default instance types in regions that lack some of them.

The region answers are moto's server's (DescribeInstanceTypeOfferings by AZ, from its copy of
AWS's offerings, which differ by region as AWS's do: us-west-1 has neither g5 nor g6 there,
eu-west-1 no g6, ca-west-1 none of the three, and one AZ of ap-northeast-1 only g4dn). Types
left at their defaults narrow to those offered in the AZs the cluster launches into; types the
user chose, even a default's name, are never changed and are refused where not offered.
"""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from sparknet.cluster.aws import preflight
from sparknet.cluster.aws.foundation import launch_zones
from sparknet.cluster.spec import DEFAULT_INSTANCE_TYPES, ClusterSpec
from sparknet.errors import InputError
from tests.cluster.test_instances import assert_one_line


def _ec2(moto_endpoint: str, region: str) -> Any:
    return boto3.client("ec2", region_name=region, endpoint_url=moto_endpoint)


def _narrowed(moto_endpoint: str, region: str, **given: Any) -> tuple[ClusterSpec, list[str]]:
    said: list[str] = []
    spec = ClusterSpec(name="c1", region=region, **given)
    return preflight.in_region(spec, _ec2(moto_endpoint, region), said.append), said


def _zones(moto_endpoint: str, region: str) -> str:
    return ", ".join(
        launch_zones(_ec2(moto_endpoint, region), ClusterSpec(name="c1", region=region))
    )


@pytest.mark.parametrize(
    ("region", "master", "workers", "lacking"),
    [
        ("us-east-1", "g5.xlarge", list(DEFAULT_INSTANCE_TYPES), None),
        ("eu-west-1", "g5.xlarge", ["g5.xlarge", "g4dn.xlarge"], "g6.xlarge"),
        ("us-west-1", "g4dn.xlarge", ["g4dn.xlarge"], "g5.xlarge, g6.xlarge"),
        ("eu-south-2", "g5.xlarge", ["g5.xlarge", "g6.xlarge"], "g4dn.xlarge"),
    ],
)
def test_the_defaults_narrow_to_what_the_region_offers(
    moto_endpoint, region, master, workers, lacking
) -> None:
    spec, said = _narrowed(moto_endpoint, region)
    assert (spec.master_type, spec.instance_types) == (master, workers)
    if lacking is None:
        assert said == []
        return
    chosen = "" if master == "g5.xlarge" else f"master {master} and "
    assert said == [
        f"{region} (AZs {_zones(moto_endpoint, region)}) offers no {lacking}: of the default "
        f"types, {chosen}workers {', '.join(workers)}"
    ]
    # what is left is what the launch finds offered in its zones
    zones = launch_zones(_ec2(moto_endpoint, region), spec)
    offered = preflight.check_offered(_ec2(moto_endpoint, region), [master, *workers], zones)
    assert all(offered.values()), offered


def test_the_zones_the_cluster_launches_into_narrow_them(moto_endpoint) -> None:
    """Offered in the region is not enough: one of the cluster's AZs must offer the type (in
    moto's ap-northeast-1, one AZ has g4dn but neither g5 nor g6)."""
    region = "ap-northeast-1"
    found = preflight.offerings(_ec2(moto_endpoint, region), DEFAULT_INSTANCE_TYPES)
    az = min(found["g4dn.xlarge"] - found["g5.xlarge"])
    assert all(found.values()) and az not in found["g6.xlarge"], found
    spec, said = _narrowed(moto_endpoint, region, availability_zones=[az])
    assert (spec.master_type, spec.instance_types) == ("g4dn.xlarge", ["g4dn.xlarge"])
    assert said == [
        f"{region} (AZ {az}) offers no g5.xlarge, g6.xlarge: of the default types, master "
        "g4dn.xlarge and workers g4dn.xlarge"
    ]
    # the user's own VPC: its subnets' zones are where it launches
    ec2 = _ec2(moto_endpoint, region)
    vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.9.1.0/24", AvailabilityZone=az)
    own = {"vpc_id": vpc, "subnet_ids": [subnet["Subnet"]["SubnetId"]]}
    spec, said = _narrowed(moto_endpoint, region, **own)
    assert (spec.master_type, spec.instance_types) == ("g4dn.xlarge", ["g4dn.xlarge"]), said


def test_types_the_user_chose_are_never_changed(moto_endpoint) -> None:
    """A default's name given by the user is the user's choice: refused where not offered,
    before anything is said of defaults."""
    for given, refused in (
        ({"master_type": "g5.xlarge"}, "g5.xlarge"),
        ({"master_type": "g4dn.xlarge", "instance_types": ["g6.xlarge"]}, "g6.xlarge"),
        ({"instance_types": ["g4dn.xlarge", "p3.2xlarge"]}, "p3.2xlarge"),
    ):
        said: list[str] = []
        with pytest.raises(InputError) as err:
            preflight.in_region(
                ClusterSpec(name="c1", region="us-west-1", **given),
                _ec2(moto_endpoint, "us-west-1"),
                said.append,
            )
        assert_one_line(err.value, f"instance type {refused} is not offered in us-west-1")
        assert said == [], given
    # a chosen worker list beside a default master: only the master narrows, and the line
    # says so without naming worker defaults that play no part
    spec, said = _narrowed(moto_endpoint, "us-west-1", instance_types=["g4dn.xlarge"])
    assert (spec.master_type, spec.instance_types) == ("g4dn.xlarge", ["g4dn.xlarge"])
    assert said[0].endswith(": of the default types, master g4dn.xlarge"), said


def test_a_cluster_without_workers_needs_no_worker_type(moto_endpoint) -> None:
    spec, said = _narrowed(moto_endpoint, "ca-west-1", master_type="m5.xlarge", workers=0)
    assert spec.master_type == "m5.xlarge" and said == []


def test_where_none_of_them_is_offered_the_line_says_what_to_set(moto_endpoint) -> None:
    with pytest.raises(InputError) as err:
        _narrowed(moto_endpoint, "ca-west-1")
    assert_one_line(
        err.value,
        "none of the default instance types (g5.xlarge, g4dn.xlarge, g6.xlarge) is offered in "
        "ca-west-1 (AZs ",
        "set master_type and instance_types to types offered there, or availability_zones",
    )
    with pytest.raises(InputError) as err:
        _narrowed(moto_endpoint, "eu-central-2", availability_zones=["eu-central-2a"])
    # AZs the user named: the line does not offer other AZs (moto's eu-central-2 has g6 in
    # another AZ only)
    assert_one_line(err.value, "offered in eu-central-2 (AZ eu-central-2a); set master_type")
    assert "or availability_zones" not in str(err.value)


def test_an_ami_bake_builds_on_a_default_type_the_region_offers(moto_endpoint) -> None:
    from sparknet.cluster import ami
    from tests.moto_server import amazon_ami

    said: list[str] = []
    settings = ami.BakeSettings(
        region="us-west-1", base_ami=amazon_ami("us-west-1"), endpoint_url=moto_endpoint
    )
    spec, base = ami._builder_spec(settings, _ec2(moto_endpoint, "us-west-1"), said.append)
    assert (spec.master_type, spec.instance_types, base) == (
        "g4dn.xlarge", ["g4dn.xlarge"], settings.base_ami
    )  # fmt: skip
    assert len(said) == 1 and said[0].endswith("of the default types, master g4dn.xlarge")
    # a builder type the user chose is kept, and refused where it is not offered
    for chosen in ("g5.xlarge", "p3.2xlarge"):
        with pytest.raises(InputError) as err:
            ami._builder_spec(
                ami.BakeSettings(
                    region="us-west-1",
                    base_ami=settings.base_ami,
                    endpoint_url=moto_endpoint,
                    instance_type=chosen,
                ),
                _ec2(moto_endpoint, "us-west-1"),
                said.append,
            )
        assert_one_line(err.value, f"instance type {chosen} is not offered in us-west-1")
