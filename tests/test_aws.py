"""One client policy and one wording for AWS failures, shared by `data/` and `cluster/`; and the
cluster spec's checks that fail before any AWS call (an unknown region, SSH open to everyone)."""

from __future__ import annotations

import botocore.exceptions as bx
import pytest

from sparknet import aws
from sparknet.cluster.spec import ClusterSpec
from sparknet.config import validation_error
from sparknet.errors import SparknetError
from tests.cli.test_cli import run_cli


def client_error(code: str, status: int = 400) -> bx.ClientError:
    error = {"Code": code, "Message": "two\nlines"}
    return bx.ClientError(
        {"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "RunInstances"
    )


@pytest.mark.parametrize(
    ("exc", "needles"),
    [
        (bx.NoCredentialsError(), ["no AWS credentials found for X", "AWS_PROFILE"]),
        (client_error("AuthFailure", 401), ["rejected the credentials", "(AuthFailure)"]),
        (
            client_error("InvalidAccessKeyId", 403),
            ["rejected the credentials", "AWS_ACCESS_KEY_ID"],
        ),
        (client_error("UnauthorizedOperation", 403), ["may not do X (UnauthorizedOperation)"]),
        (client_error("VcpuLimitExceeded"), ["hit an AWS quota (VcpuLimitExceeded: two lines)"]),
        (client_error("OptInRequired", 401), ["not enabled this region", "choose another"]),
        (client_error("Weird"), ["X failed: Weird: two lines"]),
        (
            bx.EndpointConnectionError(endpoint_url="https://ec2.x.amazonaws.com/path?q=1"),
            ["cannot reach AWS at https://ec2.x.amazonaws.com (for X)", "AWS_ENDPOINT_URL"],
        ),
        (bx.NoRegionError(), ["no AWS region for X", "AWS_DEFAULT_REGION"]),
    ],
)
def test_describe_error_is_one_line_that_says_what_to_fix(exc, needles):
    err = aws.describe_error(exc, "X")
    assert isinstance(err, SparknetError)
    text = str(err)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text


def test_clients_share_one_retry_and_timeout_policy():
    ec2 = aws.client("ec2", "eu-west-1", "http://127.0.0.1:9", max_attempts=3)
    config = ec2.meta.config
    assert config.retries == {"mode": "adaptive", "total_max_attempts": 4}
    assert (config.connect_timeout, config.read_timeout) == (aws.CONNECT_TIMEOUT, aws.READ_TIMEOUT)
    assert aws.region_of(ec2) == "eu-west-1"


def test_known_regions_come_from_botocore_without_a_call():
    regions = aws.known_regions()
    assert {"us-east-1", "eu-west-1", "cn-north-1", "us-gov-west-1"} <= regions
    assert aws.check_region("ap-southeast-2") == "ap-southeast-2"


@pytest.mark.parametrize(
    ("settings", "needles"),
    [
        ({"region": "us-east-9"}, ["'us-east-9' is not an AWS region", "us-east-1, us-east-2"]),
        ({"region": "moon-1"}, ["'moon-1' is not an AWS region", "like us-east-1"]),
        ({"allowed_cidr": "0.0.0.0/0"}, ["is open to 4,294,967,296 addresses", "/16 or narrower"]),
        ({"allowed_cidr": "300.1.2.3/32"}, ["not an IPv4 CIDR"]),
        ({"vpc_id": "vpc-1"}, ["vpc_id and subnet_ids go together"]),
    ],
)
def test_cluster_spec_refuses_bad_settings_in_one_line(settings, needles):
    with pytest.raises(ValueError) as info:
        ClusterSpec(name="c1", **settings)
    text = str(validation_error(info.value))
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text


def test_cluster_spec_normalises_an_address_to_its_network():
    assert ClusterSpec(name="c1", allowed_cidr="203.0.113.9").allowed_cidr == "203.0.113.9/32"
    assert ClusterSpec(name="c1", allowed_cidr="10.1.2.3/16").allowed_cidr == "10.1.0.0/16"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["up", "c1", "--region", "us-east-9", "--allowed-cidr", "1.2.3.4/32"], "us-east-9"),
        (["up", "c1", "--allowed-cidr", "0.0.0.0/0"], "/16 or narrower"),
        (["down", "c1", "--region", "mars-1"], "'mars-1' is not an AWS region"),
        (["list", "--region", "xx-north-4"], "'xx-north-4' is not an AWS region"),
        (["sweep", "--region", "xx-north-4"], "'xx-north-4' is not an AWS region"),
    ],
)
def test_cluster_cli_fails_before_any_aws_call(tmp_path, args, message):
    """No endpoint is reachable here (AWS_ENDPOINT_URL points nowhere): the check comes first."""
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "SPARKNET_HOME": str(tmp_path)}
    proc = run_cli("cluster", *args, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "clusters").exists()


@pytest.mark.parametrize(
    ("profile", "message"),
    [(None, "no AWS credentials found for"), ("nosuch", "AWS profile 'nosuch' (AWS_PROFILE)")],
)
def test_cluster_up_without_usable_credentials_is_one_line(tmp_path, profile, message):
    """botocore looks for credentials before it sends anything, so no endpoint is needed."""
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "SPARKNET_HOME": str(tmp_path),
        "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None,
        "AWS_PROFILE": profile, "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true",
    }  # fmt: skip
    proc = run_cli("cluster", "up", "c1", "--allowed-cidr", "1.2.3.4/32", cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "clusters").exists()


@pytest.mark.parametrize(
    ("args", "env", "config"),
    [
        (["--endpoint-url", "127.0.0.1:9000"], {}, None),
        ([], {"AWS_ENDPOINT_URL": "127.0.0.1:9000"}, None),
        ([], {"AWS_ENDPOINT_URL_S3": "localhost:9000"}, None),
        ([], {}, "datasets:\n  ds:\n    uri: s3://bkt/x\n    endpoint_url: minio:9000\n"),
    ],
    ids=["flag", "env", "env-s3", "dataset-entry"],
)
def test_an_endpoint_url_without_a_scheme_is_one_line_exit_2(tmp_path, args, env, config):
    if config is not None:
        (tmp_path / "sparknet.yaml").write_text(config)
    dataset = "ds" if config is not None else "s3://bkt/x"
    done = run_cli(
        "data", "ls", dataset, *args, cwd=tmp_path,
        env={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": None, **env},
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "http://" in lines[0] and "9000" in lines[0], done.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:9000", "https://s3.example.com", None])
def test_an_endpoint_url_with_a_scheme_is_accepted(url):
    assert aws.check_endpoint_url(url) == url


@pytest.mark.parametrize("url", ["127.0.0.1:9000", "ftp://h:1", "http://", "http//h:9"])
def test_check_endpoint_url_refuses_what_botocore_cannot_use(url):
    with pytest.raises(SparknetError, match=r"write it as http://HOST:PORT"):
        aws.check_endpoint_url(url)
