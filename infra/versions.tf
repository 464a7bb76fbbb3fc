# The foundation of one region: network, the cluster security group, the node role and an optional
# bucket. Long-lived: instances come and go (boto3), this stays. Security rules and policy
# documents live as data files under rules/ and policies/, read here and by the boto3 foundation.
terraform {
  required_version = ">= 1.9"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
  }

  # State goes to a per-cluster directory: sparknet's runner passes
  # `-backend-config=path=<cluster state dir>/terraform.tfstate` at init. To keep state elsewhere,
  # put another backend in backend_override.tf and give its settings as backend_config.
  backend "local" {}
}

provider "aws" {
  region = var.region

  # every resource carries both tags: `sparknet cluster down` and the orphan sweep find them by
  # tag; and its maker's, when known: `sweep` touches only its caller's own
  default_tags {
    tags = merge(
      {
        "sparknet:cluster" = var.cluster
        "sparknet:role"    = "foundation"
      },
      var.owner == null ? {} : { "sparknet:owner" = var.owner },
    )
  }
}
