"""One interface over a directory, local or on S3, so readers and writers need not care which.

Datasets are read through it and run dirs are written through it. Stores are shipped to Spark
executors, so they hold only strings and make S3 clients lazily (per process, through
`s3.client`). Every failure is a one-line SparknetError; an absent object is a
`MissingObjectError` whose message names its full path or URI.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

import botocore.exceptions as bx
from boto3.s3.transfer import TransferConfig

from sparknet.data import s3
from sparknet.data.manifest import MANIFEST_NAME, Manifest
from sparknet.data.s3 import MissingObjectError, S3Uri
from sparknet.errors import SparknetError, WriteRefused, is_permanent, no_such_directory

__all__ = [
    "LocalStore",
    "MissingObjectError",
    "S3Store",
    "Store",
    "load_manifest",
    "open_store",
]

#: whole-object downloads: ranged GETs in parallel above the threshold
DOWNLOAD_CONFIG = TransferConfig(
    multipart_threshold=64 << 20, multipart_chunksize=16 << 20, max_concurrency=8
)
#: whole-object uploads (checkpoints, models): multipart in parallel above the threshold
UPLOAD_CONFIG = TransferConfig(
    multipart_threshold=64 << 20, multipart_chunksize=16 << 20, max_concurrency=8
)
#: DeleteObjects takes at most this many keys per call (AWS's documented limit)
_DELETE_BATCH = 1000


@runtime_checkable
class Store(Protocol):
    """A flat directory of named objects (shards and `manifest.json`)."""

    uri: str

    def read_bytes(self, name: str) -> bytes:
        """The whole object; for small ones such as the manifest."""
        ...

    def open(self, name: str, start: int = 0) -> BinaryIO:
        """A stream of the object from byte `start`."""
        ...

    def size(self, name: str) -> int | None:
        """The object's size in bytes, or None when it is not there."""
        ...

    def fetch(self, name: str, dest: Path) -> None:
        """Write the whole object to `dest`, atomically (a reader never sees a partial file)."""
        ...

    def list(self) -> dict[str, int]:
        """Names directly under the directory / prefix and their sizes."""
        ...

    def walk(self, prefix: str = "") -> dict[str, int]:
        """Every object under `prefix` (a name ending in "/", or "" for all), at any depth:
        names relative to the store (with "/" between levels) and their sizes. Empty when the
        directory / prefix is not there."""
        ...

    def entries(self, prefix: str = "") -> set[str]:
        """Names directly under `prefix` (a name ending in "/", or ""): objects and
        directories (S3: common prefixes) alike. Empty when it is not there."""
        ...

    def write_bytes(self, name: str, data: bytes, *, parents: bool = True) -> None:
        """Write the whole object atomically: a reader sees the old object or the new one,
        never part of it. `parents=False`: fail when the local directory it goes into is gone
        (S3 has no directories, so there it changes nothing)."""
        ...

    def delete(self, names: Iterable[str]) -> None:
        """Remove these objects; ones already gone are no error."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Remove everything under `prefix` (a name ending in "/"), directories included."""
        ...


def _temp_beside(dest: Path) -> Path:
    """A hidden temp name next to `dest` (same filesystem, so os.replace is atomic); unique per
    process and call so concurrent fetches of the same object do not collide."""
    return dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


class _Guarded:
    """`guard`, when set, runs before every write or delete and raises to stop it: a run dir's
    store is guarded by its lock's check, so a run that lost its lock writes nothing more."""

    guard: Callable[[], None] | None = None

    def _check_guard(self) -> None:
        if self.guard is not None:
            self.guard()


class LocalStore(_Guarded):
    """A dataset directory on a local (or network-mounted) filesystem."""

    def __init__(self, path: str | Path) -> None:
        self.uri = str(Path(path).expanduser().absolute())

    def __repr__(self) -> str:
        return f"LocalStore({self.uri!r})"

    def _path(self, name: str) -> Path:
        return Path(self.uri) / name

    def _missing(self, name: str) -> MissingObjectError:
        return MissingObjectError(f"{self._path(name)} does not exist")

    def read_bytes(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError as exc:
            raise self._missing(name) from exc

    def open(self, name: str, start: int = 0) -> BinaryIO:
        try:
            f = self._path(name).open("rb")
        except FileNotFoundError as exc:
            raise self._missing(name) from exc
        if start:
            f.seek(start)
        return f

    def size(self, name: str) -> int | None:
        try:
            return self._path(name).stat().st_size
        except FileNotFoundError:
            return None

    def fetch(self, name: str, dest: Path) -> None:
        tmp = _temp_beside(dest)
        try:
            shutil.copyfile(self._path(name), tmp)
            os.replace(tmp, dest)
        except FileNotFoundError as exc:
            if not self._path(name).exists():
                raise self._missing(name) from exc
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def list(self) -> dict[str, int]:
        root = Path(self.uri)
        if not root.is_dir():
            raise SparknetError(f"{root} is not a directory; fix the dataset path")
        out: dict[str, int] = {}
        for entry in os.scandir(root):
            if entry.is_file():
                out[entry.name] = entry.stat().st_size
        return out

    def walk(self, prefix: str = "") -> dict[str, int]:
        root = Path(self.uri)
        out: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(self._path(prefix)):
            for name in files:
                path = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    out[path.relative_to(root).as_posix()] = path.stat().st_size
        return out

    def entries(self, prefix: str = "") -> set[str]:
        try:
            return set(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def write_bytes(self, name: str, data: bytes, *, parents: bool = True) -> None:
        """A full disk, a read-only file system or a permission is one line naming the dir and
        the file (`WriteRefused`, never retried); the temp file never stays."""
        self._check_guard()
        dest = self._path(name)
        tmp = _temp_beside(dest)
        try:
            if parents:
                dest.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, dest)
        except OSError as exc:
            if is_permanent(exc):
                raise WriteRefused(self.uri, name, exc) from exc
            raise
        finally:
            with contextlib.suppress(OSError):  # on a read-only one even this refuses: not why
                tmp.unlink(missing_ok=True)

    def delete(self, names: Iterable[str]) -> None:
        self._check_guard()
        for name in names:
            self._path(name).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        self._check_guard()
        shutil.rmtree(self._path(prefix), ignore_errors=True)


class S3Store(_Guarded):
    """A dataset under an S3 prefix (any S3-compatible store, through `endpoint_url`)."""

    def __init__(self, uri: str, endpoint_url: str | None = None) -> None:
        parsed = S3Uri.parse(uri)
        self._root = S3Uri(parsed.bucket, parsed.key.strip("/"))
        self.uri = str(self._root) if self._root.key else f"s3://{self._root.bucket}"
        self.endpoint_url = endpoint_url

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint_url={self.endpoint_url!r})"

    def _client(self) -> Any:
        return s3.client(self.endpoint_url)

    def object_uri(self, name: str) -> S3Uri:
        """The full URI of object `name` in this store."""
        return self._root.child(name)

    def read_bytes(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def open(self, name: str, start: int = 0) -> BinaryIO:
        return s3.open_object(self.object_uri(name), start, self.endpoint_url)

    def head(self, name: str, *, checksum: bool = False) -> dict[str, Any] | None:
        """`HeadObject` of `name` (size, ETag, metadata; with `checksum`, the checksum S3 computed
        over the bytes it received), or None when it is not there.

        A HEAD error has no body, so a missing bucket also reads as "not there" here; the
        manifest is read with GET first (see `load_manifest`), which does tell them apart. A 403
        is "not there" when a list of the key finds nothing (`s3.describe_read_error`).
        """
        where = self.object_uri(name)
        extra = {"ChecksumMode": "ENABLED"} if checksum else {}
        try:
            return self._client().head_object(Bucket=where.bucket, Key=where.key, **extra)
        except (bx.BotoCoreError, bx.ClientError) as exc:
            err = s3.describe_read_error(exc, where, self._client())
            if isinstance(err, MissingObjectError):
                return None
            raise err from exc

    def size(self, name: str) -> int | None:
        head = self.head(name)
        return None if head is None else int(head["ContentLength"])

    def fetch(self, name: str, dest: Path) -> None:
        where = self.object_uri(name)
        tmp = _temp_beside(dest)
        try:
            self._client().download_file(where.bucket, where.key, str(tmp), Config=DOWNLOAD_CONFIG)
            os.replace(tmp, dest)
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_read_error(exc, where, self._client()) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def _pages(self, prefix: str, delimiter: bool) -> Iterator[dict[str, Any]]:
        """ListObjectsV2 pages under `prefix` (relative to the store); with `delimiter`, one
        level only (deeper names come as CommonPrefixes)."""
        args = {"Bucket": self._root.bucket, "Prefix": self._key_prefix + prefix}
        try:
            pages = (
                self._client()
                .get_paginator("list_objects_v2")
                .paginate(**args, **({"Delimiter": "/"} if delimiter else {}))
            )
            yield from pages
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_client_error(exc, self.uri) from exc

    @property
    def _key_prefix(self) -> str:
        return f"{self._root.key}/" if self._root.key else ""

    def _objects(self, prefix: str, delimiter: bool) -> dict[str, int]:
        cut = len(self._key_prefix)
        return {
            obj["Key"][cut:]: int(obj["Size"])
            for page in self._pages(prefix, delimiter)
            for obj in page.get("Contents", [])
        }

    def list(self) -> dict[str, int]:
        return self._objects("", delimiter=True)

    def walk(self, prefix: str = "") -> dict[str, int]:
        return self._objects(prefix, delimiter=False)

    def is_empty(self) -> bool:
        """Whether no object's key starts with this store's (an object or a dir of them is
        there otherwise): one ListObjectsV2 of one key, however many there are."""
        args = {"Bucket": self._root.bucket, "Prefix": self._root.key, "MaxKeys": 1}
        try:
            return not self._client().list_objects_v2(**args).get("Contents")
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_client_error(exc, self.uri) from exc

    def entries(self, prefix: str = "") -> set[str]:
        cut = len(self._key_prefix + prefix)
        out: set[str] = set()
        for page in self._pages(prefix, delimiter=True):
            out.update(obj["Key"][cut:] for obj in page.get("Contents", []))
            out.update(p["Prefix"][cut:].rstrip("/") for p in page.get("CommonPrefixes", []))
        return out

    def write_bytes(self, name: str, data: bytes, *, parents: bool = True) -> None:
        """One PUT (multipart above the threshold: S3 shows the object only once it completes)."""
        self._check_guard()
        where = self.object_uri(name)
        try:
            self._client().upload_fileobj(
                io.BytesIO(data), where.bucket, where.key, Config=UPLOAD_CONFIG
            )
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_client_error(exc, where) from exc

    def delete(self, names: Iterable[str]) -> None:
        self._check_guard()
        keys = [self.object_uri(n).key for n in names]
        try:
            for i in range(0, len(keys), _DELETE_BATCH):
                batch = [{"Key": k} for k in keys[i : i + _DELETE_BATCH]]
                answer = self._client().delete_objects(
                    Bucket=self._root.bucket, Delete={"Objects": batch, "Quiet": True}
                )
                for err in answer.get("Errors", []):
                    raise bx.ClientError({"Error": err}, "DeleteObjects")
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_client_error(exc, self.uri) from exc

    def delete_prefix(self, prefix: str) -> None:
        self.delete(self.walk(prefix))


#: the object that marks a dataset that many tasks wrote whole, written last (as Hadoop's
#: committers do): `sparknet predict`'s to S3, with its row count
SUCCESS = "_SUCCESS"


def open_store(uri_or_path: str | Path, endpoint_url: str | None = None) -> Store:
    """`s3://...` is an S3Store; anything else (a path, or `file://...`) a LocalStore."""
    text = str(uri_or_path)
    if text.startswith("s3://"):
        return S3Store(text, endpoint_url)
    if "://" in text and not text.startswith("file://"):
        raise SparknetError(
            f"{text!r}: only s3:// URIs and local paths are supported as dataset locations"
        )
    if text.startswith("file://"):
        text = text[len("file://") :]
    return LocalStore(text)


def writable_store(where: str, endpoint_url: str | None = None) -> Store:
    """The store at `where` (a dir or an `s3://` prefix), once a probe object was written there
    and deleted: a place that cannot take a file (a path under a file, a missing bucket, no
    permission) is one line now, before a long job whose result would go there."""
    store = open_store(where, endpoint_url)
    probe = f".sparknet-probe-{uuid.uuid4().hex[:8]}"
    try:
        store.write_bytes(probe, b"")
        store.delete([probe])
    except OSError as exc:  # a store's own refusals are SparknetErrors that say where
        raise SparknetError(f"{where} is not writable: {exc.strerror or exc}") from exc
    return store


def load_manifest(store: Store) -> Manifest:
    """Read and check the dataset's manifest; the driver calls this before training starts, so a
    wrong URI, a missing bucket or bad credentials fail at once with one line."""
    if isinstance(store, LocalStore) and not Path(store.uri).is_dir():
        if not Path(store.uri).exists():
            raise no_such_directory(store.uri)
        raise SparknetError(f"{store.uri} is not a directory; fix the dataset path")
    try:
        text = store.read_bytes(MANIFEST_NAME)
    except MissingObjectError as exc:
        if isinstance(store, LocalStore):
            raise SparknetError(
                f"{store.uri} has no {MANIFEST_NAME}: not a sparknet dataset, or `sparknet data "
                "shard` did not finish writing it; run `sparknet data shard` (again)"
            ) from exc
        raise SparknetError(
            f"{store.uri} has no {MANIFEST_NAME}: not a sparknet dataset, or its upload did not "
            "finish; run `sparknet data upload` again"
        ) from exc
    return Manifest.loads(text, where=f"{store.uri}/{MANIFEST_NAME}")
