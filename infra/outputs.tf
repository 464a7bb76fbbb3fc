# Read by sparknet through `terraform output -json`.

output "vpc_id" {
  description = "The cluster's VPC (made here, or the given vpc_id)."
  value       = local.vpc_id
}

output "subnet_ids" {
  description = "Subnets for the cluster's instances, one per availability zone."
  value       = local.subnet_ids
}

output "security_group_id" {
  description = "The cluster security group."
  value       = aws_security_group.cluster.id
}

output "instance_profile_name" {
  description = "Instance profile every node is launched with."
  value       = aws_iam_instance_profile.node.name
}

output "instance_profile_arn" {
  description = "ARN of that instance profile."
  value       = aws_iam_instance_profile.node.arn
}

output "role_arn" {
  description = "The node role behind the instance profile."
  value       = aws_iam_role.node.arn
}

output "bucket" {
  description = "The data and runs bucket (made here when create_bucket)."
  value       = var.create_bucket ? aws_s3_bucket.data[0].id : var.bucket
}
