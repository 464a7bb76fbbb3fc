"""One shard on disk, and what a run does with the files an earlier run left.

A shard's tar is written under a temp name and renamed into place, then its sidecar; a run
keeps, rewrites or removes the files an earlier run left in the destination.

Kept apart from planning and checking: this is what runs in the write phase's workers, a shard
each (`ensure_shard`), and it holds every rule about the files in a destination (their modes,
temp names and sidecars).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sparknet.data.decode import shrink
from sparknet.data.imagenet import SourceImage
from sparknet.data.manifest import SHARD_PATTERN, ShardInfo, sha256_file
from sparknet.data.shard_plan import ShardPlan
from sparknet.errors import SparknetError

#: temp names of shards, sidecars and the manifest (`.<name>.<random>.tmp`)
_TEMP = re.compile(
    r"^\.(\.?[a-z]+-\d{6}\.tar(\.json)?|manifest\.json|sparknet-checks\.json)\..+\.tmp$"
)
_SHARD = re.compile(SHARD_PATTERN)
#: shards, sidecars and the manifest are for everyone to read (mkstemp makes 0600 files)
FILE_MODE = 0o644


@dataclass(frozen=True)
class _Sidecar:
    fingerprint: str
    sha256: str
    bytes: int
    samples: int


@dataclass(frozen=True)
class ShardResult:
    """One shard as written (or kept from an earlier run)."""

    info: ShardInfo
    kept: bool = False


class _HashingFile:
    """A write-only file wrapper that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.raw.write(data)


def _sidecar_path(dest_dir: Path, name: str) -> Path:
    return dest_dir / f".{name}.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same dir and rename: readers see the old file or the new."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_image(image: SourceImage) -> bytes:
    try:
        return image.read_bytes()
    except OSError as exc:
        fix = "fix its permissions" if exc.errno == errno.EACCES else "replace it"
        raise SparknetError(
            f"cannot read {image.path} ({exc.strerror or exc}): {fix} or remove it, then run again"
        ) from exc


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    # fixed metadata (mtime 0, no owner): the same plan gives byte-identical shards
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    tar.addfile(info, io.BytesIO(data))


def write_shard(plan: ShardPlan, dest_dir: Path) -> ShardResult:
    """Write `plan` as `dest_dir/<name>`: `<key>.cls` and `<key>.jpg` (the file's bytes) members.

    The images were decode-checked before the plan was made (`check_images`). The tar is written
    under a temp name and renamed into place, then the sidecar is written, so a crash leaves either
    no sidecar or one that does not match, and a resumed run rewrites it. Only one image's bytes are
    in memory at a time. The standard library's tarfile writes it (webdataset's writer would
    import torch into every pool process, seconds each).
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    sidecar = _sidecar_path(dest_dir, plan.name)
    sidecar.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=f".{plan.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as raw:
            out = _HashingFile(raw)
            with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for image in plan.images:
                    data = read_image(image)
                    if plan.resize is not None:
                        data = shrink(data, plan.resize.max_side, plan.resize.quality)
                    _add_member(tar, f"{image.key}.cls", str(image.label).encode())
                    _add_member(tar, f"{image.key}.jpg", data)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, dest_dir / plan.name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    info = ShardInfo(
        name=plan.name,
        samples=len(plan.images),
        bytes=out.size,
        sha256=out.digest.hexdigest(),
    )
    record = _Sidecar(plan.fingerprint, info.sha256, info.bytes, info.samples)
    atomic_write_text(sidecar, json.dumps(record.__dict__) + "\n")
    return ShardResult(info)


def _read_sidecar(dest_dir: Path, name: str) -> _Sidecar | None:
    try:
        record = json.loads(_sidecar_path(dest_dir, name).read_text())
        return _Sidecar(
            fingerprint=str(record["fingerprint"]),
            sha256=str(record["sha256"]),
            bytes=int(record["bytes"]),
            samples=int(record["samples"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _reusable(plan: ShardPlan, dest_dir: Path) -> ShardResult | None:
    """The existing shard when its sidecar matches the plan and its bytes the sidecar."""
    record = _read_sidecar(dest_dir, plan.name)
    if record is None or record.fingerprint != plan.fingerprint:
        return None
    if record.samples != len(plan.images):
        return None
    path = dest_dir / plan.name
    try:
        if path.stat().st_size != record.bytes:
            return None
    except FileNotFoundError:
        return None
    if sha256_file(path) != record.sha256:
        return None
    info = ShardInfo(
        name=plan.name, samples=record.samples, bytes=record.bytes, sha256=record.sha256
    )
    return ShardResult(info, kept=True)


def ensure_shard(job: tuple[ShardPlan, Path]) -> ShardResult:
    """Keep the shard if it is already right, else write it. Runs in the pool."""
    plan, dest_dir = job
    return _reusable(plan, dest_dir) or write_shard(plan, dest_dir)


def remove_stale_temps(dest_dir: Path) -> None:
    """Temp files of an interrupted run are garbage: nothing else writes names like them."""
    for entry in os.scandir(dest_dir):
        if _TEMP.match(entry.name):
            Path(entry.path).unlink(missing_ok=True)


def remove_orphans(dest_dir: Path, planned: set[str]) -> list[str]:
    """Remove shards (and their sidecars) of an earlier plan that this one does not name, e.g.
    `train-000009.tar` after a re-shard into fewer, bigger shards; the sorted names removed.
    Only shards sparknet wrote are touched: a shard-like name with no sidecar beside it is the
    user's own file and stays."""
    removed = []
    for entry in os.scandir(dest_dir):
        if (
            _SHARD.match(entry.name)
            and entry.name not in planned
            and _sidecar_path(dest_dir, entry.name).is_file()
        ):
            Path(entry.path).unlink(missing_ok=True)
            _sidecar_path(dest_dir, entry.name).unlink(missing_ok=True)
            removed.append(entry.name)
    return sorted(removed)
