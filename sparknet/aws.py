"""How sparknet talks to AWS: one client factory and one way a failure reads.

`data/` (S3 datasets) and `cluster/` (EC2, IAM, SSM) both sit on this module, so every client has
the same retry and timeout policy and the same problem (no credentials, a dead endpoint, a quota)
gets the same one-line message, whichever part of sparknet met it. The parts add only what is
their own: `data/s3.py` the S3 codes (no such bucket, a replaced object), `cluster/` the actions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bx
import botocore.loaders
import botocore.session
from botocore.config import Config

from sparknet.errors import SparknetError

#: connection / read timeouts (seconds) of every client; a stalled read is retried
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0

#: errors about a regional quota: no AZ helps, a type of another quota group may
QUOTA_CODES = frozenset(
    {"InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"}
)
#: the credentials were read but AWS does not accept them (EC2/IAM/SSM and S3 spellings)
CREDENTIAL_CODES = frozenset(
    {
        "AuthFailure",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "RequestExpired",
        "InvalidAccessKeyId",
        "InvalidToken",
        "TokenRefreshRequired",
    }
)
DENIED_CODES = frozenset(
    {"UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "Forbidden", "403"}
)


T = TypeVar("T")

#: environment variables boto3 reads an endpoint from (the service-specific one is upper-cased)
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_{service}")


def check_endpoint_url(url: str | None, where: str = "endpoint_url") -> str | None:
    """`url` when boto3 can use it (http:// or https:// and a host), else a one-line error.

    botocore refuses `127.0.0.1:9000` only with a bare ValueError deep inside client creation,
    which reads as a crash; the scheme is the usual thing left out.
    """
    if url is None:
        return None
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SparknetError(
            f"{where} {url!r} is not a URL: write it as http://HOST:PORT (or https://...)"
        )
    return url


def _check_endpoint_env(service: str) -> None:
    for name in _ENDPOINT_ENV:
        name = name.format(service=service.upper().replace("-", "_"))
        if os.environ.get(name):
            check_endpoint_url(os.environ[name], name)


def client(
    service: str,
    region: str | None = None,
    endpoint_url: str | None = None,
    *,
    max_attempts: int = 8,
    max_pool_connections: int = 10,
) -> Any:
    """A boto3 client with adaptive retries and bounded timeouts.

    Adaptive mode retries throttling (EC2 answers bursts of Describe calls, as `up` and the
    waiters make, with RequestLimitExceeded) and also slows the client down. `max_attempts` is
    there so interactive commands and tests can fail fast on a dead endpoint. `region=None` and
    `endpoint_url=None` leave them to boto3, which honours AWS_DEFAULT_REGION / AWS_PROFILE and
    AWS_ENDPOINT_URL (moto in tests). Each client comes from its own Session (boto3's default
    session is not thread-safe, and a Session caches the credentials it first found), over one
    shared loader of botocore's service models.
    """
    check_endpoint_url(endpoint_url)
    _check_endpoint_env(service)
    config = Config(
        retries={"mode": "adaptive", "max_attempts": max_attempts},
        connect_timeout=CONNECT_TIMEOUT,
        read_timeout=READ_TIMEOUT,
        max_pool_connections=max_pool_connections,
    )
    try:
        return session().client(
            service, region_name=region, endpoint_url=endpoint_url, config=config
        )
    except bx.InvalidRegionError as exc:
        raise SparknetError(
            f"{region!r} is not an AWS region name; write it like us-east-1"
        ) from exc
    except bx.ProfileNotFound as exc:
        raise describe_error(exc, f"a {service} client") from exc


@functools.cache
def _models() -> botocore.loaders.Loader:
    """botocore's loader of service models, for every Session of this process. A fresh Session
    parses its service's JSON model again (EC2's is megabytes: ~0.15 s of CPU a client, a large
    part of a CLI command's time); the loader caches what it parsed, and the models do not
    change while a process runs."""
    return botocore.loaders.create_loader(os.environ.get("AWS_DATA_PATH"))


def session() -> boto3.session.Session:
    """A new boto3 Session over the shared models (see `client`)."""
    core = botocore.session.get_session()
    core.register_component("data_loader", _models())
    return boto3.session.Session(botocore_session=core)


@functools.cache
def known_regions() -> frozenset[str]:
    """Every region of every partition that the installed botocore knows (no network call)."""
    regions = session()
    return frozenset(
        region
        for partition in regions.get_available_partitions()
        for region in regions.get_available_regions("ec2", partition_name=partition)
    )


def check_region(region: str) -> str:
    """`region`, if AWS has it; else a one-line error. Checked before the first call, because an
    unknown region otherwise surfaces only as an unreachable endpoint after every retry."""
    if region in known_regions():
        return region
    area = region.rsplit("-", 1)[0]  # us-east-9 -> us-east
    near = sorted(r for r in known_regions() if r.rsplit("-", 1)[0] == area)
    hint = f"{area} has {', '.join(near)}" if near else "write it like us-east-1"
    raise SparknetError(
        f"{region!r} is not an AWS region ({hint}); if it is new, upgrade boto3 and botocore"
    )


#: S3's bucket naming rules (general purpose buckets): 3-63 of a-z 0-9 . -, letter or digit at
#: both ends, no "..", not an IP address, and none of the reserved prefixes and suffixes
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKET_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def check_bucket_name(bucket: str) -> str:
    """`bucket`, if S3 accepts it as a bucket name; else a ValueError that says why."""
    why = None
    if not _BUCKET.fullmatch(bucket):
        why = "3-63 of a-z, 0-9, '.', '-', starting and ending with a letter or digit"
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        why = "no '..', '.-' or '-.'"
    elif re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket):
        why = "not an IP address"
    elif bucket.startswith(_BUCKET_RESERVED_PREFIXES) or bucket.endswith(_BUCKET_RESERVED_SUFFIXES):
        why = "none of S3's reserved prefixes (xn--, sthree-, amzn-s3-demo-) or suffixes"
    if why:
        raise ValueError(f"{bucket!r} is not an S3 bucket name: {why}")
    return bucket


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def region_of(client: Any) -> str:
    return str(client.meta.region_name)


def error_code(exc: bx.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def root_cause(exc: BaseException) -> BaseException:
    """The botocore error behind wrappers such as boto3's S3UploadFailedError (which keeps the
    ClientError only as its context)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, (bx.ClientError, bx.BotoCoreError)):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return exc


def _endpoint(exc: bx.BotoCoreError, default: str) -> str:
    """botocore gives the request's full URL; the endpoint is its scheme and host."""
    url = urllib.parse.urlsplit(str(getattr(exc, "kwargs", {}).get("endpoint_url", "")))
    return f"{url.scheme}://{url.netloc}" if url.netloc else default


def describe_error(exc: BaseException, what: str) -> SparknetError:
    """Turn a boto3/botocore failure of `what` (e.g. "RunInstances in us-east-1") into a one-line
    error that says what to fix. Returned, not raised, so callers write `raise ... from exc`."""
    cause = root_cause(exc)
    if isinstance(cause, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return SparknetError(
            f"no AWS credentials found for {what}; set AWS_PROFILE or "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    if isinstance(cause, bx.ProfileNotFound):
        profile = cause.kwargs.get("profile", "")
        return SparknetError(
            f"AWS profile {profile!r} (AWS_PROFILE) is not in ~/.aws/config or ~/.aws/credentials "
            f"(for {what}); fix AWS_PROFILE or unset it"
        )
    if isinstance(cause, bx.SSLError):
        return SparknetError(
            f"the TLS handshake with {_endpoint(cause, 'the endpoint')} failed (for {what}); "
            "check the endpoint URL's scheme (http:// or https://) and its certificate"
        )
    if isinstance(cause, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
        return SparknetError(
            f"cannot reach AWS at {_endpoint(cause, 'its endpoint')} (for {what}); check the "
            "region, endpoint_url / AWS_ENDPOINT_URL, and the network"
        )
    if isinstance(cause, bx.NoRegionError):
        return SparknetError(
            f"no AWS region for {what}; set AWS_DEFAULT_REGION (or a region in the config)"
        )
    if isinstance(cause, bx.ClientError):
        err = cause.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = one_line(err.get("Message", "")) or "no message"
        if code in CREDENTIAL_CODES:
            return SparknetError(
                f"AWS rejected the credentials for {what} ({code}); set AWS_PROFILE or "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY to valid credentials"
            )
        if code in DENIED_CODES or (not code and status == 403):
            return SparknetError(
                f"the AWS credentials in use may not do {what} ({code or 403}); use credentials "
                "with that permission"
            )
        if code in QUOTA_CODES:
            return SparknetError(
                f"{what} hit an AWS quota ({code}: {message}); EC2's vCPU quotas are per "
                "region and instance family: the Service Quotas console of that region (Amazon "
                "EC2) shows each quota's code and value and takes requests for more"
            )
        if code == "OptInRequired":
            return SparknetError(
                f"{what}: the account has not enabled this region or service (OptInRequired); "
                "enable it in the AWS console or choose another region"
            )
        return SparknetError(f"{what} failed: {code or status}: {message}")
    return SparknetError(f"{what} failed: {one_line(cause) or type(cause).__name__}")


@contextlib.contextmanager
def aws_call(action: str, region: str) -> Iterator[None]:
    """Re-raise any boto3/botocore failure inside the block as a one-line SparknetError."""
    try:
        yield
    except (bx.BotoCoreError, bx.ClientError) as exc:
        raise describe_error(exc, f"{action} in {region}") from exc


def retrying(
    call: Callable[[], T],
    transient: Callable[[bx.ClientError], bool],
    *,
    within_s: float,
    pause_s: float = 1.0,
    max_pause_s: float = 15.0,
) -> T:
    """`call()`, made again while AWS answers an error that `transient` accepts, with a pause
    that doubles up to `max_pause_s`, until `within_s` has passed; then the last answer is
    raised. Any other error is raised at once.

    The one retry of what botocore's own retries leave out (they cover throttling and 5xx):
    answers that are AWS's eventual consistency, which the same call gets past in seconds: an
    instance launched a moment ago that EC2 does not know yet (InvalidInstanceID.NotFound), an
    instance profile IAM has not yet shown EC2 (InvalidParameterValue), a dependency a deletion
    still sees (DependencyViolation)."""
    deadline = time.monotonic() + within_s
    pause = pause_s
    while True:
        try:
            return call()
        except bx.ClientError as exc:
            if not transient(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, max_pause_s)


def answer_at_once(client: Any, operation: str, codes: Iterable[str]) -> Any:
    """`client`, made to raise `operation`'s errors `codes` at their first answer instead of
    retrying them; returned for chaining.

    EC2 answers a launch it has no capacity for with InsufficientInstanceCapacity and HTTP 500,
    and botocore retries every 5xx as transient: up to `max_attempts` more RunInstances with
    backoff (tens of seconds) for each refused type and AZ, each spending the account's
    RunInstances request rate. A lack of capacity lasts minutes to hours, and the caller has a
    better move (the next AZ or type). botocore does not retry when a `needs-retry` handler
    answers False, and the operation's own event is asked before the service-wide one that
    holds the retry policy."""
    final = frozenset(codes)
    service = client.meta.service_model.service_id.hyphenize()

    def needs_retry(response: Any = None, **_: Any) -> bool | None:
        if response is None:
            return None  # no answer (a dropped connection): the retry policy decides
        code = response[1].get("Error", {}).get("Code")
        return False if code in final else None

    client.meta.events.register_first(
        f"needs-retry.{service}.{operation}",
        needs_retry,
        unique_id=f"sparknet-answer-at-once-{service}-{operation}",
    )
    return client
