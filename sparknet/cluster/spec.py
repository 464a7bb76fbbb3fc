"""What a cluster is: `ClusterSpec` (from `clusters:` in sparknet.yaml plus flags) and the
constants every part of `cluster/` shares (tag keys, roles, the default AMI parameter)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sparknet import aws
from sparknet.errors import SparknetError

#: every AWS resource sparknet makes carries both tags; `down` and `sweep` find resources by them
TAG_CLUSTER = "sparknet:cluster"
TAG_ROLE = "sparknet:role"
#: the principal (STS caller ARN) that made the resource: `sweep` touches only the caller's own
TAG_OWNER = "sparknet:owner"

#: the AWS Deep Learning AMI (GPU drivers, CUDA, Docker) for Ubuntu 22.04, newest release
DEFAULT_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)

#: Terraform for the foundation and the data files (security rules, IAM policy documents) that
#: Terraform and the boto3 foundation both read, so the two cannot drift apart
INFRA_DIR = Path(__file__).resolve().parents[2] / "infra"


class ClusterSpec(BaseModel):
    """One cluster: its name, where, what machines, and how the foundation is made."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{1,30}$", description="unique per account+region")
    region: str = "us-east-1"
    availability_zones: list[str] = Field(
        default_factory=list, description="fallback order; default: every AZ of the region"
    )
    workers: int = Field(2, ge=0)
    master_type: str = "g5.xlarge"
    instance_types: list[str] = Field(
        default_factory=lambda: ["g5.xlarge", "g4dn.xlarge", "g6.xlarge"],
        min_length=1,
        description="worker types in fallback order",
    )
    spot: bool = Field(False, description="workers on spot (the master is always on-demand)")
    ami: str | None = Field(None, description="an AMI id; default: from ami_parameter")
    ami_parameter: str = DEFAULT_AMI_PARAMETER
    root_volume_gb: int = Field(100, ge=8, le=16384)
    key_name: str | None = None
    allowed_cidr: str | None = Field(None, description="SSH source; default: the caller's /32")
    vpc_id: str | None = Field(None, description="an existing VPC to use (with subnet_ids)")
    subnet_ids: list[str] = Field(default_factory=list, description="its subnets, one per AZ")
    foundation: Literal["terraform", "boto3"] = "boto3"
    terraform_backend: dict[str, str] | None = Field(
        None,
        description="-backend-config settings of the backend declared in "
        "infra/backend_override.tf; default: local state under ~/.sparknet/clusters/<name>/",
    )
    bucket: str | None = Field(None, description="data and runs bucket")
    data_prefix: str = "datasets/"
    runs_prefix: str = "runs/"
    owner: str | None = Field(
        None,
        description="set by `up` from STS GetCallerIdentity (the caller's ARN) and tagged on "
        "every resource as sparknet:owner; not a user setting",
    )

    @field_validator("region")
    @classmethod
    def _known_region(cls, region: str) -> str:
        try:
            return aws.check_region(region)
        except SparknetError as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("allowed_cidr")
    @classmethod
    def _ipv4_cidr_not_everyone(cls, cidr: str | None) -> str | None:
        """As infra/variables.tf: one IPv4 network, never the whole internet."""
        if cidr is None:
            return None
        try:
            net = ipaddress.IPv4Network(cidr, strict=False)
        except ValueError as exc:
            raise ValueError(f"{cidr!r} is not an IPv4 CIDR such as 203.0.113.7/32") from exc
        if net.prefixlen == 0:
            raise ValueError("SSH may not be open to all addresses (/0); give your /32")
        return str(net)

    @model_validator(mode="after")
    def _existing_network(self) -> ClusterSpec:
        if bool(self.vpc_id) != bool(self.subnet_ids):
            raise ValueError("vpc_id and subnet_ids go together: give both or neither")
        return self
