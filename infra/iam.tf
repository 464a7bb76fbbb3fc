# The node role: read on the data prefix, read/write on the cluster's own runs prefix
# (runs/<cluster>/), terminate only instances of its own cluster in this region and account
# (autostop). Both documents are data files shared with the boto3 foundation.

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

resource "aws_iam_role" "node" {
  name                 = "sparknet-${var.cluster}-${var.region}"
  description          = "sparknet cluster ${var.cluster} nodes in ${var.region}"
  assume_role_policy   = file("${path.module}/policies/assume-role.json")
  max_session_duration = 3600
}

resource "aws_iam_role_policy" "node" {
  name = "sparknet-node"
  role = aws_iam_role.node.id
  # ec2:DescribeInstances is in it because autostop on a node must find its cluster's instance
  # ids (by tag) before it can terminate them, and EC2 Describe* actions take no resource ARN.
  policy = templatefile("${path.module}/policies/instance-role.json.tftpl", {
    partition   = data.aws_partition.current.partition
    region      = var.region
    account     = data.aws_caller_identity.current.account_id
    bucket      = var.bucket
    data_prefix = var.data_prefix
    runs_prefix = var.runs_prefix
    cluster     = var.cluster
  })
}

resource "aws_iam_instance_profile" "node" {
  name = aws_iam_role.node.name
  role = aws_iam_role.node.name
}
