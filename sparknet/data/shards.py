"""Turn an image tree into WebDataset tar shards plus `manifest.json`, resumably and in parallel.

Training reads big sequential tar shards instead of 1.28M small files (S3 and disks both want
that). Each split is shuffled once with a seed before it is cut, so every shard is a fair sample
of all classes and a worker that streams a few shards still sees every class.

Writing ImageNet takes a while, so it resumes: each shard gets a sidecar `.<name>.json` recording
the plan's fingerprint and the shard's sha256, written only after the shard is in place. A shard
whose sidecar matches its plan and its bytes is kept. The manifest is written last: a
destination without one is unfinished and readers refuse it. One writer per destination.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import re
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from webdataset import TarWriter

from sparknet.data.imagenet import SourceImage, scan
from sparknet.data.manifest import MANIFEST_NAME, Manifest, ShardInfo, sha256_file
from sparknet.errors import SparknetError

DEFAULT_SHARD_BYTES = 256 * 2**20
#: tar stores each member as a 512-byte header plus its data padded to 512-byte blocks
TAR_BLOCK = 512
#: a streamed tar ends with two zero blocks and is padded to a 10 KiB record: at most 21 blocks
TAR_TAIL = 21 * TAR_BLOCK
#: USTAR's name field; a longer member name costs a PAX header (2 blocks) in front of it
TAR_NAME_MAX = 100
#: temp names of shards, sidecars and the manifest (`.<name>.<random>.tmp`)
_TEMP = re.compile(r"^\.(\.?[a-z]+-\d{6}\.tar(\.json)?|manifest\.json)\..+\.tmp$")


@dataclass(frozen=True)
class ShardPlan:
    """One shard to write: its file name, its images in order, and a fingerprint of both.

    The fingerprint hashes (key, label, file size) of every image in order, so a resumed run
    recognises a shard written from the same plan and rewrites one whose contents would differ.
    """

    name: str
    images: list[SourceImage]
    fingerprint: str


@dataclass(frozen=True)
class WriteReport:
    """The manifest written, and which shards were written now or kept from an earlier run."""

    manifest: Manifest
    written: list[str]
    reused: list[str]


@dataclass(frozen=True)
class _Sidecar:
    fingerprint: str
    sha256: str
    bytes: int
    samples: int


def _tar_bytes(size: int, key: str) -> int:
    """What one sample (`<key>.jpg` of `size` bytes and a short `<key>.cls`) takes in a tar."""
    per_member = TAR_BLOCK + (2 * TAR_BLOCK if len(key) + 4 > TAR_NAME_MAX else 0)
    return 2 * per_member + -(-size // TAR_BLOCK) * TAR_BLOCK + TAR_BLOCK


def _fingerprint(images: list[SourceImage], sizes: list[int]) -> str:
    digest = hashlib.sha256()
    for image, size in zip(images, sizes, strict=True):
        digest.update(f"{image.key}\t{image.label}\t{size}\n".encode())
    return digest.hexdigest()


def _even_cut(tar_sizes: np.ndarray, room: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges: the even cut into the fewest parts of at most `room` bytes (or one item).

    Midpoint assignment can overshoot an even share by up to one item, so a cut that overflows
    is retried with one more part; cuts with more parts than items fall back to greedy packing.
    """
    ends = np.cumsum(tar_sizes)
    total = int(ends[-1])
    midpoints = ends - tar_sizes / 2
    for n in range(math.ceil(total / room), len(tar_sizes) + 1):
        part = np.minimum((midpoints * n / total).astype(np.int64), n - 1)
        sums = np.bincount(part, weights=tar_sizes, minlength=n)
        counts = np.bincount(part, minlength=n)
        if np.all((sums <= room) | (counts <= 1)):
            bounds = np.flatnonzero(np.diff(part)) + 1  # parts are contiguous, some maybe empty
            return list(zip([0, *bounds.tolist()], [*bounds.tolist(), len(tar_sizes)], strict=True))
    cuts, filled = [0], 0
    for i, size in enumerate(tar_sizes.tolist()):
        if i > cuts[-1] and filled + size > room:
            cuts.append(i)
            filled = 0
        filled += size
    return list(zip(cuts, [*cuts[1:], len(tar_sizes)], strict=True))


def plan_shards(
    images: list[SourceImage], *, split: str, seed: int, target_bytes: int
) -> list[ShardPlan]:
    """Shuffle a split's images with `seed` and cut them into shards of about `target_bytes`.

    The cut works from the file sizes plus tar overhead: it is the even cut (each image goes to the
    share its byte midpoint falls in, so there is no runt last shard) into the fewest shards that
    all stay at or under the target. An image bigger than the target gets a shard of its own.
    """
    if target_bytes <= 0:
        raise SparknetError(f"the shard size must be positive, got {target_bytes} bytes")
    if not images:
        return []
    order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(images))
    shuffled = [images[i] for i in order]
    sizes = [os.stat(image.path).st_size for image in shuffled]
    groups = _even_cut(
        np.array(
            [_tar_bytes(size, image.key) for size, image in zip(sizes, shuffled, strict=True)]
        ),
        room=max(1, target_bytes - TAR_TAIL),
    )
    return [
        ShardPlan(
            name=f"{split}-{number:06d}.tar",
            images=shuffled[lo:hi],
            fingerprint=_fingerprint(shuffled[lo:hi], sizes[lo:hi]),
        )
        for number, (lo, hi) in enumerate(groups)
    ]


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


def _atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same dir and rename: readers see the old file or the new."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_shard(plan: ShardPlan, dest_dir: Path) -> ShardInfo:
    """Write `plan` as `dest_dir/<name>`: `<key>.jpg` (the file's bytes) and `<key>.cls` members.

    The tar is written under a temp name and renamed into place, then the sidecar is written, so
    a crash leaves either no sidecar or one that does not match, and a resumed run rewrites it.
    Only one image's bytes are in memory at a time. Fixed tar metadata (mtime 0) makes the same
    plan give byte-identical shards.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    sidecar = _sidecar_path(dest_dir, plan.name)
    sidecar.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=f".{plan.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            out = _HashingFile(raw)
            # an int mtime: a float one makes tarfile add a PAX header to every member
            with TarWriter(out, encoder=False, mtime=0) as tar:
                for image in plan.images:
                    try:
                        data = image.path.read_bytes()
                    except OSError as exc:
                        raise SparknetError(
                            f"cannot read {image.path} ({exc.strerror or exc}): "
                            "fix its permissions or remove it, then run again"
                        ) from exc
                    tar.write({"__key__": image.key, "jpg": data, "cls": str(image.label).encode()})
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, dest_dir / plan.name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    info = ShardInfo(
        name=plan.name, samples=len(plan.images), bytes=out.size, sha256=out.digest.hexdigest()
    )
    record = _Sidecar(plan.fingerprint, info.sha256, info.bytes, info.samples)
    _atomic_write_text(sidecar, json.dumps(record.__dict__) + "\n")
    return info


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


def _reusable(plan: ShardPlan, dest_dir: Path) -> ShardInfo | None:
    """The existing shard's info when its sidecar matches the plan and its bytes the sidecar."""
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
    return ShardInfo(
        name=plan.name, samples=record.samples, bytes=record.bytes, sha256=record.sha256
    )


def _ensure_shard(job: tuple[ShardPlan, Path]) -> tuple[ShardInfo, bool]:
    """Keep the shard if it is already right, else write it; True when kept. Runs in the pool."""
    plan, dest_dir = job
    kept = _reusable(plan, dest_dir)
    if kept is not None:
        return kept, True
    return write_shard(plan, dest_dir), False


def _remove_stale_temps(dest_dir: Path) -> None:
    """Temp files of an interrupted run are garbage: nothing else writes names like them."""
    for entry in os.scandir(dest_dir):
        if _TEMP.match(entry.name):
            Path(entry.path).unlink(missing_ok=True)


def write_dataset(
    src: Path,
    dest: Path,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    seed: int = 0,
    processes: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> WriteReport:
    """Scan `src`, write every split's shards into `dest` and then `manifest.json`.

    Shards already written by an earlier run with the same plan and intact bytes are kept
    (`reused`); shards of an old plan that this one does not name are left alone but not listed.
    Any old manifest is removed first, so `dest` reads as unfinished until this run completes.
    `processes` defaults to all cores (shard writing is I/O and hashing, one shard per process);
    `on_progress(done, total)` counts shards, starting at 0.
    """
    if processes is not None and processes < 1:
        raise SparknetError(f"processes must be at least 1, got {processes}")
    tree = scan(Path(src))
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    plans = {
        split: plan_shards(images, split=split, seed=seed, target_bytes=shard_bytes)
        for split, images in tree.splits.items()
    }
    jobs = [(plan, dest) for split_plans in plans.values() for plan in split_plans]
    (dest / MANIFEST_NAME).unlink(missing_ok=True)
    _remove_stale_temps(dest)

    results: dict[str, tuple[ShardInfo, bool]] = {}

    def record(result: tuple[ShardInfo, bool]) -> None:
        results[result[0].name] = result
        if on_progress is not None:
            on_progress(len(results), len(jobs))

    if on_progress is not None:
        on_progress(0, len(jobs))
    workers = min(processes or os.cpu_count() or 1, len(jobs))
    if workers <= 1:
        for job in jobs:
            record(_ensure_shard(job))
    else:
        # spawn, not fork: the caller may hold threads (Spark, torch) that fork would break
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for result in pool.imap_unordered(_ensure_shard, jobs):
                record(result)

    manifest = Manifest(
        classes=tree.classes,
        splits={
            split: [results[p.name][0] for p in split_plans] for split, split_plans in plans.items()
        },
    )
    _atomic_write_text(dest / MANIFEST_NAME, manifest.dumps())
    names = [plan.name for plan, _ in jobs]
    return WriteReport(
        manifest=manifest,
        written=[n for n in names if not results[n][1]],
        reused=[n for n in names if results[n][1]],
    )
