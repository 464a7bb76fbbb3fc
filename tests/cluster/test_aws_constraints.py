"""Every name, description and tag value that sparknet or infra/ sends to AWS, checked against
AWS's documented constraints. moto checks almost none of them (an apostrophe in a rule
description passes moto and fails at the AWS provider's plan), so they are checked here, for the
longest cluster name and region sparknet accepts.

Sources (AWS API references):
- EC2 CreateSecurityGroup GroupName / GroupDescription: up to 255 characters of a-z A-Z 0-9,
  spaces and ``._-:/()#,@[]+=&;{}!$*``; a name may not start with ``sg-``.
- EC2 IpRange / UserIdGroupPair Description (a rule's description): up to 255 characters of
  a-z A-Z 0-9, spaces and ``._-:/()#,@[]+=;{}!$*`` (IpRange also allows ``&``; the pair does not).
- IAM CreateRole RoleName ``[\\w+=,.@-]+`` 1-64; Description up to 1000 of
  ``[\\u0009\\u000A\\u000D\\u0020-\\u007E\\u00A1-\\u00FF]``; CreateInstanceProfile and PutRolePolicy
  names ``[\\w+=,.@-]+`` 1-128.
- Tags (IAM Tag, S3 Tag; EC2 allows more): key 1-128 and value 0-256 of
  ``[\\p{L}\\p{Z}\\p{N}_.:/=+\\-@]``; a key may not start with ``aws:``.
- S3 bucket names: 3-63 of a-z 0-9 . -, letter or digit at both ends, not an IP address, no
  ``xn--``/``sthree-`` prefix or ``-s3alias``/``--ol-s3`` suffix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import hcl2
import pytest

from sparknet import aws
from sparknet.cluster.aws import boto3_foundation, foundation, instances
from sparknet.cluster.aws.foundation import (
    NODE_POLICY,
    node_role_description,
    node_role_name,
    security_group_description,
    security_group_name,
)
from sparknet.cluster.aws.rules import security_group_rules
from sparknet.cluster.spec import INFRA_DIR, ClusterSpec, check_bucket_name, tag_value

#: a rule's description: the UserIdGroupPair set (no `&`), which the IpRange set contains
RULE_DESCRIPTION = re.compile(r"^[0-9A-Za-z_ .:/()#,@\[\]+=;{}!$*-]{0,255}$")
GROUP_TEXT = re.compile(r"^[0-9A-Za-z_ .:/()#,@\[\]+=&;{}!$*-]{1,255}$")
IAM_NAME = re.compile(r"^[\w+=,.@-]+$", re.ASCII)
IAM_DESCRIPTION = re.compile(r"^[\u0009\u000a\u000d\u0020-\u007e\u00a1-\u00ff]{0,1000}$")
#: tag characters, ASCII part of [\p{L}\p{Z}\p{N}_.:/=+\-@] (stricter, never looser)
TAG_KEY = re.compile(r"^(?!aws:)[A-Za-z0-9 _.:/=+\-@]{1,128}$")
TAG_VALUE = re.compile(r"^[A-Za-z0-9 _.:/=+\-@]{0,256}$")

LONGEST_NAME = "a" + "-b" * 15  # 31 characters: the most ClusterSpec.name allows
OWNER = "arn:aws:sts::123456789012:assumed-role/AWSReservedSSO_Admin_0123456789abcdef/a@b.example"


def longest_region() -> str:
    return max(aws.known_regions(), key=len)


@pytest.fixture(scope="module")
def spec() -> ClusterSpec:
    return ClusterSpec(name=LONGEST_NAME, region=longest_region(), bucket="b" * 63, owner=OWNER)


def test_the_longest_cluster_name_is_the_longest_allowed() -> None:
    with pytest.raises(ValueError):
        ClusterSpec(name=LONGEST_NAME + "c")
    assert len(LONGEST_NAME) == 31


#: SSH sources the spec accepts, from the narrowest to the widest (/16)
ALLOWED_SOURCES = ("203.0.113.7/32", "198.51.100.0/24", "10.200.0.0/16")


@pytest.mark.parametrize("source", ALLOWED_SOURCES)
def test_security_group_rule_descriptions(source: str) -> None:
    """Each rule as it is sent (`permissions`, for the longest and the widest sources the spec
    allows) has a description AWS accepts."""
    sent = [
        pair["Description"]
        for direction in ("ingress", "egress")
        for perm in boto3_foundation.permissions(direction, "sg-0123456789abcdef0", source)
        for pair in perm.get("IpRanges", []) + perm.get("UserIdGroupPairs", [])
    ]
    assert len(sent) == len(security_group_rules())
    bad = [d for d in sent if not RULE_DESCRIPTION.match(d)]
    assert not bad, f"AWS refuses these rule descriptions: {bad}"


@pytest.mark.parametrize("source", ALLOWED_SOURCES)
def test_the_ssh_rule_description_is_true_for_any_allowed_source(source: str) -> None:
    """It names the source it opens to (issue 9 probe 14e: "the operator address only" was
    false for a /16), and claims nothing about who is behind it."""
    (ssh,) = [
        p for p in boto3_foundation.permissions("ingress", "sg-1", source) if p.get("FromPort")
    ]
    (opened,) = ssh["IpRanges"]
    assert opened["CidrIp"] == source and source in opened["Description"]
    assert "operator" not in opened["Description"] and "address" not in opened["Description"]


def test_security_group_name_and_description(spec) -> None:
    name, description = security_group_name(spec), security_group_description(spec)
    assert GROUP_TEXT.match(name) and not name.startswith("sg-"), name
    assert GROUP_TEXT.match(description), description


def test_iam_names_and_description(spec) -> None:
    role = node_role_name(spec)
    assert IAM_NAME.match(role) and len(role) <= 64, role  # the instance profile has this name
    assert IAM_NAME.match(NODE_POLICY) and len(NODE_POLICY) <= 128
    assert IAM_DESCRIPTION.match(node_role_description(spec))


def foundation_tags(spec: ClusterSpec) -> list[dict[str, str]]:
    """Every tag set the boto3 foundation and the instances send, with the longest names."""
    names = [f"sparknet-{spec.name}", f"sparknet-{spec.name}-{spec.region}a"]
    sets = [foundation.tags(spec), *(foundation.tags(spec, n) for n in names)]
    sets += [instances.role_tags(spec, role) for role in ("master", "worker")]
    return [tag for tags in sets for tag in tags]


def test_tag_keys_and_values(spec) -> None:
    tags = foundation_tags(spec)
    assert {"Key": "sparknet:owner", "Value": OWNER} in tags
    bad = [t for t in tags if not (TAG_KEY.match(t["Key"]) and TAG_VALUE.match(t["Value"]))]
    assert not bad, f"AWS refuses these tags: {bad}"


@pytest.mark.parametrize(
    ("arn", "tag"),
    [
        ("arn:aws:iam::123456789012:user/alice", "arn:aws:iam::123456789012:user/alice"),
        ("arn:aws:sts::1:assumed-role/r/a,b", "arn:aws:sts::1:assumed-role/r/a_b"),
        ("arn:aws:iam::1:user/" + "x" * 300, ("arn:aws:iam::1:user/" + "x" * 300)[:256]),
    ],
)
def test_owner_is_made_a_valid_tag_value(arn: str, tag: str) -> None:
    assert tag_value(arn) == tag and TAG_VALUE.match(tag)
    assert ClusterSpec(name="demo", owner=arn).owner == tag


@pytest.mark.parametrize(
    "bucket",
    ["ab", "A-bucket", "a_b", "a..b", "a.-b", "-ab", "ab-", "192.168.1.1", "xn--ab", "ab-s3alias",
     "sthree-ab", "ab--ol-s3", "b" * 64],
)  # fmt: skip
def test_bucket_names_aws_refuses_are_refused(bucket: str) -> None:
    with pytest.raises(ValueError, match="is not an S3 bucket name"):
        check_bucket_name(bucket)
    with pytest.raises(ValueError):
        ClusterSpec(name="demo", bucket=bucket)


def test_bucket_names_the_code_makes_are_valid(spec) -> None:
    # the longest user bucket (a cluster without one gets no S3 statement, not a stand-in)
    for name in ("b" * 63, "my.data-1"):
        assert check_bucket_name(name) == name


# -- infra/: the same names, as Terraform renders them ----------------------------------------


@pytest.fixture(scope="module")
def resources() -> dict[str, dict[str, Any]]:
    """`type.name` -> body of every resource in infra/*.tf."""
    options = hcl2.SerializationOptions(
        with_comments=False, explicit_blocks=False, strip_string_quotes=True
    )
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(INFRA_DIR).glob("*.tf")):
        with path.open() as f:
            for block in hcl2.load(f, serialization_options=options).get("resource", []):
                for type_, named in block.items():
                    for name, body in named.items():
                        out[f"{type_}.{name}"] = body
    return out


def render(text: str, spec: ClusterSpec) -> str:
    """A Terraform string with the variables it may hold filled in (longest values)."""
    values = {
        "var.cluster": spec.name,
        "var.region": spec.region,
        "local.azs[count.index]": f"{spec.region}a",
    }
    out = text
    for ref, value in values.items():
        out = out.replace("${" + ref + "}", value)
    assert "${" not in out, f"unrendered reference in {text!r}"
    return out


def test_infra_security_group_name_and_description(resources, spec) -> None:
    group = resources["aws_security_group.cluster"]
    name, description = render(group["name"], spec), render(group["description"], spec)
    assert name == security_group_name(spec) and description == security_group_description(spec)
    assert GROUP_TEXT.match(name) and GROUP_TEXT.match(description)


def test_infra_iam_names_and_description(resources, spec) -> None:
    role = resources["aws_iam_role.node"]
    assert render(role["name"], spec) == node_role_name(spec)
    assert render(role["description"], spec) == node_role_description(spec)
    assert resources["aws_iam_role_policy.node"]["name"] == NODE_POLICY
    assert resources["aws_iam_instance_profile.node"]["name"] == "${aws_iam_role.node.name}"


def test_infra_name_tags(resources, spec) -> None:
    names = [render(body["tags"]["Name"], spec) for body in resources.values() if "tags" in body]
    assert len(names) >= 5  # vpc, subnets, gateway, route table, S3 endpoint
    bad = [n for n in names if not TAG_VALUE.match(n)]
    assert not bad, bad
