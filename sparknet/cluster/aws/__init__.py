"""EC2: the foundation (boto3 or Terraform), instances, security rules, spot, keys, baked
images and the autostop that runs on the master."""
