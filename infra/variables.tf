variable "cluster" {
  description = "Cluster name, unique per account and region (the same pattern as ClusterSpec.name)."
  type        = string

  validation {
    condition     = can(regex("^[a-z](?:-?[a-z0-9])+$", var.cluster)) && length(var.cluster) >= 2 && length(var.cluster) <= 31
    error_message = "cluster must be 2-31 of a-z, 0-9 and single hyphens, a letter first and no hyphen last (^[a-z](?:-?[a-z0-9])+$)."
  }
}

variable "region" {
  description = "AWS region of the foundation, e.g. us-east-1."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-[0-9]+$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "allowed_cidr" {
  description = "The only IPv4 source allowed to SSH in, e.g. the operator's 203.0.113.7/32; /16 or narrower."
  type        = string

  validation {
    condition     = can(cidrhost(var.allowed_cidr, 0)) && can(cidrnetmask(var.allowed_cidr)) ? tonumber(split("/", var.allowed_cidr)[1]) >= 16 : false
    error_message = "allowed_cidr must be an IPv4 CIDR of /16 or narrower, such as your own 203.0.113.7/32 (a wider one opens SSH to a large part of the internet; the network has no IPv6)."
  }
}

variable "az_count" {
  description = "At most how many availability zones get a public subnet (when no vpc_id is given); default: az_count of rules/network.json."
  type        = number
  default     = null

  validation {
    condition     = var.az_count == null ? true : var.az_count >= 2 && var.az_count <= 6 && floor(var.az_count) == var.az_count
    error_message = "az_count must be a whole number from 2 to 6."
  }
}

variable "availability_zones" {
  description = "Zones for the subnets made here, e.g. [\"us-east-1a\", \"us-east-1b\"]; default: the first az_count of the region."
  type        = list(string)
  default     = []
  nullable    = false

  validation {
    condition     = length(var.availability_zones) != 1 && alltrue([for az in var.availability_zones : can(regex("^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-[0-9]+[a-z]$", az))])
    error_message = "availability_zones must be empty or two or more zone names such as us-east-1a."
  }
}

variable "vpc_cidr" {
  description = "IPv4 range of the VPC made here (ignored with vpc_id); each subnet gets a /24 of it. Default: vpc_cidr of rules/network.json."
  type        = string
  default     = null

  validation {
    condition     = var.vpc_cidr == null ? true : can(cidrhost(var.vpc_cidr, 0)) && can(cidrnetmask(var.vpc_cidr)) ? tonumber(split("/", var.vpc_cidr)[1]) >= 16 && tonumber(split("/", var.vpc_cidr)[1]) <= 21 : false
    error_message = "vpc_cidr must be an IPv4 CIDR from /16 to /21, such as 10.42.0.0/16."
  }
}

variable "vpc_id" {
  description = "An existing VPC to use instead of making one; needs subnet_ids too."
  type        = string
  default     = null

  validation {
    condition     = var.vpc_id == null ? true : can(regex("^vpc-[0-9a-f]{8,17}$", var.vpc_id))
    error_message = "vpc_id must be a VPC id such as vpc-0123456789abcdef0."
  }
}

variable "subnet_ids" {
  description = "Existing subnets of vpc_id (one per availability zone) for the cluster's instances."
  type        = list(string)
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for id in var.subnet_ids : can(regex("^subnet-[0-9a-f]{8,17}$", id))])
    error_message = "subnet_ids must be subnet ids such as subnet-0123456789abcdef0."
  }
}

variable "bucket" {
  description = "The S3 bucket holding datasets (data_prefix) and runs (runs_prefix)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket)) && !can(regex("\\.\\.|\\.-|-\\.|^\\d+\\.\\d+\\.\\d+\\.\\d+$|^(xn--|sthree-|amzn-s3-demo-)|(-s3alias|--ol-s3|\\.mrap|--x-s3|--table-s3)$", var.bucket))
    error_message = "bucket must be an S3 bucket name: 3-63 of a-z, 0-9, '.', '-', starting and ending with a letter or digit, no '..', '.-' or '-.', not an IP address, none of S3's reserved prefixes (xn--, sthree-, amzn-s3-demo-) or suffixes (-s3alias, --ol-s3, .mrap, --x-s3, --table-s3)."
  }
}

variable "create_bucket" {
  description = "Make the bucket here (encrypted, versioned, private); false: it already exists."
  type        = bool
  default     = false
  nullable    = false
}

variable "data_prefix" {
  description = "Key prefix of the datasets in the bucket; nodes may only read under it."
  type        = string
  default     = "datasets/"
  nullable    = false

  validation {
    condition     = length(var.data_prefix) <= 256 && can(regex("^([A-Za-z0-9][A-Za-z0-9._-]*/)+$", var.data_prefix))
    error_message = "data_prefix must be a key prefix such as datasets/: at most 256 characters, parts of letters, digits, '.', '_' and '-' that each start with a letter or digit and end with / (not empty, no leading /, no . or .. parts, no wildcards)."
  }
}

variable "runs_prefix" {
  description = "Key prefix of the run outputs in the bucket; nodes may read and write under it."
  type        = string
  default     = "runs/"
  nullable    = false

  validation {
    condition     = length(var.runs_prefix) <= 256 && can(regex("^([A-Za-z0-9][A-Za-z0-9._-]*/)+$", var.runs_prefix))
    error_message = "runs_prefix must be a key prefix such as runs/: at most 256 characters, parts of letters, digits, '.', '_' and '-' that each start with a letter or digit and end with / (not empty, no leading /, no . or .. parts, no wildcards)."
  }

  # sparknet.cluster.spec.check_prefixes applies the same rule before either foundation runs
  validation {
    condition     = !startswith(var.runs_prefix, var.data_prefix) && !startswith(var.data_prefix, var.runs_prefix)
    error_message = "data_prefix and runs_prefix must not overlap: neither may equal the other or start with it (nodes read everything under data_prefix and write under runs_prefix)."
  }
}

variable "owner" {
  description = "Who made the foundation (sparknet passes the caller's STS ARN): tagged sparknet:owner on every resource, so `sweep` touches only its caller's own; null: no owner tag."
  type        = string
  default     = null

  validation {
    condition     = var.owner == null ? true : can(regex("^[\\p{L}\\p{Z}\\p{N}_.:/=+@-]{1,256}$", var.owner))
    error_message = "owner must be a tag value: 1-256 letters, digits, spaces and _ . : / = + - @ (an ARN such as arn:aws:iam::123456789012:user/alice)."
  }
}
