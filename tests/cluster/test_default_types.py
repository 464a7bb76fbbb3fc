"""The default instance types in regions that lack some of them.

The region answers are moto's server's (DescribeInstanceTypeOfferings by AZ, from its copy of
AWS's offerings, which differ by region as AWS's do: us-west-1 has neither g5 nor g6 there,
eu-west-1 no g6, ca-west-1 none of the three). The default types narrow to those offered; types
the user chose are refused as before, in one line.
"""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from sparknet.cluster.aws import preflight
from sparknet.cluster.spec import DEFAULT_INSTANCE_TYPES, ClusterSpec
from sparknet.errors import InputError
from tests.cluster.test_instances import assert_one_line


def _ec2(moto_endpoint: str, region: str) -> Any:
    return boto3.client("ec2", region_name=region, endpoint_url=moto_endpoint)


def _narrowed(moto_endpoint: str, region: str, **given: Any) -> tuple[ClusterSpec, list[str]]:
    said: list[str] = []
    spec = ClusterSpec(name="c1", region=region, **given)
    return preflight.in_region(spec, _ec2(moto_endpoint, region), said.append), said


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
    else:
        assert said == [
            f"{region} offers no {lacking}: the default instance types there are "
            f"{', '.join(workers)}"
        ]
    # what is left is what check_offered passes: the launch finds every type in the region
    offered = preflight.check_offered(_ec2(moto_endpoint, region), [master, *workers])
    assert all(offered.values()), offered


def test_the_cluster_azs_narrow_them_too(moto_endpoint) -> None:
    """Offered in the region is not enough: one of the cluster's AZs must offer the type (in
    moto's ap-northeast-1, one AZ has g4dn but neither g5 nor g6)."""
    region = "ap-northeast-1"
    found = preflight.offerings(_ec2(moto_endpoint, region), DEFAULT_INSTANCE_TYPES)
    az = min(found["g4dn.xlarge"] - found["g5.xlarge"])
    assert all(found.values()) and az not in found["g6.xlarge"], found
    spec, said = _narrowed(moto_endpoint, region, availability_zones=[az])
    assert (spec.master_type, spec.instance_types) == ("g4dn.xlarge", ["g4dn.xlarge"])
    assert said == [
        f"{region} (AZs {az}) offers no g5.xlarge, g6.xlarge: the default instance types "
        "there are g4dn.xlarge"
    ]


def test_types_the_user_chose_are_kept_and_refused_where_not_offered(moto_endpoint) -> None:
    spec, said = _narrowed(
        moto_endpoint, "eu-west-1", master_type="g4dn.xlarge", instance_types=["g6.xlarge"]
    )
    assert (spec.master_type, spec.instance_types, said) == ("g4dn.xlarge", ["g6.xlarge"], [])
    with pytest.raises(InputError) as err:
        preflight.check_offered(_ec2(moto_endpoint, "eu-west-1"), spec.instance_types)
    assert_one_line(err.value, "instance type g6.xlarge is not offered in eu-west-1")
    # a chosen worker list beside the default master: only the master narrows
    spec, _ = _narrowed(moto_endpoint, "us-west-1", instance_types=["g4dn.xlarge", "p3.2xlarge"])
    assert (spec.master_type, spec.instance_types) == ("g4dn.xlarge", ["g4dn.xlarge", "p3.2xlarge"])


def test_a_region_with_none_of_them_is_refused_in_one_line(moto_endpoint) -> None:
    with pytest.raises(InputError) as err:
        _narrowed(moto_endpoint, "ca-west-1")
    assert_one_line(err.value, "instance type g5.xlarge is not offered in ca-west-1")


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
    assert said == [
        "us-west-1 offers no g5.xlarge, g6.xlarge: the default instance types there are g4dn.xlarge"
    ]
    # a builder type the user chose is kept (and refused later where it is not offered)
    chosen = ami.BakeSettings(
        region="us-west-1", base_ami=settings.base_ami, endpoint_url=moto_endpoint,
        instance_type="p3.2xlarge",
    )  # fmt: skip
    spec, _ = ami._builder_spec(chosen, _ec2(moto_endpoint, "us-west-1"), said.append)
    assert spec.master_type == "p3.2xlarge" and len(said) == 1
