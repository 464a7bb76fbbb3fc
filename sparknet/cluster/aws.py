"""boto3 clients and one-line errors for every AWS call of `cluster/`.

One place decides how sparknet talks to AWS (adaptive retries, one Session per client) and how a
failure reads (what to fix, in one line), so the foundation, the instances and the lifecycle
commands all say the same thing about the same problem.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.exceptions as bx
from botocore.config import Config

from sparknet.errors import SparknetError

#: RunInstances errors about a regional quota: no AZ helps, a type of another quota group may
QUOTA_CODES = frozenset(
    {"InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"}
)
_CREDENTIAL_CODES = frozenset(
    {
        "AuthFailure",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "RequestExpired",
    }
)
_DENIED_CODES = frozenset({"UnauthorizedOperation", "AccessDenied", "AccessDeniedException"})


def client(
    service: str, region: str, endpoint_url: str | None = None, max_attempts: int = 8
) -> Any:
    """A boto3 client with adaptive retries: EC2 throttles bursts of Describe calls (as `up` and
    the waiters make) with RequestLimitExceeded, and adaptive mode also slows the client down.
    `max_attempts` is there so interactive commands and tests can fail fast on a dead endpoint.
    `endpoint_url=None` leaves it to boto3, which honours AWS_ENDPOINT_URL (moto in tests).
    Each client comes from its own Session: boto3's default session is not thread-safe."""
    config = Config(retries={"mode": "adaptive", "max_attempts": max_attempts})
    try:
        return boto3.session.Session().client(
            service, region_name=region, endpoint_url=endpoint_url, config=config
        )
    except bx.InvalidRegionError as exc:
        raise SparknetError(
            f"{region!r} is not an AWS region name; write it like us-east-1"
        ) from exc


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def region_of(client: Any) -> str:
    return str(client.meta.region_name)


def describe_aws_error(exc: BaseException, action: str, region: str) -> SparknetError:
    """Turn a boto3/botocore failure of `action` (e.g. "RunInstances") into a one-line error that
    says what to fix. Returned, not raised, so callers write `raise ... from exc`."""
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return SparknetError(
            f"no AWS credentials found for {action} in {region}; set AWS_PROFILE or "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
        endpoint = exc.kwargs.get("endpoint_url", "the EC2 endpoint")
        return SparknetError(
            f"cannot reach AWS at {endpoint} for {action}: check that {region!r} is a region "
            "that exists (e.g. us-east-1), AWS_ENDPOINT_URL, and the network"
        )
    if isinstance(exc, bx.NoRegionError):
        return SparknetError(f"no AWS region for {action}; set the cluster's region")
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        message = one_line(err.get("Message", "")) or "no message"
        if code in _CREDENTIAL_CODES:
            return SparknetError(
                f"AWS rejected the credentials for {action} in {region} ({code}); set AWS_PROFILE "
                "or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY to valid credentials"
            )
        if code in _DENIED_CODES:
            return SparknetError(
                f"the AWS credentials in use may not call {action} in {region} ({code}); "
                "use credentials with EC2 permissions"
            )
        if code in QUOTA_CODES:
            return SparknetError(
                f"{action} in {region} hit an EC2 quota ({code}: {message}); request an "
                "increase in the Service Quotas console"
            )
        return SparknetError(f"{action} in {region} failed: {code}: {message}")
    return SparknetError(f"{action} in {region} failed: {one_line(exc) or type(exc).__name__}")


@contextlib.contextmanager
def aws_call(action: str, region: str) -> Iterator[None]:
    """Re-raise any boto3/botocore failure inside the block as a one-line SparknetError."""
    try:
        yield
    except (bx.BotoCoreError, bx.ClientError) as exc:
        raise describe_aws_error(exc, action, region) from exc


def error_code(exc: bx.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
