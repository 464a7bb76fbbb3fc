"""Where a cluster's image comes from.

The region's newest baked AMI (recorded in SSM by `sparknet ami bake`, else found by its tag),
the spec's own, or the Deep Learning AMI's public parameter."""

from __future__ import annotations

import re
from typing import Any

import botocore.exceptions as bx

from sparknet import aws
from sparknet.cluster.aws import preflight
from sparknet.cluster.spec import DEFAULT_AMI_PARAMETER, TAG_ROLE, ClusterSpec
from sparknet.errors import InputError

#: the SSM parameter that holds the id of the newest baked AMI of a region
RECORD_PARAMETER = "/sparknet/ami/latest"
#: the `sparknet:role` of a baked image
ROLE_AMI = "ami"


def record(ssm: Any, image_id: str, parameter: str = RECORD_PARAMETER) -> None:
    """Record `image_id` as the region's newest baked AMI."""
    check_parameter_name(parameter)
    with aws.aws_call("PutParameter", aws.region_of(ssm)):
        ssm.put_parameter(
            Name=parameter,
            Value=image_id,
            Type="String",
            Overwrite=True,
            Description="the newest AMI `sparknet ami bake` made",
        )


def check_parameter_name(name: str) -> str:
    """`name`, if SSM accepts it (1-2048 of a-zA-Z0-9_.-/, not beginning with aws or ssm, which
    AWS reserves; moto refuses only aws); a one-line error otherwise."""
    bare = name.lstrip("/").lower()
    if (
        not re.fullmatch(r"[A-Za-z0-9_./-]{1,2048}", name)
        or bare.startswith(("aws", "ssm"))
        or ("/" in name and not name.startswith("/"))
    ):
        raise InputError(
            f"SSM parameter name {name!r}: use a-z A-Z 0-9 _ . - /, a leading / for a path, "
            "and no aws or ssm at its start"
        )
    return name


def baked_ami(ec2: Any, ssm: Any, parameter: str = RECORD_PARAMETER) -> str | None:
    """The region's newest baked AMI that is still available: the recorded one, else (no
    record, or its image deregistered) the newest of the caller's images tagged
    `sparknet:role=ami`; None when there is none."""
    region = aws.region_of(ssm)
    recorded = None
    try:
        recorded = str(ssm.get_parameter(Name=parameter)["Parameter"]["Value"])
    except bx.ClientError as exc:
        if aws.error_code(exc) != "ParameterNotFound":
            raise aws.describe_error(exc, f"reading SSM parameter {parameter} in {region}") from exc
    except bx.BotoCoreError as exc:
        raise aws.describe_error(exc, f"reading SSM parameter {parameter} in {region}") from exc
    with aws.aws_call("DescribeImages", region):
        if recorded and preflight.AMI_ID.fullmatch(recorded):
            found = ec2.describe_images(Filters=[{"Name": "image-id", "Values": [recorded]}])[
                "Images"
            ]
            if any(i.get("State") == "available" for i in found):
                return recorded
        found = ec2.describe_images(
            Owners=["self"],
            Filters=[
                {"Name": f"tag:{TAG_ROLE}", "Values": [ROLE_AMI]},
                {"Name": "state", "Values": ["available"]},
            ],
        )["Images"]
    newest = max(found, key=lambda i: i.get("CreationDate", ""), default=None)
    return str(newest["ImageId"]) if newest else None


def ami_for(spec: ClusterSpec, ec2: Any, ssm: Any, parameter: str = RECORD_PARAMETER) -> str:
    """The AMI `cluster up` launches: the spec's `ami`, else its own `ami_parameter` when the
    user set one, else the region's baked AMI (`baked_ami`), else the default parameter's Deep
    Learning AMI. A cluster from a baked AMI finds the install steps done."""
    if spec.ami or spec.ami_parameter != DEFAULT_AMI_PARAMETER:
        return preflight.resolve_ami(spec, ssm)
    return baked_ami(ec2, ssm, parameter) or preflight.resolve_ami(spec, ssm)
