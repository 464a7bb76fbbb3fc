"""Dataset operations behind `sparknet data upload / verify / ls`, returning small reports.

An upload writes every shard first and `manifest.json` last, only after all shards succeeded:
readers refuse a prefix without a manifest, so an interrupted upload is never taken for a dataset,
and running the upload again sends only what is missing or different. Each object carries its
sha256 in its metadata (read by the pre-flight check before training) and is sent with S3's own
SHA256 checksum, which S3 computes over the bytes it received: a shard is skipped only when that
checksum is the one the local file gives, so an object whose bytes were replaced (what `verify`
calls bad) is sent again even when its size and metadata still look right.
"""

from __future__ import annotations

import base64
import hashlib
import re
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3.exceptions
import botocore.exceptions as bx
from boto3.s3.transfer import TransferConfig

from sparknet import aws
from sparknet.data import s3
from sparknet.data.integrity import all_shards, shard_problems
from sparknet.data.manifest import (
    MANIFEST_NAME,
    SHARD_PATTERN,
    Manifest,
    ShardInfo,
    sha256_file,
    sha256_stream,
)
from sparknet.data.shards import reading_lock
from sparknet.data.store import MissingObjectError, S3Store, Store, load_manifest, open_store
from sparknet.errors import SparknetError

Progress = Callable[[int], None]

_SHARD = re.compile(SHARD_PATTERN)
MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNKSIZE = 16 << 20
#: an unfinished multipart upload started longer ago than this is taken for a killed one
MULTIPART_STALE_SECONDS = 3600


@dataclass(frozen=True)
class UploadReport:
    """Shard names uploaded now and skipped (already there, same size and sha256), in manifest
    order; `bytes_uploaded` counts the uploaded shards' bytes (not the manifest); `removed`, the
    shards of an earlier upload that the new manifest does not name (deleted, sorted); `left`,
    objects under the prefix named like shards that sparknet did not write (not touched);
    `warnings`, one line each for what could not be cleaned up (the dataset itself is good)."""

    uploaded: list[str]
    skipped: list[str]
    bytes_uploaded: int
    removed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VerifyReport:
    """How many shards were checked, and one line per problem (empty when the dataset is good)."""

    checked: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class SplitSummary:
    split: str
    shards: int
    samples: int
    bytes: int


@dataclass(frozen=True)
class Listing:
    """What `sparknet data ls` shows; `missing` are shards in the manifest but not in the store."""

    uri: str
    num_classes: int
    splits: list[SplitSummary]
    missing: list[str]


class _LockedProgress:
    """Serialises progress callbacks coming from transfer threads, so callers (a progress bar)
    need not be thread-safe."""

    def __init__(self, callback: Progress | None) -> None:
        self._callback = callback
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if self._callback is not None and n:
            with self._lock:
                self._callback(n)


def _local_problem(src: Path, info: ShardInfo) -> str | None:
    """Why the local shard is not the manifest's (missing, size, sha256), or None."""
    path = src / info.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    if size != info.bytes:
        return f"{path} has {size} bytes, the manifest says {info.bytes}"
    if sha256_file(path) != info.sha256:
        return f"{path} does not match its sha256 in the manifest"
    return None


def _check_local(src: Path, shards: list[ShardInfo], threads: int) -> None:
    """Every listed shard is there with the manifest's size and sha256, or one line naming what
    is not: the upload tags each object with the manifest's sha256, so bytes that differ from
    it must never be sent (nor replace a good remote copy)."""
    problems = shard_problems(shards, lambda i: _local_problem(src, i), threads)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SparknetError(
            f"{problems[0]}{more}; the local dataset does not match its manifest: "
            "re-create it with `sparknet data shard`"
        )


def _listed(store: S3Store, dest_uri: str) -> dict[str, int]:
    """The objects under the upload's prefix; a missing bucket says how the upload makes it."""
    try:
        return store.list()
    except s3.MissingBucketError as exc:
        try:
            aws.check_bucket_name(exc.bucket)
        except ValueError as bad:  # no bucket, and none could be made of that name
            raise SparknetError(f"{bad}; fix the URI ({dest_uri})") from exc
        raise SparknetError(
            "bucket {bucket} does not exist: pass {@create_bucket} (and {@region}) to make it "
            "with the settings `sparknet cluster up` gives a bucket (encrypted, never public, "
            "TLS only), or fix the URI ({uri})",
            bucket=exc.bucket,
            uri=dest_uri,
        ) from exc


def upload_dataset(
    src_dir: Path,
    dest_uri: str,
    *,
    endpoint_url: str | None = None,
    max_concurrency: int = 8,
    on_progress: Progress | None = None,
    multipart_threshold: int = MULTIPART_THRESHOLD,
    multipart_chunksize: int = MULTIPART_CHUNKSIZE,
    force: bool = False,
) -> UploadReport:
    """Upload a local dataset directory to an S3 prefix; the manifest goes last.

    The dataset dir's shard lock is held (shared) throughout, so a concurrent `data shard` cannot
    rewrite a shard between its hash and its send (and one running refuses the upload).
    Every local shard is hashed first: one whose bytes differ from the manifest is refused
    (re-run `data shard`), so no object is ever tagged with a sha256 its bytes do not have.

    Shards already there with the same bytes (size, sha256 metadata and S3's checksum, see the
    module docstring) are skipped, so re-running an interrupted upload finishes it; `force`
    sends every shard. An existing manifest at the destination is deleted before
    any shard is replaced, so readers never pair an old manifest with new shards.
    `on_progress(n)` gets byte increments (from several threads, serialised): bytes as they are
    sent (boto3 may report a negative amount when it retries a part) and a skipped shard's full
    size, so a bar sized to the manifest's total bytes ends full.
    """
    src = Path(src_dir)
    manifest_path = src / MANIFEST_NAME
    if not manifest_path.is_file():
        raise SparknetError(
            f"{manifest_path} not found: make the dataset with `sparknet data shard` first"
        )
    with reading_lock(src):  # no `data shard` rewrites a shard while it is hashed and sent
        manifest_bytes = manifest_path.read_bytes()
        manifest = Manifest.loads(manifest_bytes, where=str(manifest_path))
        shards = all_shards(manifest)
        _check_local(src, shards, max_concurrency)
        if not dest_uri.startswith("s3://"):
            raise SparknetError(f"upload destination {dest_uri!r} must be an s3:// URI")
        store = S3Store(dest_uri, endpoint_url)
        s3.check_reachable(store.object_uri(MANIFEST_NAME), endpoint_url)
        progress = _LockedProgress(on_progress)

        remote = _listed(store, dest_uri)  # fails fast (one line): no bucket, bad credentials
        parts = (multipart_threshold, multipart_chunksize)
        candidates = [] if force else [i for i in shards if remote.get(i.name) == i.bytes]
        with ThreadPoolExecutor(max_workers=max(1, max_concurrency)) as pool:
            same = dict(
                zip(
                    [i.name for i in candidates],
                    pool.map(lambda i: _already_there(store, src / i.name, i, parts), candidates),
                    strict=True,
                )
            )
        todo: list[ShardInfo] = []
        skipped: list[str] = []
        for info in shards:
            if same.get(info.name):
                skipped.append(info.name)
                progress(info.bytes)
            else:
                todo.append(info)

        s3c = s3.client(endpoint_url)
        manifest_uri = store.object_uri(MANIFEST_NAME)
        try:
            old_manifest = store.read_bytes(MANIFEST_NAME) if MANIFEST_NAME in remote else None
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_client_error(exc, manifest_uri) from exc
        old_names = _shard_names(old_manifest)
        orphans, left = _orphans(store, remote, manifest, old_names)
        ours = {info.name for info in shards} | old_names | set(orphans)
        warnings = _abort_incomplete(s3c, store, ours)
        try:
            if old_manifest is not None and (todo or old_manifest != manifest_bytes):
                s3c.delete_object(Bucket=manifest_uri.bucket, Key=manifest_uri.key)
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_client_error(exc, manifest_uri) from exc

        uploaded = _upload_shards(
            s3c,
            store,
            src,
            todo,
            max_concurrency=max_concurrency,
            progress=progress,
            config_args={
                "multipart_threshold": multipart_threshold,
                "multipart_chunksize": multipart_chunksize,
            },
        )
        try:
            s3c.put_object(
                Bucket=manifest_uri.bucket,
                Key=manifest_uri.key,
                Body=manifest_bytes,
                ContentType="application/json",
            )
        except (bx.BotoCoreError, bx.ClientError) as exc:
            raise s3.describe_client_error(exc, manifest_uri) from exc
        removed, not_removed = _remove_orphans(s3c, store, orphans)
        return UploadReport(
            uploaded=uploaded,
            skipped=skipped,
            bytes_uploaded=sum(info.bytes for info in todo),
            removed=removed,
            left=left,
            warnings=warnings + not_removed,
        )


def _shard_names(manifest_bytes: bytes | None) -> set[str]:
    """The shard names a remote manifest lists (none when there is none, or it does not parse:
    then only the split rule of `_orphans` vouches for an object)."""
    if manifest_bytes is None:
        return set()
    try:
        return {info.name for info in all_shards(Manifest.loads(manifest_bytes, where="remote"))}
    except (SparknetError, ValueError):
        return set()


def _orphans(
    store: S3Store, remote: dict[str, int], manifest: Manifest, old_names: set[str]
) -> tuple[list[str], list[str]]:
    """Objects named like shards that the new manifest does not name, split into sparknet's
    (to delete) and others (left alone, listed). Sparknet's carry the sha256 metadata every
    upload sets and either belong to one of the manifest's splits or are named by the remote
    manifest being replaced: a user's `backup-000001.tar` next to the dataset is not ours."""
    ours: list[str] = []
    others: list[str] = []
    keep = {info.name for info in all_shards(manifest)}
    for name in sorted(n for n in remote if _SHARD.match(n) and n not in keep):
        split = name.rsplit("-", 1)[0]
        head = store.head(name) if split in manifest.splits or name in old_names else None
        tagged = head is not None and "sha256" in head.get("Metadata", {})
        (ours if tagged else others).append(name)
    return ours, others


def _remove_orphans(s3c: Any, store: S3Store, orphans: list[str]) -> tuple[list[str], list[str]]:
    """Delete shards an earlier upload left that the manifest just written does not name (a
    re-shard into fewer shards). Runs after that manifest is in place: no reader's manifest
    names them any more. Returns (deleted, warnings): a failed delete (no s3:DeleteObject) is a
    warning naming what is left, since the dataset itself is complete."""
    removed: list[str] = []
    failed: list[tuple[str, str]] = []
    for name in orphans:
        where = store.object_uri(name)
        try:
            s3c.delete_object(Bucket=where.bucket, Key=where.key)
            removed.append(name)
        except (bx.BotoCoreError, bx.ClientError) as exc:
            failed.append((name, str(s3.describe_client_error(exc, where)).split(";")[0]))
    if not failed:
        return removed, []
    names = ", ".join(name for name, _ in failed)
    return removed, [
        f"warning: {len(failed)} old shards the manifest no longer names could not be deleted "
        f"({failed[0][1]}): {names}; the dataset is complete, delete them by hand"
    ]


def _abort_incomplete(s3c: Any, store: S3Store, names: set[str]) -> list[str]:
    """Abort the unfinished multipart uploads of these shard names (an upload killed mid-file
    leaves its parts, which S3 keeps and bills until aborted) that were initiated more than
    MULTIPART_STALE_SECONDS ago: a younger one may be another machine's live upload, and a part
    file never takes that long. Returns warnings: without s3:ListBucketMultipartUploads none can
    be found, which must not stop the upload itself."""
    keys = {store.object_uri(name).key for name in names}
    cutoff = _now() - timedelta(seconds=MULTIPART_STALE_SECONDS)
    bucket = store.object_uri(MANIFEST_NAME).bucket
    prefix = store.object_uri(MANIFEST_NAME).key[: -len(MANIFEST_NAME)]
    where = f"s3://{bucket}/{prefix}"
    try:
        for page in s3c.get_paginator("list_multipart_uploads").paginate(
            Bucket=bucket, Prefix=prefix
        ):
            for upload in page.get("Uploads", []):
                if upload["Key"] in keys and upload["Initiated"] < cutoff:
                    s3c.abort_multipart_upload(
                        Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
    except bx.ClientError as exc:
        if not _denied(exc):
            raise s3.describe_client_error(exc, where) from exc
        return [
            f"warning: listing or aborting unfinished multipart uploads under {where} was denied "
            f"({exc.response['Error'].get('Code')}); parts a killed upload left (billed until "
            "aborted) cannot be cleaned: allow s3:ListBucketMultipartUploads and "
            "s3:AbortMultipartUpload"
        ]
    except bx.BotoCoreError as exc:
        raise s3.describe_client_error(exc, where) from exc
    return []


def _now() -> datetime:
    return datetime.now(UTC)


def _denied(exc: bx.ClientError) -> bool:
    """Whether S3 refused the call for lack of permission (not bad credentials)."""
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code not in aws.CREDENTIAL_CODES and (code in aws.DENIED_CODES or status == 403)


def _s3_checksum(path: Path, info: ShardInfo, parts: tuple[int, int]) -> str:
    """The SHA256 checksum S3 reports for `path` uploaded as `upload_file` sends it: of the
    whole object below the multipart threshold (the manifest's sha256, no read needed), else
    the composite, the SHA256 of the parts' SHA256s (one read of the local file)."""
    threshold, chunksize = parts
    if info.bytes < threshold:
        return base64.b64encode(bytes.fromhex(info.sha256)).decode()
    digests = b""
    with open(path, "rb") as f:
        while part := f.read(chunksize):
            digests += hashlib.sha256(part).digest()
    return base64.b64encode(hashlib.sha256(digests).digest()).decode()


def _already_there(store: S3Store, path: Path, info: ShardInfo, parts: tuple[int, int]) -> bool:
    """Whether the object holds exactly the local shard's bytes, as far as S3's own checksum
    tells: an object from an older upload (no SHA256 checksum), or one replaced since, is not."""
    head = store.head(info.name, checksum=True)
    if head is None or int(head["ContentLength"]) != info.bytes:
        return False
    if head.get("Metadata", {}).get("sha256") != info.sha256:
        return False
    remote = str(head.get("ChecksumSHA256") or "").split("-")[0]  # AWS adds -N to a composite
    return remote == _s3_checksum(path, info, parts)


def _upload_shards(
    s3c: Any,
    store: S3Store,
    src: Path,
    todo: list[ShardInfo],
    *,
    max_concurrency: int,
    progress: _LockedProgress,
    config_args: dict[str, int],
) -> list[str]:
    """Upload `todo` in parallel; on the first failure, start nothing new, let running uploads
    finish, and raise one line that says how to resume. Returns the names uploaded."""
    if not todo:
        return []
    files = max(1, min(max_concurrency, len(todo)))
    # split the connections between files in flight and parts of one file (one big file: all)
    config = TransferConfig(max_concurrency=max(1, max_concurrency // files), **config_args)

    stop = threading.Event()  # set by the first failure: queued uploads then do not start

    def one(info: ShardInfo) -> str | None:
        if stop.is_set():
            return None
        where = store.object_uri(info.name)
        s3c.upload_file(
            str(src / info.name),
            where.bucket,
            where.key,
            ExtraArgs={"Metadata": {"sha256": info.sha256}, "ChecksumAlgorithm": "SHA256"},
            Config=config,
            Callback=progress,
        )
        return info.name

    def stop_on_failure(future: Future[str | None]) -> None:
        # runs in the worker thread as the upload ends, before that worker takes the next one
        if not future.cancelled() and future.exception() is not None:
            stop.set()

    pool = ThreadPoolExecutor(max_workers=files, thread_name_prefix="sparknet-upload")
    futures: dict[Future[str | None], ShardInfo] = {}
    for info in todo:
        future = pool.submit(one, info)
        future.add_done_callback(stop_on_failure)
        futures[future] = info
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:  # also on Ctrl-C: start nothing new, let running uploads end
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    finished = {
        f.result() for f in futures if not f.cancelled() and f.exception() is None and f.result()
    }
    failed = [
        (info, f.exception())
        for f, info in futures.items()
        if f.done() and not f.cancelled() and f.exception() is not None
    ]
    if failed:
        info, exc = min(failed, key=lambda pair: todo.index(pair[0]))
        assert exc is not None
        if isinstance(exc, (bx.BotoCoreError, bx.ClientError, boto3.exceptions.Boto3Error)):
            reason: object = s3.describe_client_error(exc, store.object_uri(info.name))
        elif isinstance(exc, OSError):
            reason = f"reading {src / info.name} failed: {exc}"
        else:
            raise exc
        raise SparknetError(
            "{reason}; {finished} of {todo} shards were uploaded and no manifest was written: run "
            "`sparknet data upload` again to finish (finished shards are skipped)",
            reason=reason,
            finished=len(finished),
            todo=len(todo),
        ) from exc
    return [info.name for info in todo if info.name in finished]


def _hash_object(store: Store, info: ShardInfo, progress: _LockedProgress) -> str:
    with store.open(info.name) as f:
        return sha256_stream(f, progress)


def _metadata_problem(store: Store, info: ShardInfo) -> str | None:
    """An S3 object's sha256 metadata (what training's pre-flight check reads) must be the
    manifest's: training refuses one that is not, so verify must not call it good."""
    if not isinstance(store, S3Store):
        return None
    head = store.head(info.name)
    if head is None:
        return f"{info.name}: missing"
    tagged = head.get("Metadata", {}).get("sha256")
    if tagged not in (None, info.sha256):
        return (
            f"{info.name}: its sha256 metadata differs from the manifest "
            "(upload it again: `sparknet data upload`)"
        )
    return None


def _reachable(store: Store) -> Store:
    """`store`, once an S3 endpoint is known to answer (`s3.check_reachable`)."""
    if isinstance(store, S3Store):
        s3.check_reachable(store.object_uri(MANIFEST_NAME), store.endpoint_url)
    return store


def verify_dataset(
    uri: str,
    *,
    endpoint_url: str | None = None,
    on_progress: Progress | None = None,
    on_total: Progress | None = None,
    max_concurrency: int = 4,
) -> VerifyReport:
    """Check every shard's size and sha256 (streamed) against the manifest, local or S3, and on
    S3 the sha256 metadata training's pre-flight check reads.

    Problems are one line each, in manifest order; failures that are not about one shard
    (credentials, network) raise a SparknetError instead. `on_total(n)` gets the bytes there are
    to hash (the manifest's), once, before `on_progress(n)` gets bytes hashed.
    """
    store = _reachable(open_store(uri, endpoint_url))
    manifest = load_manifest(store)
    shards = all_shards(manifest)
    if on_total is not None:
        on_total(sum(info.bytes for info in shards))
    present = store.list()
    progress = _LockedProgress(on_progress)

    def check(info: ShardInfo) -> str | None:
        size = present.get(info.name)
        if size is None:
            return f"{info.name}: missing"
        if size != info.bytes:
            return f"{info.name}: size {size}, manifest says {info.bytes}"
        try:
            digest = _hash_object(store, info, progress)
        except MissingObjectError:  # deleted since the listing
            return f"{info.name}: missing"
        if digest != info.sha256:
            return f"{info.name}: sha256 differs from the manifest"
        return _metadata_problem(store, info)

    with ThreadPoolExecutor(max_workers=max(1, max_concurrency)) as pool:
        results = list(pool.map(check, shards))
    return VerifyReport(checked=len(shards), problems=[p for p in results if p is not None])


def list_dataset(uri: str, *, endpoint_url: str | None = None) -> Listing:
    """Per-split shard counts, samples and bytes from the manifest, plus shards that are absent."""
    store = _reachable(open_store(uri, endpoint_url))
    manifest = load_manifest(store)
    present = store.list()
    splits = [
        SplitSummary(
            split=name,
            shards=len(shards),
            samples=sum(s.samples for s in shards),
            bytes=sum(s.bytes for s in shards),
        )
        for name, shards in manifest.splits.items()
    ]
    missing = [info.name for info in all_shards(manifest) if info.name not in present]
    return Listing(uri=store.uri, num_classes=manifest.num_classes, splits=splits, missing=missing)
