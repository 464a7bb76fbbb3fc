# An optional bucket for datasets and runs (create_bucket = true, for use by hand; sparknet makes
# and reconciles the bucket itself, since it outlives any cluster's state): private, encrypted with
# the account's aws/s3 KMS key, TLS only, versioned; old versions and failed uploads expire. The
# settings are rules/bucket.json, which the boto3 side holds every sparknet bucket to.

locals {
  bucket_settings = jsondecode(file("${path.module}/rules/bucket.json"))
}

resource "aws_s3_bucket" "data" {
  #checkov:skip=CKV_AWS_18:access logs need a second bucket; a dataset bucket's reads are CloudTrail data events where wanted
  #checkov:skip=CKV_AWS_144:cross-region replication doubles storage of datasets that can be re-sharded from their source
  #checkov:skip=CKV2_AWS_62:nothing consumes object events; sparknet lists the runs prefix itself
  count = var.create_bucket ? 1 : 0

  bucket = var.bucket
}

resource "aws_s3_bucket_public_access_block" "data" {
  count = var.create_bucket ? 1 : 0

  bucket                  = aws_s3_bucket.data[0].id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "data" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.data[0].id
  rule {
    object_ownership = local.bucket_settings.object_ownership
  }
}

resource "aws_s3_bucket_policy" "data" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.data[0].id
  policy = templatefile("${path.module}/policies/bucket-tls-only.json.tftpl", {
    partition = data.aws_partition.current.partition
    bucket    = var.bucket
  })

  depends_on = [aws_s3_bucket_public_access_block.data]
}

resource "aws_s3_bucket_server_side_encryption_configuration" "data" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.data[0].id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = local.bucket_settings.sse_algorithm
    }
    bucket_key_enabled = local.bucket_settings.bucket_key_enabled
  }
}

resource "aws_s3_bucket_versioning" "data" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.data[0].id
  versioning_configuration {
    status = local.bucket_settings.versioning
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "data" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.data[0].id

  rule {
    id     = "expire-old-versions-and-failed-uploads"
    status = "Enabled"
    filter {}

    noncurrent_version_expiration {
      noncurrent_days = local.bucket_settings.noncurrent_version_expiration_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = local.bucket_settings.abort_incomplete_multipart_upload_days
    }
  }

  depends_on = [aws_s3_bucket_versioning.data]
}
