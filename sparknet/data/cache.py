"""A size-capped local disk cache of shards, shared by the processes of one machine.

Executors read each shard many times (once per epoch); fetching it once and reading it from local
disk afterwards keeps S3 traffic to one pass. A fetched shard is checked against the manifest's
size and sha256 before it enters the cache, so a corrupt or replaced upload fails with its name
instead of training on wrong bytes; a cache hit is hashed again once per process, so a cached
file damaged on disk is fetched again rather than trained on.

The cache lives in a subdirectory sparknet owns (`CACHE_SUBDIR`) of the directory the user names,
and eviction touches only names of the two forms it writes (`_CACHED`, `_TEMP`): a user's own
files next to it, or in it, are never taken for cached shards.

Several Python workers share one root: every write goes to a temp name unique to its process and
is renamed into place (atomic) and eviction tolerates files another process removed first. Files
whose names start with "." are in-flight temps: they count against the cap but are not evicted,
unless their writer is gone (a process killed mid-fetch) or they have been idle for an hour.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
import uuid
from pathlib import Path

from sparknet.data.integrity import bad_shard, remember_hash, sha256_once
from sparknet.data.manifest import SHARD_PATTERN, ShardInfo, sha256_file
from sparknet.data.store import Store
from sparknet.errors import SparknetError


def _identity(st: os.stat_result, path: Path) -> tuple:
    """A cached file's identity for the hash memo. Not its mtime: every hit touches that (LRU);
    a cache file is only ever replaced by a rename, which gives a new inode."""
    return ("cache", str(path), st.st_dev, st.st_ino, st.st_size)


#: the subdirectory of the user's cache dir that holds the cache (nothing else is touched)
CACHE_SUBDIR = "sparknet-shards"
_SHARD_NAME = SHARD_PATTERN.removeprefix("^").removesuffix("$")
#: a cached shard: `<store key>-<sha256 prefix>-<shard name>` (`ShardCache.file_name`)
_CACHED = re.compile(rf"^[0-9a-f]{{12}}-[0-9a-f]{{16}}-{_SHARD_NAME}$")
#: an in-flight temp: `.<cached name>.<pid>.<8 hex>.tmp`, once more for a fetch's own temp
_TEMP = re.compile(
    rf"^\.\.?[0-9a-f]{{12}}-[0-9a-f]{{16}}-{_SHARD_NAME}(\.\d+\.[0-9a-f]{{8}}\.tmp){{1,2}}$"
)

#: a temp not written to for this long is abandoned, whoever holds its PID now
TEMP_IDLE_SECONDS = 3600
#: the writer's PID in a temp name: `.<name>.<pid>.<8 hex>.tmp` (a fetch's own temp nests one)
_TEMP_PID = re.compile(r"\.(\d+)\.[0-9a-f]{8}\.tmp$")


def _abandoned(name: str, st: os.stat_result) -> bool:
    """Whether a dot-temp was left by a writer that is gone (`kill -9` mid-fetch) or has been
    idle past TEMP_IDLE_SECONDS (a PID can be reused)."""
    match = _TEMP_PID.search(name)
    if match is None or not _TEMP.match(name):
        return False  # not one of ours
    if time.time() - st.st_mtime > TEMP_IDLE_SECONDS:
        return True
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def store_key(store: Store) -> str:
    """A short stable name for a store, so two datasets with equal shard names do not collide."""
    return hashlib.sha256(store.uri.encode()).hexdigest()[:12]


class ShardCache:
    """Local copies of shards under `cache_dir`/CACHE_SUBDIR (`root`), at most `cap_bytes` in
    total (least recently used are evicted first; a single shard larger than the cap is still
    kept while it is the newest).

    Picklable (a path and an int), so it can travel to executors with the task.
    """

    def __init__(self, cache_dir: Path, cap_bytes: int) -> None:
        if cap_bytes <= 0:
            raise SparknetError(f"the shard cache size must be positive, not {cap_bytes} bytes")
        self.root = Path(cache_dir) / CACHE_SUBDIR
        self.cap_bytes = cap_bytes

    def __repr__(self) -> str:
        return f"ShardCache({str(self.root)!r}, cap_bytes={self.cap_bytes})"

    def file_name(self, store: Store, info: ShardInfo) -> str:
        """The cache file name: store identity + content hash prefix + shard name, so a shard that
        was re-made (new sha256) is a miss rather than a stale hit."""
        return f"{store_key(store)}-{info.sha256[:16]}-{info.name}"

    def path(self, store: Store, info: ShardInfo) -> Path:
        """A local file holding the shard's bytes: cached, or fetched, checked and cached now."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / self.file_name(store, info)
        if self._intact(final, info):
            os.utime(final)  # mark it recently used
            return final
        tmp = self.root / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            store.fetch(info.name, tmp)
            self._check(store, info, tmp)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
            remember_hash(_identity(final.stat(), final), info.sha256)
        self.evict(keep=final)
        return final

    def _intact(self, final: Path, info: ShardInfo) -> bool:
        """Whether a cached file holds the manifest's bytes: its size, and its sha256 hashed once
        per process (a cache file on a failing disk, or rewritten in place, must not train). A
        cached file that is not intact is removed, so the shard is fetched again."""
        try:
            with open(final, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size == info.bytes and sha256_once(f, _identity(st, final)) == info.sha256:
                    return True
        except FileNotFoundError:
            return False
        with contextlib.suppress(FileNotFoundError):
            final.unlink()
        return False

    def _check(self, store: Store, info: ShardInfo, path: Path) -> None:
        size = path.stat().st_size
        if size != info.bytes:
            raise bad_shard(store, info, f"has {size} bytes, the manifest says {info.bytes}")
        if sha256_file(path) != info.sha256:
            raise bad_shard(store, info, "does not match its sha256 in the manifest")

    def evict(self, keep: Path | None = None) -> int:
        """Remove temps of dead writers, then least-recently-used files until the total (live
        temps included) is within the cap (never `keep`). Returns the dead temps removed."""
        entries: list[tuple[int, int, Path]] = []
        total = removed = 0
        for entry in os.scandir(self.root):
            try:
                st = entry.stat()
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            if not entry.is_file() or not (_CACHED.match(entry.name) or _TEMP.match(entry.name)):
                continue  # not a name sparknet writes: the user's
            if entry.name.startswith("."):
                if _abandoned(entry.name, st):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    removed += 1
                else:
                    total += st.st_size
                continue
            entries.append((st.st_mtime_ns, st.st_size, Path(entry.path)))
            total += st.st_size
        entries.sort()
        for _, size, path in entries:
            if total <= self.cap_bytes:
                break
            if keep is not None and path == keep:
                continue
            with contextlib.suppress(FileNotFoundError):  # another process evicted it first
                path.unlink()
            total -= size
        return removed

    def total_bytes(self) -> int:
        """Bytes held by cached (not in-flight) files."""
        total = 0
        if not self.root.is_dir():
            return 0
        for entry in os.scandir(self.root):
            if _CACHED.match(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat().st_size
        return total
