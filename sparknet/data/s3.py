"""S3 access for datasets: URIs, per-process clients, one-line errors, and resumable reads.

Shards are read by long-lived streams from executors. A stream that breaks half-way (a reset
connection, a read timeout) must not fail a Spark task, so `RangedReader` reopens the object at
the byte it reached. Every reopen is pinned to the ETag of the first response, so an object that
is replaced mid-read fails loudly instead of splicing two versions together.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import botocore.exceptions as bx
import urllib3.exceptions

from sparknet import aws
from sparknet.errors import SparknetError

#: `RangedReader` buffer size when wrapped by `open_object`
READ_BUFFER = 1 << 20

_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]$")
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: S3's longest key, in bytes of its UTF-8
MAX_KEY_BYTES = 1024


class MissingObjectError(SparknetError):
    """An object (or local file) that is not there; its message names the full URI.

    A subclass so callers can tell "absent" (e.g. a dataset without a manifest) from other
    failures, while it still prints as a one-line SparknetError.
    """


class MissingBucketError(SparknetError):
    """The bucket of a URI does not exist (S3's NoSuchBucket): a caller that can make it (an
    upload) says how; `bucket` is its name."""

    def __init__(self, template: str = "", /, *, bucket: str = "", **values: object) -> None:
        super().__init__(template, **values)
        self.bucket = bucket


@dataclass(frozen=True)
class S3Uri:
    """`s3://bucket/key`; `key` has no leading slash and may be empty (the bucket's root)."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Uri:
        """Split an `s3://` URI; a one-line error names what is wrong with it."""
        if not uri.startswith("s3://"):
            raise SparknetError(f"{uri!r} is not an S3 URI; write it as s3://BUCKET/PREFIX")
        bucket, _, key = uri[len("s3://") :].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise SparknetError(
                f"{uri!r} has no valid bucket name ({bucket!r}): bucket names are 3-63 letters, "
                "digits, dots or dashes; write it as s3://BUCKET/PREFIX"
            )
        # S3 keeps `.`, `..` and empty parts as they are: `s3://b/runs/../datasets/` is the key
        # `runs/../datasets/`, not `datasets/`, so such a URI is not where it reads as pointing
        parts = key.removesuffix("/").split("/") if key else []
        odd = [part for part in parts if part in ("", ".", "..")]
        if odd:
            what = "an empty part (//)" if odd[0] == "" else f"a {odd[0]!r} part"
            raise SparknetError(
                f"{uri!r} has {what} in its key, which S3 takes literally; write it as "
                "s3://BUCKET/PREFIX with no '.', '..' or empty parts"
            )
        # `s3://b/data ` (a pasted space) is another prefix than `s3://b/data`, one no listing
        # tells apart from it; a control character is no one's key
        if _CONTROL.search(key):
            raise SparknetError(f"{uri!r} has a control character in its key; remove it")
        if any(part != part.strip() for part in parts):
            raise SparknetError(
                f"{uri!r} has a space at the start or end of a part of its key, which S3 keeps "
                "as another prefix; remove it"
            )
        if len(key.encode()) > MAX_KEY_BYTES:
            raise SparknetError(
                f"the key of s3://{bucket}/{key[:40]}... is {len(key.encode())} bytes; S3 keys "
                f"hold at most {MAX_KEY_BYTES}"
            )
        return cls(bucket, key)

    def child(self, name: str) -> S3Uri:
        """The object `name` directly under this URI taken as a prefix ("directory")."""
        prefix = self.key.rstrip("/")
        return S3Uri(self.bucket, f"{prefix}/{name}" if prefix else name)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


_clients: dict[tuple[str | None, ...], Any] = {}
_clients_lock = threading.Lock()


def client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client (see `sparknet.aws.client`) shared by the threads of this process.

    Cached per process id because Spark forks Python workers: a client (and its connection pool)
    inherited across a fork shares sockets with the parent. The key also holds the environment
    that boto3 resolves at creation (profile, access key id, endpoint, region), so changing it
    takes effect. The region is boto3's own (AWS_REGION, AWS_DEFAULT_REGION, the profile's):
    never instance metadata, which off EC2 costs every process seconds of timeouts. An EC2
    cluster's bootstrap gives its nodes' Pythons the cluster's region (`steps.conf_pth`). The
    pool is wide for the transfer manager's parallel parts.
    """
    env = os.environ
    key = (
        endpoint_url,
        str(os.getpid()),
        env.get("AWS_PROFILE"),
        env.get("AWS_ACCESS_KEY_ID"),
        env.get("AWS_ENDPOINT_URL"),
        env.get("AWS_ENDPOINT_URL_S3"),
        env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
    )
    with _clients_lock:
        found = _clients.get(key)
        if found is None:
            found = aws.client("s3", None, endpoint_url, max_attempts=10, max_pool_connections=32)
            _clients[key] = found
        return found


def bucket_region(bucket: str, endpoint_url: str | None = None) -> str | None:
    """The region `bucket` lives in, from HeadBucket's `x-amz-bucket-region` header (S3 sends
    it with a 403 or 301 too, so a caller who may not read the bucket still learns where it
    is); None only when S3 answers 404 (no such bucket). Any other failure (throttling after
    the client's retries, a 5xx, an unreachable endpoint) raises a one-line SparknetError: an
    answer that does not say where the bucket is says nothing about whether it exists."""
    probe = aws.client("s3", None, endpoint_url, max_attempts=4)
    what = f"HeadBucket of s3://{bucket}"
    try:
        answer = probe.head_bucket(Bucket=bucket)
    except bx.ClientError as exc:
        answer = exc.response
        meta = answer.get("ResponseMetadata", {})
        region = meta.get("HTTPHeaders", {}).get("x-amz-bucket-region")
        if region:
            return str(region)
        if meta.get("HTTPStatusCode") == 404:
            return None
        raise aws.describe_error(exc, what) from exc
    except bx.BotoCoreError as exc:
        raise aws.describe_error(exc, what) from exc
    headers = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    region = headers.get("x-amz-bucket-region") or answer.get("BucketRegion")
    return str(region) if region else None


def on_aws_s3(endpoint_url: str | None) -> bool:
    """Whether requests to `endpoint_url` go to AWS's own S3: no endpoint (boto3's default), an
    amazonaws.com host, or the endpoint this process sends its AWS calls to (AWS_ENDPOINT_URL_S3
    / AWS_ENDPOINT_URL: a VPC endpoint, or a test's moto). Not a store of another kind that
    speaks S3's API (MinIO, Ceph), whose "region" is whatever it is configured to report."""
    if not endpoint_url:
        return True
    env = os.environ
    if endpoint_url.rstrip("/") in {
        (env.get(name) or "").rstrip("/") for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    }:
        return True
    host = urllib.parse.urlsplit(endpoint_url).hostname or ""
    return host == "amazonaws.com" or host.endswith(".amazonaws.com")


#: failures where retrying only wastes the user's time: nothing listens, or TLS does not fit
UNREACHABLE = (bx.EndpointConnectionError, bx.SSLError, bx.ConnectTimeoutError)


def check_reachable(uri: S3Uri, endpoint_url: str | None = None) -> None:
    """One `HeadBucket`, tried once: a refused connection or a TLS mismatch fails now, in one
    line, instead of after the shared client's retries (tens of seconds). Any other answer
    (even an error) means S3 is there; the real request then says what is wrong."""
    probe = aws.client("s3", None, endpoint_url, max_attempts=1)
    try:
        probe.head_bucket(Bucket=uri.bucket)
    except UNREACHABLE as exc:
        raise describe_client_error(exc, uri) from exc
    except (bx.BotoCoreError, bx.ClientError):
        pass  # S3 answered: the real request says what is wrong


def describe_client_error(exc: BaseException, what: str | S3Uri) -> SparknetError:
    """Turn a boto3/botocore failure about `what` (an s3:// URI) into a one-line SparknetError
    that says what to fix: S3's own cases here, the rest as for any AWS call (`sparknet.aws`).
    Returned, not raised, so callers write `raise ... from exc`."""
    what = str(what)
    cause = aws.root_cause(exc)
    if isinstance(cause, bx.ClientError):
        err = cause.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            bucket = err.get("BucketName") or (
                S3Uri.parse(what).bucket if what.startswith("s3://") else what
            )
            return MissingBucketError(
                f"bucket {bucket} does not exist; create it or fix the URI ({what})",
                bucket=str(bucket),
            )
        if code in _MISSING_CODES:
            return MissingObjectError(f"{what} does not exist")
        if code not in aws.CREDENTIAL_CODES and (code in aws.DENIED_CODES or status == 403):
            return SparknetError(
                f"access to {what} was denied ({code or 403}); the AWS credentials in use lack "
                "permission: set AWS_PROFILE or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY to "
                "credentials that may use this bucket"
            )
        if code in ("PreconditionFailed", "412"):
            return SparknetError(
                f"{what} was replaced while it was being read (its ETag changed); "
                "wait for the upload to finish and run again"
            )
    return aws.describe_error(cause, f"S3 request for {what}")


def describe_read_error(exc: BaseException, uri: S3Uri, s3: Any) -> SparknetError:
    """`describe_client_error` for a GET or HEAD of `uri`, where a 403 may mean "not there".

    S3 answers a GET or HEAD of a missing key with 404 only when the caller holds s3:ListBucket
    for the request, else with 403 (GetObject / HeadObject, "Permissions"). A ListBucket granted
    on prefixes (`s3:prefix`, as the node role's) never applies to a GET, which carries no
    prefix, so the nodes get 403 for every missing object. A list of the key itself as the
    prefix does carry it: when that list is allowed and the key is not in it, the object is
    missing; when the list fails too, or finds the key, the 403 stands.
    """
    err = describe_client_error(exc, uri)
    if isinstance(err, MissingObjectError) or not uri.key or not _refused(exc):
        return err
    try:
        return MissingObjectError(f"{uri} does not exist") if absent(uri, s3) else err
    except (bx.BotoCoreError, bx.ClientError):
        return err


def _refused(exc: BaseException) -> bool:
    cause = aws.root_cause(exc)
    if not isinstance(cause, bx.ClientError):
        return False
    code = str(cause.response.get("Error", {}).get("Code", ""))
    status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code not in aws.CREDENTIAL_CODES and (status == 403 or code in aws.DENIED_CODES)


def absent(uri: S3Uri, s3: Any) -> bool:
    """Whether no object is at `uri`, by ListObjectsV2 with the key as the prefix (one call: in
    S3's UTF-8 binary key order a key comes before every other key it is a prefix of)."""
    answer = s3.list_objects_v2(Bucket=uri.bucket, Prefix=uri.key, MaxKeys=1)
    return not any(obj["Key"] == uri.key for obj in answer.get("Contents", []))


#: errors of a broken response stream; the read is resumed from the byte it reached
STREAM_ERRORS: tuple[type[BaseException], ...] = (
    bx.IncompleteReadError,
    bx.ReadTimeoutError,
    bx.ResponseStreamingError,
    bx.ConnectionClosedError,
    bx.EndpointConnectionError,
    bx.ConnectTimeoutError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    http.client.IncompleteRead,
    ConnectionError,  # ConnectionResetError, BrokenPipeError, ...
    TimeoutError,
)


class RangedReader(io.RawIOBase):
    """A forward-only stream of one S3 object from byte `start`, resumed across broken streams.

    Wrap it in `io.BufferedReader` (see `open_object`); it implements `readinto` and `tell`.
    The object is opened at construction, so a missing object or bucket fails there, not at the
    first read. After a stream error it reopens with `Range: bytes=<pos>-` and `If-Match: <etag>`;
    up to `attempts` consecutive failures without progress, sleeping `backoff * 2**n` between
    them, before it gives up with a SparknetError naming the URI.
    """

    def __init__(
        self,
        uri: S3Uri,
        start: int = 0,
        *,
        endpoint_url: str | None = None,
        attempts: int = 6,
        backoff: float = 0.5,
    ) -> None:
        super().__init__()
        if start < 0:
            raise ValueError(f"start must be >= 0, not {start}")
        self.uri = uri
        self._endpoint_url = endpoint_url
        self._attempts = attempts
        self._backoff = backoff
        self._pos = start
        self._etag: str | None = None
        self._size: int | None = None
        self._body: Any = None
        self.reopens = 0  # how many times a broken stream was resumed (for tests and logs)
        try:
            self._open()
        except bx.BotoCoreError as exc:  # after the client's own retries: fail at open
            raise describe_client_error(exc, uri) from exc

    def _open(self) -> None:
        """(Re)open the object at `self._pos`; sets `_body`, or leaves it None at end of object."""
        args: dict[str, Any] = {"Bucket": self.uri.bucket, "Key": self.uri.key}
        if self._pos > 0:
            args["Range"] = f"bytes={self._pos}-"
        if self._etag is not None:
            args["IfMatch"] = self._etag
        s3 = client(self._endpoint_url)
        try:
            resp = s3.get_object(**args)
        except bx.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code == "InvalidRange":  # start at (or past) the end
                self._at_end_or_fail(s3)
                return
            raise describe_read_error(exc, self.uri, s3) from exc
        if self._pos > 0 and not resp.get("ContentRange"):
            resp["Body"].close()
            raise SparknetError(
                f"the S3 endpoint ignored a Range request for {self.uri}; "
                "use an S3-compatible store that supports ranged GETs"
            )
        if self._etag is None:
            self._etag = resp.get("ETag")
            self._size = self._pos + int(resp.get("ContentLength", 0))
        self._body = resp["Body"]

    def _at_end_or_fail(self, s3: Any) -> None:
        try:
            head = s3.head_object(Bucket=self.uri.bucket, Key=self.uri.key)
        except bx.ClientError as exc:
            raise describe_read_error(exc, self.uri, s3) from exc
        size = int(head["ContentLength"])
        if self._pos > size:
            raise SparknetError(
                f"cannot read {self.uri} from byte {self._pos}: it has only {size} bytes"
            )
        if self._etag is None:
            self._etag = head.get("ETag")
        elif head.get("ETag") != self._etag:
            raise describe_client_error(
                bx.ClientError({"Error": {"Code": "PreconditionFailed"}}, "GetObject"), self.uri
            )
        self._size = size
        self._body = None

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if len(view) == 0:
            return 0
        failures = 0
        while True:
            if self._size is not None and self._pos >= self._size:
                self._finish()
                return 0
            try:
                if self._body is None:
                    self._open()
                    if self._body is None:
                        return 0
                chunk = self._body.read(len(view))
                if not chunk and self._size is not None and self._pos < self._size:
                    # a clean EOF short of the length the server promised
                    raise bx.IncompleteReadError(actual_bytes=self._pos, expected_bytes=self._size)
            except STREAM_ERRORS as exc:
                failures += 1
                self._drop_body()
                if failures >= self._attempts:
                    raise SparknetError(
                        f"reading {self.uri} failed at byte {self._pos} after {failures} "
                        f"attempts ({type(exc).__name__}: {aws.one_line(exc)}); check the network "
                        "and the endpoint, then run again"
                    ) from exc
                time.sleep(self._backoff * 2 ** (failures - 1))
                self.reopens += 1
                continue
            except bx.BotoCoreError as exc:  # e.g. credentials expired between two opens
                raise describe_client_error(exc, self.uri) from exc
            n = len(chunk)
            view[:n] = chunk
            self._pos += n
            return n

    def _finish(self) -> None:
        """At the end of the object: read the (empty) rest, so urllib3 returns the connection to
        the pool instead of closing it, then drop the body."""
        if self._body is not None:
            with contextlib.suppress(Exception):  # it only keeps the connection: else a new one
                self._body.read()
        self._drop_body()

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            # a broken stream may fail to close; it is dropped either way
            with contextlib.suppress(Exception):
                body.close()

    def close(self) -> None:
        self._drop_body()
        super().close()


def open_object(
    uri: S3Uri,
    start: int = 0,
    endpoint_url: str | None = None,
    *,
    attempts: int = 6,
    backoff: float = 0.5,
) -> BinaryIO:
    """A buffered, resumable stream of `uri` from byte `start` (see `RangedReader`)."""
    raw = RangedReader(uri, start, endpoint_url=endpoint_url, attempts=attempts, backoff=backoff)
    return cast(BinaryIO, io.BufferedReader(raw, buffer_size=READ_BUFFER))
