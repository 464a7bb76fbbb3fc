"""Shard bytes are checked against the manifest before any sample of them is trained on.

Two checks, at two times:
- `check_present`, on the driver before Spark starts: every shard is there with the manifest's
  size (one stat or `HeadObject` each, in parallel), and an S3 object's sha256 metadata (written
  by `sparknet data upload`) agrees with the manifest. A missing or replaced shard fails at once
  in one line, not after minutes of Spark retries.
- `open_verified`, in the task: the shard's size and sha256 are checked on every path before its
  bytes reach the reader. A local dataset is hashed in place once per Python worker process (and
  again if the file changes); an S3 shard is checked as it enters the executor's cache, or, with
  no cache, spooled to an anonymous temp file while it is hashed. A mismatch there is a
  `PermanentTaskError`: no retry can heal it, so the run fails at once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, BinaryIO

from sparknet.data.manifest import Manifest, ShardInfo
from sparknet.data.store import LocalStore, MissingObjectError, S3Store, Store
from sparknet.errors import PermanentTaskError, SparknetError

if TYPE_CHECKING:
    from sparknet.data.cache import ShardCache

_CHUNK = 1 << 20
#: parallel HeadObject calls of the pre-flight check (the S3 client's pool has 32 connections)
HEAD_THREADS = 16

#: local shard files already hashed by this process: (path, device, inode, size, mtime) -> sha256
_hashed: dict[tuple, str] = {}
_hashed_lock = threading.Lock()


def fix_hint(store: Store) -> str:
    """What to do about a shard that does not match the manifest: a local dataset is made by
    `data shard` (nothing was uploaded), an S3 one by `data upload`."""
    if isinstance(store, LocalStore):
        return (
            f"re-create the dataset with `sparknet data shard` (`sparknet data verify "
            f"{store.uri}` lists every bad shard)"
        )
    return (
        f"run `sparknet data verify {store.uri}` and upload it again (`sparknet data upload`), "
        "or re-create it with `sparknet data shard`"
    )


def bad_shard(store: Store, info: ShardInfo, problem: str) -> PermanentTaskError:
    return PermanentTaskError(f"shard {store.uri}/{info.name} {problem}; {fix_hint(store)}")


def all_shards(manifest: Manifest) -> list[ShardInfo]:
    """Every shard of every split once, in manifest order."""
    seen: dict[str, ShardInfo] = {}
    for shards in manifest.splits.values():
        for info in shards:
            seen.setdefault(info.name, info)
    return list(seen.values())


# ---- on the driver, before Spark starts ---------------------------------------------------------


def _head_problem(store: Store, info: ShardInfo) -> str | None:
    """Why `info` is not usable as the store holds it (missing, size, sha256 metadata), or None."""
    if isinstance(store, S3Store):
        head: dict[str, Any] | None = store.head(info.name)
        size = None if head is None else int(head["ContentLength"])
        meta = {} if head is None else head.get("Metadata", {})
    else:
        size, meta = store.size(info.name), {}
    if size is None:
        return f"{info.name} is missing"
    if size != info.bytes:
        return f"{info.name} has {size} bytes, the manifest says {info.bytes}"
    if meta.get("sha256") not in (None, info.sha256):
        return f"{info.name} was uploaded with another sha256 than the manifest's"
    return None


def shard_problems(
    shards: list[ShardInfo], check: Callable[[ShardInfo], str | None], threads: int
) -> list[str]:
    """`check` of every shard on up to `threads` threads (each is one HEAD or one file read, so
    they overlap well); the problems it found, in manifest order."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(shards)))) as pool:
        return [p for p in pool.map(check, shards) if p]


class DatasetMismatch(SparknetError):
    """The dataset's shards differ from its manifest; the message begins with the dataset's
    URI, so a caller that names the dataset itself does not name it twice."""


def check_present(store: Store, manifest: Manifest) -> None:
    """Every shard of `manifest` is in `store` with its size (and sha256 metadata on S3), or one
    line naming the first bad one, how many there are, and what to do."""
    problems = shard_problems(all_shards(manifest), lambda i: _head_problem(store, i), HEAD_THREADS)
    if problems:
        more = f" (and {len(problems) - 1} more shards)" if len(problems) > 1 else ""
        raise DatasetMismatch(
            "dataset {uri} does not match its manifest: {problem}{more}; {fix}",
            uri=store.uri, problem=problems[0], more=more, fix=fix_hint(store),
        )  # fmt: skip


# ---- in the task --------------------------------------------------------------------------------


def sha256_once(f: BinaryIO, key: tuple) -> str:
    """The sha256 of an open file from its start, hashed only the first time this process meets
    `key` (the file's identity from its stat); the file is left at its start."""
    with _hashed_lock:
        known = _hashed.get(key)
    if known is None:
        digest = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        known = digest.hexdigest()
        remember_hash(key, known)
        f.seek(0)
    return known


def remember_hash(key: tuple, digest: str) -> None:
    """Record a file's sha256 already checked (e.g. while it was fetched), so it is not re-read."""
    with _hashed_lock:
        _hashed[key] = digest


def _check_local(store: LocalStore, info: ShardInfo, f: BinaryIO) -> None:
    """Hash an open local shard unless this process already hashed this very file."""
    st = os.fstat(f.fileno())
    if st.st_size != info.bytes:
        raise bad_shard(store, info, f"has {st.st_size} bytes, the manifest says {info.bytes}")
    key = (store.uri, info.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if sha256_once(f, key) != info.sha256:
        raise bad_shard(store, info, "does not match its sha256 in the manifest")


def _spooled(store: Store, info: ShardInfo) -> BinaryIO:
    """The shard's bytes in an anonymous temp file, checked while they were copied there."""
    out = tempfile.TemporaryFile(prefix="sparknet-shard-")  # noqa: SIM115 (returned open)
    try:
        digest, size = hashlib.sha256(), 0
        with store.open(info.name) as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        if size != info.bytes:
            raise bad_shard(store, info, f"has {size} bytes, the manifest says {info.bytes}")
        if digest.hexdigest() != info.sha256:
            raise bad_shard(store, info, "does not match its sha256 in the manifest")
        out.seek(0)
        return out  # type: ignore[return-value]
    except BaseException:
        out.close()
        raise


def open_verified(store: Store, info: ShardInfo, cache: ShardCache | None) -> BinaryIO:
    """A stream of the shard's bytes from the start, checked against `info` before it is handed
    out. `cache` is used for a remote store (a local dataset is read in place)."""
    try:
        if isinstance(store, LocalStore):
            f = store.open(info.name)
            try:
                _check_local(store, info, f)
            except BaseException:
                f.close()
                raise
            return f
        if cache is not None:
            return open(cache.path(store, info), "rb")
        return _spooled(store, info)
    except MissingObjectError as exc:
        raise PermanentTaskError("{cause}; {fix}", cause=exc, fix=fix_hint(store)) from exc


def forget_hashes() -> None:
    """Drop what this process remembers about hashed local files (tests)."""
    with _hashed_lock:
        _hashed.clear()
