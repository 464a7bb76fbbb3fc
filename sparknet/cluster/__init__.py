"""EC2 GPU clusters: the foundation (network, security group, IAM), instances, lifecycle."""
