# A provider-free stand-in for infra/ with the same inputs and outputs: the AWS provider cannot
# be downloaded here, so the foundation's Terraform path runs for real against this module. It
# takes an existing network (vpc_id, subnet_ids, made in moto by the test) and makes up the rest.
terraform {
  required_version = ">= 1.5"

  backend "local" {}
}

variable "cluster" {
  type = string
}

variable "region" {
  type = string
}

variable "allowed_cidr" {
  type = string

  validation {
    condition     = can(cidrhost(var.allowed_cidr, 0)) && !endswith(var.allowed_cidr, "/0")
    error_message = "allowed_cidr must be a CIDR block and not open to the internet."
  }
}

variable "bucket" {
  type = string
}

variable "data_prefix" {
  type = string
}

variable "runs_prefix" {
  type = string
}

variable "availability_zones" {
  type    = list(string)
  default = []
}

variable "vpc_id" {
  type = string
}

variable "subnet_ids" {
  type = list(string)
}

variable "owner" {
  type    = string
  default = null
}

resource "terraform_data" "profile" {
  input = "sparknet-${var.cluster}-${var.region}"
}

output "vpc_id" {
  value = var.vpc_id
}

output "subnet_ids" {
  value = var.subnet_ids
}

output "security_group_id" {
  value = "sg-standin"
}

output "instance_profile_name" {
  value = terraform_data.profile.output
}

output "instance_profile_arn" {
  value = "arn:aws:iam::123456789012:instance-profile/${terraform_data.profile.output}"
}

output "role_arn" {
  value = "arn:aws:iam::123456789012:role/${terraform_data.profile.output}"
}

output "bucket" {
  value = var.bucket
}
