"""S3 access and the Store interface, against moto's real server (and a TCP proxy that breaks
connections for real, to pin the resumable reader)."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import botocore.exceptions as bx
import pytest
from boto3.exceptions import S3UploadFailedError

from sparknet.data import s3
from sparknet.data.manifest import MANIFEST_NAME, Manifest, ShardInfo
from sparknet.data.s3 import MissingObjectError, S3Uri, describe_client_error
from sparknet.data.store import LocalStore, S3Store, load_manifest, open_store
from sparknet.errors import SparknetError


def assert_one_line(err: BaseException, *needles: str) -> None:
    text = str(err)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"


def put(endpoint: str, bucket: str, key: str, data: bytes) -> None:
    boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=bucket, Key=key, Body=data)


# ---------------------------------------------------------------- URIs and error messages


def test_s3uri_parses_bucket_and_key_and_joins_children() -> None:
    uri = S3Uri.parse("s3://my-bucket/data/imagenet/")
    assert (uri.bucket, uri.key) == ("my-bucket", "data/imagenet/")
    assert str(uri.child("manifest.json")) == "s3://my-bucket/data/imagenet/manifest.json"
    assert str(S3Uri.parse("s3://my-bucket").child("x.tar")) == "s3://my-bucket/x.tar"


@pytest.mark.parametrize("bad", ["/local/path", "http://bucket/x", "s3://ab/x", "s3:///x", "s3://"])
def test_s3uri_rejects_non_s3_and_short_bucket_in_one_line(bad: str) -> None:
    with pytest.raises(SparknetError) as info:
        S3Uri.parse(bad)
    assert_one_line(info.value, "s3://BUCKET/PREFIX")


def client_error(code: str, status: int = 400, **extra: str) -> bx.ClientError:
    return bx.ClientError(
        {
            "Error": {"Code": code, "Message": "m\nultiline", **extra},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        "GetObject",
    )


@pytest.mark.parametrize(
    ("exc", "needles"),
    [
        (client_error("NoSuchBucket", 404), ["bucket bkt does not exist", "create it"]),
        (client_error("NoSuchKey", 404), ["s3://bkt/p/train-000000.tar does not exist"]),
        (client_error("InvalidAccessKeyId", 403), ["credentials", "AWS_PROFILE"]),
        (client_error("SignatureDoesNotMatch", 403), ["credentials", "AWS_ACCESS_KEY_ID"]),
        (client_error("AccessDenied", 403), ["denied", "AWS_PROFILE"]),
        (bx.NoCredentialsError(), ["credentials", "AWS_PROFILE", "AWS_ACCESS_KEY_ID"]),
        (
            bx.EndpointConnectionError(endpoint_url="http://nowhere:9/bkt/p/x.tar"),
            ["cannot reach AWS at http://nowhere:9 (for S3 request for s3://bkt/", "ENDPOINT_URL"],
        ),
    ],
)
def test_describe_client_error_says_what_to_fix_in_one_line(
    exc: BaseException, needles: list[str]
) -> None:
    err = describe_client_error(exc, "s3://bkt/p/train-000000.tar")
    assert isinstance(err, SparknetError)
    assert_one_line(err, *needles)


def test_describe_client_error_unwraps_boto3_upload_failure() -> None:
    """boto3's upload_file keeps the ClientError only as the context of S3UploadFailedError."""
    try:
        try:
            raise client_error("NoSuchBucket", 404)
        except bx.ClientError as inner:
            raise S3UploadFailedError(f"Failed to upload: {inner}")  # noqa: B904
    except S3UploadFailedError as outer:
        err = describe_client_error(outer, "s3://bkt/x")
    assert_one_line(err, "bucket bkt does not exist")


def test_missing_key_is_a_missing_object_error() -> None:
    assert isinstance(
        describe_client_error(client_error("NoSuchKey"), "s3://b/k"), MissingObjectError
    )


# ---------------------------------------------------------------- the per-process client


def test_client_is_cached_per_endpoint_and_per_process(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = s3.client(moto_endpoint)
    assert s3.client(moto_endpoint) is first
    assert s3.client("http://127.0.0.1:1") is not first
    real_pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real_pid + 1)  # as in a forked Spark worker
    assert s3.client(moto_endpoint) is not first


def test_client_retries_adaptively_with_a_connection_pool(moto_endpoint: str) -> None:
    config = s3.client(moto_endpoint).meta.config
    assert config.retries["mode"] == "adaptive"
    assert config.retries["total_max_attempts"] == 11  # botocore: max_attempts=10 retries + 1
    assert config.max_pool_connections == 32


# ---------------------------------------------------------------- a connection-breaking proxy


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of moto that records every request head and, for the
    first `cuts` GET responses, forwards only `cut_after` bytes of the body and then closes both
    sides: a real broken connection as boto3 sees it. `before_cut` runs just before each cut."""

    def __init__(
        self,
        upstream: str,
        cut_after: int,
        cuts: int = 1,
        before_cut: Callable[[], None] | None = None,
    ) -> None:
        host, port = upstream.rsplit("//", 1)[1].rsplit(":", 1)
        self.upstream = ("127.0.0.1" if host == "localhost" else host, int(port))
        self.cut_after = cut_after
        self.cuts_left = cuts
        self.before_cut = before_cut
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.getsockname()[1]}"

    def __enter__(self) -> CuttingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._server.close()

    def range_gets(self) -> list[str]:
        return [r for r in self.requests if r.startswith("GET ") and "\r\nrange:" in r.lower()]

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._server.accept()
            except TimeoutError:
                continue
            up = socket.create_connection(self.upstream)
            last_method: list[str] = [""]
            threading.Thread(
                target=self._requests, args=(down, up, last_method), daemon=True
            ).start()
            threading.Thread(
                target=self._responses, args=(up, down, last_method), daemon=True
            ).start()

    def _requests(self, down: socket.socket, up: socket.socket, last: list[str]) -> None:
        try:
            while data := down.recv(65536):
                text = data.decode("latin-1")
                if re.match(r"^[A-Z]+ /", text):
                    with self._lock:
                        self.requests.append(text.split("\r\n\r\n", 1)[0])
                    last[0] = text.split(" ", 1)[0]
                up.sendall(data)
        except OSError:  # the other pump closed the sockets
            pass
        finally:
            close_all(down, up)

    def _responses(self, up: socket.socket, down: socket.socket, last: list[str]) -> None:
        try:
            self._pump_responses(up, down, last)
        except OSError:
            pass
        finally:
            close_all(up, down)

    def _pump_responses(self, up: socket.socket, down: socket.socket, last: list[str]) -> None:
        head = b""
        cutting = False
        sent_body = 0
        while data := up.recv(65536):
            if not cutting and not head:
                with self._lock:
                    cutting = last[0] == "GET" and self.cuts_left > 0
                    if cutting:
                        self.cuts_left -= 1
            if not cutting:
                down.sendall(data)
                continue
            if b"\r\n\r\n" not in head:
                head += data
                if b"\r\n\r\n" not in head:
                    continue
                header, data = head.split(b"\r\n\r\n", 1)
                down.sendall(header + b"\r\n\r\n")
            keep = min(len(data), self.cut_after - sent_body)
            down.sendall(data[:keep])
            sent_body += keep
            if sent_body >= self.cut_after:
                if self.before_cut is not None:
                    self.before_cut()
                return  # the caller closes both sides: the response breaks mid-body


def close_all(*socks: socket.socket) -> None:
    """Shut down and close sockets, ignoring ones already closed."""
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


# ---------------------------------------------------------------- the resumable reader


def test_ranged_reader_resumes_after_a_real_broken_connection(
    moto_endpoint: str, bucket: str
) -> None:
    data = os.urandom(300_000)
    put(moto_endpoint, bucket, "ds/train-000000.tar", data)
    uri = S3Uri(bucket, "ds/train-000000.tar")
    with CuttingProxy(moto_endpoint, cut_after=100_000) as proxy:
        raw = s3.RangedReader(uri, endpoint_url=proxy.url, backoff=0.01)
        with io.BufferedReader(raw, buffer_size=32_768) as f:
            got = f.read()
            assert f.tell() == len(data)
    assert got == data
    assert raw.reopens == 1
    [resumed] = proxy.range_gets()
    start = int(re.search(r"(?i)range: bytes=(\d+)-", resumed).group(1))  # type: ignore[union-attr]
    assert 0 < start <= 100_000
    assert "if-match:" in resumed.lower()  # pinned to the first response's ETag


def test_ranged_reader_refuses_to_splice_an_object_replaced_mid_read(
    moto_endpoint: str, bucket: str
) -> None:
    put(moto_endpoint, bucket, "obj", os.urandom(200_000))
    replace = lambda: put(moto_endpoint, bucket, "obj", os.urandom(200_000))  # noqa: E731
    with CuttingProxy(moto_endpoint, cut_after=50_000, before_cut=replace) as proxy:
        f = s3.open_object(S3Uri(bucket, "obj"), endpoint_url=proxy.url, backoff=0.01)
        with pytest.raises(SparknetError) as info:
            f.read()
    assert_one_line(info.value, f"s3://{bucket}/obj", "replaced")


def test_ranged_reader_gives_up_after_bounded_attempts_naming_the_uri(
    moto_endpoint: str, bucket: str
) -> None:
    put(moto_endpoint, bucket, "flaky", os.urandom(100_000))
    # every response loses its whole body: no attempt makes progress
    with CuttingProxy(moto_endpoint, cut_after=0, cuts=100) as proxy:
        f = s3.open_object(S3Uri(bucket, "flaky"), endpoint_url=proxy.url, attempts=3, backoff=0.01)
        with pytest.raises(SparknetError) as info:
            f.read()
    assert_one_line(info.value, f"s3://{bucket}/flaky", "after 3 attempts")


def test_open_object_streams_from_a_byte_offset(moto_endpoint: str, bucket: str) -> None:
    data = os.urandom(5000)
    put(moto_endpoint, bucket, "k", data)
    with s3.open_object(S3Uri(bucket, "k"), start=1234, endpoint_url=moto_endpoint) as f:
        assert f.tell() == 1234
        assert f.read(10) == data[1234:1244]
        assert f.tell() == 1244
        assert f.read() == data[1244:]
    with s3.open_object(S3Uri(bucket, "k"), start=5000, endpoint_url=moto_endpoint) as f:
        assert f.read() == b""


def test_open_object_on_a_missing_key_names_the_full_uri(moto_endpoint: str, bucket: str) -> None:
    with pytest.raises(MissingObjectError) as info:
        s3.open_object(S3Uri(bucket, "ds/none.tar"), endpoint_url=moto_endpoint)
    assert_one_line(info.value, f"s3://{bucket}/ds/none.tar does not exist")


# ---------------------------------------------------------------- stores


@pytest.fixture(params=["local", "s3"])
def store_with_files(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[LocalStore | S3Store, dict[str, bytes]]]:
    files = {"train-000000.tar": os.urandom(3000), "val-000000.tar": os.urandom(10)}
    if request.param == "local":
        for name, data in files.items():
            (tmp_path / name).write_bytes(data)
        (tmp_path / "sub").mkdir()  # not an object of the store
        yield LocalStore(tmp_path), files
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        bucket = request.getfixturevalue("bucket")
        for name, data in files.items():
            put(endpoint, bucket, f"ds/{name}", data)
        put(endpoint, bucket, "ds/sub/deeper.tar", b"x")  # not directly under the prefix
        put(endpoint, bucket, "dsx/other.tar", b"x")  # a sibling prefix
        yield S3Store(f"s3://{bucket}/ds/", endpoint_url=endpoint), files


def test_local_and_s3_stores_behave_alike(
    store_with_files: tuple[LocalStore | S3Store, dict[str, bytes]], tmp_path: Path
) -> None:
    store, files = store_with_files
    assert store.list() == {name: len(data) for name, data in files.items()}
    data = files["train-000000.tar"]
    assert store.size("train-000000.tar") == len(data)
    assert store.size("nope.tar") is None
    assert store.read_bytes("val-000000.tar") == files["val-000000.tar"]
    with store.open("train-000000.tar", start=1000) as f:
        assert f.read() == data[1000:]
    dest = tmp_path / "fetched" / "copy.tar"
    dest.parent.mkdir()
    store.fetch("train-000000.tar", dest)
    assert dest.read_bytes() == data
    assert [p.name for p in dest.parent.iterdir()] == ["copy.tar"]  # no temp left behind


def test_a_missing_shard_names_its_full_location(
    store_with_files: tuple[LocalStore | S3Store, dict[str, bytes]], tmp_path: Path
) -> None:
    store, _ = store_with_files
    where = f"{store.uri}/train-000009.tar"
    for call in (
        lambda: store.open("train-000009.tar"),
        lambda: store.read_bytes("train-000009.tar"),
        lambda: store.fetch("train-000009.tar", tmp_path / "x"),
    ):
        with pytest.raises(MissingObjectError) as info:
            call()
        assert_one_line(info.value, where)
    assert not (tmp_path / "x").exists()


def test_stores_survive_pickling_for_executors(moto_endpoint: str, bucket: str) -> None:
    put(moto_endpoint, bucket, "ds/a.tar", b"abc")
    store = pickle.loads(pickle.dumps(S3Store(f"s3://{bucket}/ds", endpoint_url=moto_endpoint)))
    assert store.read_bytes("a.tar") == b"abc"
    local = pickle.loads(pickle.dumps(LocalStore("/tmp")))
    assert local.uri == "/tmp"


def test_open_store_picks_the_backend_from_the_uri(tmp_path: Path) -> None:
    assert isinstance(open_store("s3://bucket/prefix"), S3Store)
    assert open_store("s3://bucket/prefix/").uri == "s3://bucket/prefix"
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").uri == str(tmp_path)
    with pytest.raises(SparknetError):
        open_store("gs://bucket/x")


# ---------------------------------------------------------------- load_manifest fails fast


def small_manifest() -> Manifest:
    return Manifest(
        classes=[{"index": 0, "wnid": "n0"}],  # type: ignore[list-item]
        splits={"train": [ShardInfo(name="train-000000.tar", samples=1, bytes=1, sha256="0" * 64)]},
    )


def test_load_manifest_reads_it_from_s3(moto_endpoint: str, bucket: str) -> None:
    put(moto_endpoint, bucket, f"ds/{MANIFEST_NAME}", small_manifest().dumps().encode())
    assert load_manifest(open_store(f"s3://{bucket}/ds", moto_endpoint)) == small_manifest()


def test_load_manifest_on_a_prefix_without_one_says_the_upload_did_not_finish(
    moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """...and on a local dir without one, that `data shard` did not finish (nothing uploads)."""
    put(moto_endpoint, bucket, "ds/train-000000.tar", b"x")
    advice = {
        open_store(f"s3://{bucket}/ds", moto_endpoint): "run `sparknet data upload` again",
        LocalStore(tmp_path): "run `sparknet data shard` (again)",
    }
    for store, fix in advice.items():
        with pytest.raises(SparknetError) as info:
            load_manifest(store)
        assert_one_line(info.value, f"{store.uri} has no manifest.json", fix)
    with pytest.raises(SparknetError) as info:
        load_manifest(LocalStore(tmp_path))
    assert "upload" not in str(info.value)


def test_load_manifest_on_a_missing_bucket_says_so(moto_endpoint: str) -> None:
    with pytest.raises(SparknetError) as info:
        load_manifest(open_store("s3://no-such-bucket-here/ds", moto_endpoint))
    assert_one_line(info.value, "bucket no-such-bucket-here does not exist")


def test_load_manifest_with_rejected_credentials_says_to_fix_them(
    moto_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto checks signatures only when told to (its /moto-api/reset-auth switch): turn it on for
    this test, then off again so other tests keep their fake credentials."""

    def auth_after(count: str) -> None:
        req = urllib.request.Request(
            f"{moto_endpoint}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form body would reach moto empty
        )
        urllib.request.urlopen(req, timeout=5).close()

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY00000")
    auth_after("0")
    try:
        with pytest.raises(SparknetError) as info:
            load_manifest(open_store(f"s3://{bucket}/ds", moto_endpoint))
    finally:
        auth_after("inf")
    assert_one_line(info.value, "credentials", "AWS_PROFILE")


def test_load_manifest_without_any_credentials_says_to_set_them(
    moto_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(SparknetError) as info:
        load_manifest(open_store(f"s3://{bucket}/ds", moto_endpoint))
    assert_one_line(info.value, "credentials", "AWS_PROFILE", "AWS_ACCESS_KEY_ID")


def _refused_endpoint() -> str:
    """A local port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("kind", ["refused", "tls"])
def test_data_commands_fail_fast_on_an_endpoint_that_cannot_answer(
    moto_endpoint: str, tmp_path: Path, kind: str
) -> None:
    """No retries for what retrying cannot heal: nothing listening (was 25 s), or https to an
    http server (an SSL error, was 31 s)."""
    import hashlib
    import time

    from sparknet.data.transfer import list_dataset, upload_dataset, verify_dataset

    endpoint = (
        _refused_endpoint() if kind == "refused" else moto_endpoint.replace("http:", "https:")
    )
    needle = "cannot reach AWS" if kind == "refused" else "TLS handshake"
    (tmp_path / "train-000000.tar").write_bytes(b"x")
    shard = ShardInfo(name="train-000000.tar", samples=1, bytes=1,
                      sha256=hashlib.sha256(b"x").hexdigest())  # fmt: skip
    manifest = Manifest(classes=small_manifest().classes, splits={"train": [shard]})
    (tmp_path / MANIFEST_NAME).write_text(manifest.dumps())
    calls = [
        lambda: verify_dataset("s3://bkt/ds", endpoint_url=endpoint),
        lambda: list_dataset("s3://bkt/ds", endpoint_url=endpoint),
        lambda: upload_dataset(tmp_path, "s3://bkt/ds", endpoint_url=endpoint),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(SparknetError) as info:
            call()
        assert time.monotonic() - started < 5
        assert_one_line(info.value, needle)
