"""Who is calling AWS, as the `sparknet:owner` tag value every resource of a cluster carries.

In a shared account a cluster's name is no proof of whose it is."""

from __future__ import annotations

from sparknet import aws
from sparknet.cluster.spec import tag_value


def caller_owner(region: str, endpoint_url: str | None = None) -> str:
    """The calling principal (STS GetCallerIdentity's ARN) as an owner tag value (`tag_value`:
    a role session name may hold a comma, which IAM refuses in tags); `sweep` compares owners
    in the same form."""
    sts = aws.client("sts", region, endpoint_url)
    with aws.aws_call("GetCallerIdentity", region):
        return tag_value(str(sts.get_caller_identity()["Arn"]))
