"""EC2: everything a cluster needs of AWS.

The foundation (boto3 or Terraform), instances, security rules, spot, keys, baked images and the
autostop that runs on the master."""
