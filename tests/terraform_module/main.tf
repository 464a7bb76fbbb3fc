# A provider-free stand-in for infra/: terraform_data resources only, so the runner's init / apply /
# output / destroy run for real and offline. Same shape as infra/: a local backend whose path the
# runner sets at init, a validated cluster variable, and outputs read through `output -json`.
terraform {
  required_version = ">= 1.5"

  backend "local" {}
}

variable "cluster" {
  description = "Cluster name (the same pattern as ClusterSpec.name)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.cluster))
    error_message = "cluster must match ^[a-z][a-z0-9-]{1,30}$."
  }
}

variable "subnet_count" {
  description = "How many stand-in subnets."
  type        = number
  default     = 2

  validation {
    condition     = var.subnet_count >= 1 && var.subnet_count <= 6
    error_message = "subnet_count must be from 1 to 6."
  }
}

resource "terraform_data" "vpc" {
  input = "vpc-${var.cluster}"
}

resource "terraform_data" "subnet" {
  count = var.subnet_count
  input = "${terraform_data.vpc.output}-subnet-${count.index}"
}

output "vpc_id" {
  value = terraform_data.vpc.output
}

output "subnet_ids" {
  value = terraform_data.subnet[*].output
}

output "tags" {
  value = { "sparknet:cluster" = var.cluster, "sparknet:role" = "foundation" }
}
