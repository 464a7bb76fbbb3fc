"""What the suite's moto server costs, kept down: its EC2 tag lookup, and one AMI list a process.

Why: each test process runs one moto server for the whole run (conftest's `moto_endpoint`),
and it keeps what every test made: thousands of tags by the end. moto 5 finds a resource's
tags by scanning every tag in the region with a regular expression (`TagBackend.describe_tags`
with a `resource-id` filter), once for each resource it describes or filters by tag, so a
`DescribeInstances` got slower with every test before it: the cluster modules spent a quarter
of their CPU there (tests/cluster/test_lifecycle*.py and test_cluster_probe.py: 251 -> 188
CPU-s in one process). And moto's 1,301 Amazon AMIs took 0.6 CPU-s to list and parse each
time a fixture wanted one image id.
"""

from __future__ import annotations

import functools
import os
from typing import Any

#: what makes an EC2 filter value a pattern (fnmatch's) rather than a literal id
_PATTERN = frozenset("*?[")


def quicken_tag_lookup() -> None:
    """Give moto's `TaggedEC2Resource.get_tags` a dict lookup of the resource's own tags.

    The answer is the one moto's own gives: its `describe_tags(filters={"resource-id": [id]})`
    matches the id's fnmatch pattern, which for an id without `*?[` (every EC2 id) is the id
    itself, and lists that resource's tags in their order, each with its resource type.
    tests/test_moto_server.py checks the two agree on a live backend."""
    from moto.ec2.models.core import TaggedEC2Resource
    from moto.ec2.utils import EC2_PREFIX_TO_RESOURCE, get_prefix

    if getattr(TaggedEC2Resource.get_tags, "quick", False):
        return
    scan = TaggedEC2Resource.get_tags

    def get_tags(self: Any) -> list[dict[str, str]]:
        rid = self.id
        if not rid or _PATTERN & set(rid):
            return scan(self)
        kind = EC2_PREFIX_TO_RESOURCE.get(get_prefix(rid), "")
        own = dict(self.ec2_backend.tags.get(rid, {}))  # .get: the tags are a defaultdict
        return [
            {"resource_id": rid, "key": k, "value": v, "resource_type": kind}
            for k, v in own.items()
        ]

    get_tags.quick = True  # type: ignore[attr-defined]
    get_tags.scan = scan  # type: ignore[attr-defined]
    TaggedEC2Resource.get_tags = get_tags


@functools.cache
def _amazon_amis(endpoint: str, region: str) -> tuple[str, ...]:
    import boto3

    ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint)
    return tuple(i["ImageId"] for i in ec2.describe_images(Owners=["amazon"])["Images"][:8])


def amazon_amis(region: str = "us-east-1") -> tuple[str, ...]:
    """The first Amazon AMIs of the moto server this process talks to (AWS_ENDPOINT_URL) in
    `region`, in moto's order: listed once a process and region."""
    return _amazon_amis(os.environ["AWS_ENDPOINT_URL"], region)


def amazon_ami(region: str = "us-east-1", index: int = 0) -> str:
    """One of `amazon_amis`: the first, or with `index` another."""
    return amazon_amis(region)[index]
