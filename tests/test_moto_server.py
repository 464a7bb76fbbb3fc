"""The suite's moto server: its quick tag lookup answers as moto's own scan does."""

from __future__ import annotations

import boto3
import pytest

from tests.moto_server import amazon_ami, amazon_amis

pytestmark = pytest.mark.integration

REGION = "us-east-1"


def test_the_quick_tag_lookup_gives_what_moto_scans_for(moto_endpoint):
    from moto.backends import get_backend
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models.core import TaggedEC2Resource

    ec2 = boto3.client("ec2", region_name=REGION)
    tags = [{"Key": "k*", "Value": "v?"}, {"Key": "moto-server-test", "Value": "q1"}]
    vpc = ec2.create_vpc(CidrBlock="10.7.0.0/16")["Vpc"]["VpcId"]
    ec2.create_tags(Resources=[vpc], Tags=tags)
    made = ec2.run_instances(
        ImageId=amazon_ami(REGION), InstanceType="t3.micro", MinCount=2, MaxCount=2,
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags[1:]}],
    )["Instances"]  # fmt: skip
    untagged = ec2.create_security_group(GroupName="q1-bare", Description="x", VpcId=vpc)

    backend = get_backend("ec2")[DEFAULT_ACCOUNT_ID][REGION]
    quick = TaggedEC2Resource.get_tags
    assert quick.quick, "the suite's moto_endpoint put the quick lookup in"
    resources = [
        backend.vpcs[vpc],
        *(backend.get_instance(i["InstanceId"]) for i in made),
        backend.get_security_group_from_id(untagged["GroupId"]),
    ]
    for resource in resources:
        assert quick(resource) == quick.scan(resource)
    assert [t["key"] for t in quick(resources[0])] == ["k*", "moto-server-test"]
    assert quick(resources[-1]) == []

    # and through the server, a tag filter finds just the instances that carry it
    found = ec2.describe_instances(Filters=[{"Name": "tag:moto-server-test", "Values": ["q1"]}])
    ids = {i["InstanceId"] for r in found["Reservations"] for i in r["Instances"]}
    assert ids == {i["InstanceId"] for i in made}
    ec2.terminate_instances(InstanceIds=list(ids))
    ec2.delete_security_group(GroupId=untagged["GroupId"])
    ec2.delete_vpc(VpcId=vpc)


def test_amazon_amis_are_listed_once_a_region(moto_endpoint):
    listed = boto3.client("ec2", region_name=REGION).describe_images(Owners=["amazon"])["Images"]
    assert amazon_amis(REGION) == tuple(i["ImageId"] for i in listed[:8])
    assert amazon_ami(REGION, 1) == listed[1]["ImageId"]
