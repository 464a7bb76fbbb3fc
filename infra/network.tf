# Public subnets in availability_zones (or the region's first az_count zones), or the user's own
# VPC and subnets (vpc_id + subnet_ids), in which case no network resource is made here. The
# defaults (VPC range, subnet size, zone count and type) are rules/network.json, which the boto3
# foundation reads too.

locals {
  network        = jsondecode(file("${path.module}/rules/network.json"))
  create_network = var.vpc_id == null
  vpc_cidr       = coalesce(var.vpc_cidr, local.network.vpc_cidr)
  az_count       = coalesce(var.az_count, local.network.az_count)
  zone_names     = sort(data.aws_availability_zones.available.names)
  # zone names sort alphabetically and new zones get later letters, so the first az_count stay put
  azs        = length(var.availability_zones) > 0 ? var.availability_zones : slice(local.zone_names, 0, min(local.az_count, length(local.zone_names)))
  vpc_id     = local.create_network ? aws_vpc.this[0].id : var.vpc_id
  subnet_ids = local.create_network ? aws_subnet.public[*].id : var.subnet_ids
}

data "aws_availability_zones" "available" {
  #checkov:skip=CKV_AWS_394:zones are pinned by var.availability_zones when given; otherwise only the first az_count names are used, which a new zone does not change
  state = "available"

  # regular zones only: local and wavelength zones lack most GPU instance types
  filter {
    name   = "zone-type"
    values = [local.network.zone_type]
  }
}

resource "aws_vpc" "this" {
  #checkov:skip=CKV2_AWS_11:flow logs cost per GB and need a log destination the user picks; enable them account-wide where wanted
  count = local.create_network ? 1 : 0

  cidr_block           = local.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = {
    Name = "sparknet-${var.cluster}"
  }

  lifecycle {
    precondition {
      condition     = length(var.availability_zones) > 0 || length(local.zone_names) >= 2
      error_message = "this region has fewer than 2 availability zones; the cluster needs 2."
    }
    precondition {
      condition     = alltrue([for az in var.availability_zones : contains(local.zone_names, az)])
      error_message = "availability_zones names a zone that is not available in this region."
    }
  }
}

# The VPC's default security group: no rules, so nothing launched without a group is reachable.
resource "aws_default_security_group" "this" {
  count = local.create_network ? 1 : 0

  vpc_id = aws_vpc.this[0].id
}

resource "aws_internet_gateway" "this" {
  count = local.create_network ? 1 : 0

  vpc_id = aws_vpc.this[0].id

  tags = {
    Name = "sparknet-${var.cluster}"
  }
}

resource "aws_subnet" "public" {
  count = local.create_network ? length(local.azs) : 0

  vpc_id            = aws_vpc.this[0].id
  availability_zone = local.azs[count.index]
  cidr_block        = cidrsubnet(local.vpc_cidr, local.network.subnet_prefix - tonumber(split("/", local.vpc_cidr)[1]), count.index)
  # No public address by default: sparknet asks for one per instance (AssociatePublicIpAddress)
  # because user-given subnets may not assign one either.
  map_public_ip_on_launch = false

  tags = {
    Name = "sparknet-${var.cluster}-${local.azs[count.index]}"
  }
}

resource "aws_route_table" "public" {
  count = local.create_network ? 1 : 0

  vpc_id = aws_vpc.this[0].id

  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this[0].id
  }

  tags = {
    Name = "sparknet-${var.cluster}"
  }
}

# S3 traffic of the nodes stays inside AWS instead of going out through the internet gateway (a
# gateway endpoint is free)
resource "aws_vpc_endpoint" "s3" {
  count = local.create_network ? 1 : 0

  vpc_id            = aws_vpc.this[0].id
  service_name      = "com.amazonaws.${var.region}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.public[0].id]

  tags = {
    Name = "sparknet-${var.cluster}-s3"
  }
}

resource "aws_route_table_association" "public" {
  count = local.create_network ? length(local.azs) : 0

  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public[0].id
}
