# The cluster's security group. Its rules are data (rules/security-group.json), shared with the
# boto3 foundation: SSH from allowed_cidr only, everything between members of the group, nothing
# else in.

locals {
  sg_rules = jsondecode(file("${path.module}/rules/security-group.json"))
}

resource "aws_security_group" "cluster" {
  # Egress is all traffic to anywhere (rules/security-group.json): nodes read S3 and install
  # packages from mirrors (PyPI, apt, conda) whose addresses are not fixed, so no narrower rule
  # holds; nothing can connect in through it.
  #checkov:skip=CKV2_AWS_5:the group is attached to instances that sparknet launches with boto3, outside Terraform
  name        = "sparknet-${var.cluster}"
  description = "sparknet cluster ${var.cluster}: SSH from allowed_cidr, all traffic between members"
  vpc_id      = local.vpc_id
  # as the boto3 foundation names it (the consoles show the Name tag)
  tags = { Name = "sparknet-${var.cluster}" }

  dynamic "ingress" {
    for_each = local.sg_rules.ingress
    content {
      # the SSH rule says which source it opens to: ${allowed_cidr} in its description
      description = replace(ingress.value.description, "$${allowed_cidr}", var.allowed_cidr)
      protocol    = ingress.value.protocol
      from_port   = ingress.value.from_port
      to_port     = ingress.value.to_port
      cidr_blocks = ingress.value.source == "allowed_cidr" ? [var.allowed_cidr] : []
      self        = ingress.value.source == "self"
    }
  }

  dynamic "egress" {
    for_each = local.sg_rules.egress
    content {
      description = egress.value.description
      protocol    = egress.value.protocol
      from_port   = egress.value.from_port
      to_port     = egress.value.to_port
      cidr_blocks = egress.value.destination == "anywhere" ? ["0.0.0.0/0"] : []
    }
  }

  lifecycle {
    precondition {
      condition     = alltrue([for rule in local.sg_rules.ingress : contains(["allowed_cidr", "self"], rule.source)])
      error_message = "rules/security-group.json: an ingress rule's source must be \"allowed_cidr\" or \"self\"."
    }
    precondition {
      condition     = alltrue([for rule in local.sg_rules.egress : rule.destination == "anywhere"])
      error_message = "rules/security-group.json: an egress rule's destination must be \"anywhere\"."
    }
    precondition {
      condition     = local.create_network || length(var.subnet_ids) > 0
      error_message = "vpc_id needs subnet_ids: the subnets of that VPC the cluster's instances go in."
    }
  }
}
