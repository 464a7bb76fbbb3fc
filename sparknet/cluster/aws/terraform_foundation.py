"""The Terraform foundation: the module in `infra/` applied and destroyed for a cluster.

Its outputs are read back as the same `Foundation` the boto3 backend returns.

Separate from `boto3_foundation.py` so that the Terraform runner and its state stay out of the
path of users without Terraform; the bucket (kept out of a cluster's state) and the sweep after
a destroy still go through boto3.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sparknet.cluster.aws import instances
from sparknet.cluster.aws.boto3_foundation import Boto3Foundation
from sparknet.cluster.aws.boto3_teardown import destroy_boto3, still_there
from sparknet.cluster.aws.foundation import Foundation, check_spec_prefixes, subnet_zones
from sparknet.cluster.aws.terraform import TerraformRunner
from sparknet.cluster.spec import INFRA_DIR, ClusterSpec
from sparknet.errors import SparknetError

#: where `foundation: terraform` takes providers from instead of the registry (init -plugin-dir)
PLUGIN_DIR_ENV = "SPARKNET_TF_PLUGIN_DIR"


def terraform_variables(spec: ClusterSpec, allowed_cidr: str) -> dict[str, Any]:
    """The `infra/` module's inputs for `spec`."""
    check_spec_prefixes(spec)
    if spec.bucket is None:
        raise SparknetError(
            f"cluster {spec.name}: foundation terraform needs `bucket` (the data and runs bucket)"
        )
    out: dict[str, Any] = {
        "cluster": spec.name, "region": spec.region, "allowed_cidr": allowed_cidr,
        "bucket": spec.bucket, "data_prefix": spec.data_prefix, "runs_prefix": spec.runs_prefix,
    }  # fmt: skip
    if spec.availability_zones:
        out["availability_zones"] = list(spec.availability_zones)
    if spec.vpc_id:
        out.update(vpc_id=spec.vpc_id, subnet_ids=list(spec.subnet_ids))
    if spec.owner:
        out["owner"] = spec.owner
    return out


def _runner(spec: ClusterSpec, state_dir: Path, module_dir: Path) -> TerraformRunner:
    """The cluster's Terraform runner; providers from `$SPARKNET_TF_PLUGIN_DIR` when set (a
    machine without the registry), else the registry through the plugin cache."""
    return TerraformRunner(
        module_dir, state_dir, backend_config=spec.terraform_backend,
        plugin_dir=os.environ.get(PLUGIN_DIR_ENV) or None,
    )  # fmt: skip


def ensure_terraform(
    spec: ClusterSpec,
    *,
    allowed_cidr: str,
    state_dir: Path,
    endpoint_url: str | None = None,
    module_dir: Path = INFRA_DIR,
) -> Foundation:
    """Apply `infra/` for `spec` (state in `state_dir`) and read the foundation from its outputs."""
    runner = _runner(spec, state_dir, module_dir)
    runner.init()
    runner.apply(terraform_variables(spec, allowed_cidr))
    out = runner.output()
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    # the bucket outlives clusters, so it is not in a cluster's state: made and held to
    # infra/rules/bucket.json here, as the boto3 foundation does (infra/bucket.tf makes the same
    # bucket with create_bucket = true, for use by hand)
    made: list[str] = []
    if spec.bucket is not None:
        Boto3Foundation(spec, endpoint_url, made).bucket(spec.bucket)
    return Foundation(
        vpc_id=out["vpc_id"],
        subnet_by_az=subnet_zones(ec2, spec, list(out["subnet_ids"])),
        security_group_id=out["security_group_id"],
        instance_profile_name=out["instance_profile_name"],
        instance_profile_arn=out["instance_profile_arn"],
        role_name=out["instance_profile_name"],
        bucket=out.get("bucket"),
        created=tuple(made),
    )


#: the Terraform resource types of infra/ that `destroy` reports, as the kinds `destroy_boto3`
#: names; each one's ``id`` is what boto3 calls it by (IAM: the name). The bucket is absent: it
#: is kept
TERRAFORM_KINDS = {
    "aws_iam_instance_profile": "instance-profile", "aws_iam_role": "iam-role",
    "aws_vpc_endpoint": "vpc-endpoint", "aws_security_group": "security-group",
    "aws_route_table": "route-table", "aws_subnet": "subnet",
    "aws_internet_gateway": "internet-gateway", "aws_vpc": "vpc",
}  # fmt: skip


def destroy_terraform(
    spec: ClusterSpec,
    *,
    state_dir: Path,
    module_dir: Path = INFRA_DIR,
    endpoint_url: str | None = None,
) -> list[str]:
    """`terraform destroy` of the cluster's state, then by tag (`destroy_boto3`) whatever of the
    cluster is still there in its region: what an interrupted apply made but never recorded, or
    what a boto3 `up` of the same name added. Returns "kind:id" of each resource that is gone
    now and was not before, never the bucket (kept) or an output's name.

    Raises `SparknetError` naming what is still tagged with the cluster afterwards, so nobody
    reports "removed" while something is left.
    """
    runner = _runner(spec, state_dir, module_dir)
    runner.init()
    recorded = [
        f"{TERRAFORM_KINDS[kind]}:{values['id']}"
        for kind, values in runner.resources()
        if kind in TERRAFORM_KINDS and values.get("id")
    ]
    # destroy only checks the inputs; a placeholder SSH source passes the module's validation
    runner.destroy(terraform_variables(spec, "127.0.0.1/32"))
    swept = destroy_boto3(spec, endpoint_url=endpoint_url)  # raises if anything is left
    f = Boto3Foundation(spec, endpoint_url)
    gone = [item for item in recorded if not still_there(f, item)]
    return gone + [item for item in swept if item not in gone]
