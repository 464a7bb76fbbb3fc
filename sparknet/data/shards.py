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

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import math
import multiprocessing
import multiprocessing.pool
import os
import re
import signal
import tarfile
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from sparknet.data.imagenet import ImageTree, SourceImage, inspect_image, scan, shrink
from sparknet.data.manifest import (
    MANIFEST_NAME,
    SHARD_PATTERN,
    Manifest,
    RejectedImage,
    ShardInfo,
    sha256_file,
)
from sparknet.errors import SparknetError

DEFAULT_SHARD_BYTES = 256 * 2**20
#: tar stores each member as a 512-byte header plus its data padded to 512-byte blocks
TAR_BLOCK = 512
#: a streamed tar ends with two zero blocks and is padded to a 10 KiB record: at most 21 blocks
TAR_TAIL = 21 * TAR_BLOCK
#: USTAR's name field; a longer member name costs a PAX header (2 blocks) in front of it
TAR_NAME_MAX = 100
#: temp names of shards, sidecars and the manifest (`.<name>.<random>.tmp`)
_TEMP = re.compile(
    r"^\.(\.?[a-z]+-\d{6}\.tar(\.json)?|manifest\.json|sparknet-checks\.json)\..+\.tmp$"
)
_SHARD = re.compile(SHARD_PATTERN)
#: shards, sidecars and the manifest are for everyone to read (mkstemp makes 0600 files)
FILE_MODE = 0o644
#: decode-check results of an earlier run, so a re-run decodes only new or changed images
CHECKS_NAME = ".sparknet-checks.json"
#: decode-check results as they come (one JSON line each), so an interrupted or killed run keeps
#: what it checked; folded into CHECKS_NAME when the check phase ends
JOURNAL_NAME = ".sparknet-checks.jsonl"
#: images handed to the check pool at a time: bounds memory (1.3M futures would be gigabytes)
#: and what Ctrl-C waits for
CHECK_BATCH = 1024
#: how on_progress names its phases; both count images
CHECK, WRITE = "check", "write"


#: the smallest `--max-side`: below it crops would be upscaled at any usual training size
MIN_SIDE = 32
#: JPEG quality of images `--max-side` re-encodes (FFCV's and most fast recipes' choice)
DEFAULT_QUALITY = 90


@dataclass(frozen=True)
class Resize:
    """`--max-side`: images whose longer side is over `max_side` are stored shrunk to it (as
    JPEGs of `quality`); smaller ones keep their bytes. Decoding a 256-px image costs a fraction
    of a 500x375 one, on every epoch, for a crop that ends at 224 px anyway."""

    max_side: int
    quality: int = DEFAULT_QUALITY

    def estimate(self, size: int, width: int, height: int) -> int:
        """About how many bytes an image of `size` bytes takes once shrunk: JPEG bytes go
        roughly with pixels. Shards are planned on this, so they come out near the target."""
        longest = max(width, height)
        if longest <= self.max_side:
            return size
        return max(1, int(size * (self.max_side / longest) ** 2))


@dataclass(frozen=True)
class ShardPlan:
    """One shard to write: its file name, its images in order, and a fingerprint of both.

    The fingerprint hashes (key, label, file size, mtime) of every image in order, so a resumed
    run recognises a shard written from the same plan and rewrites one whose contents would differ,
    even when an edited image kept its size.
    """

    name: str
    images: list[SourceImage]
    fingerprint: str
    resize: Resize | None = None


@dataclass(frozen=True)
class WriteReport:
    """The manifest written, which shards were written now or kept from an earlier run, the
    shards of an earlier plan that were removed (a re-shard into fewer, bigger shards), and
    warnings for the user (a class left with no image that decodes)."""

    manifest: Manifest
    written: list[str]
    reused: list[str]
    removed: list[str]
    warnings: list[str] = field(default_factory=list)
    #: images that do not decode, and files left out for their names (both are in the manifest)
    rejected: list[RejectedImage] = field(default_factory=list)
    skipped: list[RejectedImage] = field(default_factory=list)
    #: val images of classes that `classes` did not keep
    other_classes_val: int = 0


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


def _tar_bytes(size: int, key: str) -> int:
    """What one sample (`<key>.jpg` of `size` bytes and a short `<key>.cls`) takes in a tar."""
    per_member = TAR_BLOCK + (2 * TAR_BLOCK if len(key) + 4 > TAR_NAME_MAX else 0)
    return 2 * per_member + -(-size // TAR_BLOCK) * TAR_BLOCK + TAR_BLOCK


def _file_key(st: os.stat_result) -> list[int]:
    """What says a source file is unchanged since a run: size and mtime alone miss an overwrite
    that keeps the mtime (`cp -p`, `rsync -t`); that sets the ctime (and a copy-and-rename a new
    inode), which no user tool can set back."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _source_keys(images: list[SourceImage]) -> list[list[int]]:
    """Each image's `_file_key`, and for a tar member its offset and size too (the tar is stat'ed
    once, not once per member)."""
    stats: dict[Path, list[int]] = {}
    out = []
    for image in images:
        if image.offset is None:
            out.append(_file_key(_stat(image)))
            continue
        if image.path not in stats:
            stats[image.path] = _file_key(_stat(image))
        out.append([*stats[image.path], image.offset, image.size or 0])
    return out


def _stat(image: SourceImage) -> os.stat_result:
    try:
        return os.stat(image.path)
    except OSError as exc:
        raise SparknetError(
            f"cannot read {image.path} ({exc.strerror or exc}): replace it or remove it, "
            "then run again"
        ) from exc


def _fingerprint(images: list[SourceImage], keys: list[list[int]], resize: Resize | None) -> str:
    digest = hashlib.sha256()
    if resize is not None:  # shrunk images are other bytes: another setting rewrites the shard
        digest.update(f"max_side={resize.max_side} quality={resize.quality}\n".encode())
    for image, key in zip(images, keys, strict=True):
        digest.update(f"{image.key}\t{image.label}\t{key}\n".encode())
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
    images: list[SourceImage],
    *,
    split: str,
    seed: int,
    target_bytes: int,
    resize: Resize | None = None,
    pixels: dict[SourceImage, tuple[int, int]] | None = None,
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
    keys = _source_keys(shuffled)
    sizes = [
        image.size if image.size is not None else key[0]
        for image, key in zip(shuffled, keys, strict=True)
    ]
    if resize is not None and pixels is not None:
        sizes = [
            resize.estimate(size, *pixels.get(image, (0, 0)))
            for size, image in zip(sizes, shuffled, strict=True)
        ]
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
            fingerprint=_fingerprint(shuffled[lo:hi], keys[lo:hi], resize),
            resize=resize,
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
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_image(image: SourceImage) -> bytes:
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
                    data = _read_image(image)
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
    _atomic_write_text(sidecar, json.dumps(record.__dict__) + "\n")
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


def _ensure_shard(job: tuple[ShardPlan, Path]) -> ShardResult:
    """Keep the shard if it is already right, else write it. Runs in the pool."""
    plan, dest_dir = job
    return _reusable(plan, dest_dir) or write_shard(plan, dest_dir)


def _remove_stale_temps(dest_dir: Path) -> None:
    """Temp files of an interrupted run are garbage: nothing else writes names like them."""
    for entry in os.scandir(dest_dir):
        if _TEMP.match(entry.name):
            Path(entry.path).unlink(missing_ok=True)


def _remove_orphans(dest_dir: Path, planned: set[str]) -> list[str]:
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


@dataclass(frozen=True)
class CheckedTree:
    """Each split's images that decode, those that do not (paths relative to the source), and
    how many images were added or removed since the last run on this destination (0 for none)."""

    good: dict[str, list[SourceImage]]
    rejected: list[RejectedImage]
    changed: int = 0
    #: (width, height) of every image that decodes
    pixels: dict[SourceImage, tuple[int, int]] = field(default_factory=dict)


def _load_checks(dest: Path, src: Path) -> tuple[dict[str, list], set[str]]:
    """Earlier runs' decode checks of this source: relative path -> [*source key, problem,
    width, height], from the last finished check phase and then the journal of an interrupted
    one; and the paths the last finished phase saw (what "added or removed since" compares to)."""
    where = str(src.resolve())
    known: dict[str, list] = {}
    try:
        record = json.loads((dest / CHECKS_NAME).read_text())
        if record["src"] == where:
            known = {str(k): list(v) for k, v in record["images"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    finished = set(known)
    try:
        with open(dest / JOURNAL_NAME, encoding="utf-8") as f:
            if json.loads(f.readline() or "{}").get("src") != where:
                return known, finished
            for line in f:
                try:
                    rel, check = json.loads(line)
                    known[str(rel)] = list(check)
                except (ValueError, TypeError):
                    continue  # the line a kill cut short
    except (OSError, ValueError, AttributeError):
        pass
    return known, finished


class _Journal:
    """Appends each decode check as it is made (a line each, flushed), so an interrupted run —
    Ctrl-C, `kill -9`, a crash — keeps every image it checked and the next run starts there."""

    def __init__(self, dest: Path, src: Path) -> None:
        self.path = dest / JOURNAL_NAME
        where = str(src.resolve())
        try:
            with open(self.path, encoding="utf-8") as f:
                same = json.loads(f.readline() or "{}").get("src") == where
        except (OSError, ValueError, AttributeError):
            same = False
        self.file = open(self.path, "a" if same else "w", encoding="utf-8", buffering=1)  # noqa: SIM115
        os.fchmod(self.file.fileno(), FILE_MODE)
        if not same:
            self.file.write(json.dumps({"src": where}) + "\n")

    def add(self, rel: str, check: list) -> None:
        self.file.write(json.dumps([rel, check]) + "\n")

    def close(self) -> None:
        self.file.close()


def _inspect(image: SourceImage) -> tuple[str | None, int, int]:
    """Why one image cannot be trained on (None when it can) and its size (runs in the pool)."""
    return tuple(inspect_image(_read_image(image)))  # type: ignore[return-value]


def _batches(items: list, size: int) -> Iterator[list]:
    for lo in range(0, len(items), size):
        yield items[lo : lo + size]


def _checked(
    images: list[SourceImage], processes: int | None
) -> Iterator[tuple[str | None, int, int]]:
    """`_inspect` of each image, in order, on the workers `_workers` picks.

    Handed over CHECK_BATCH images at a time, so an interrupted run stops within one batch."""
    if not images:
        return
    kind, n = _workers(processes, len(images), len(images))
    if kind == "processes":
        with _pool_ignoring_sigint(n) as pool:
            for batch in _batches(images, CHECK_BATCH):
                yield from pool.imap(_inspect, batch, chunksize=8)
        return
    threads = n
    if threads == 1:
        yield from map(_inspect, images)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="sparknet-check")
    try:
        for batch in _batches(images, CHECK_BATCH):
            yield from pool.map(_inspect, batch)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def check_images(
    tree: ImageTree,
    src: Path,
    dest: Path,
    processes: int | None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> CheckedTree:
    """Decode-check every image before any shard is planned, so shards hold only images training
    can decode and no shard is planned around images that will be left out. Each result is
    journaled in `dest` as it comes and all of them kept there (CHECKS_NAME) at the end: a re-run,
    after an interrupted or a finished run, decodes only images not checked yet or changed since.

    A split with no image that decodes is refused in one line (it would make empty shards)."""
    known, finished = _load_checks(dest, src)
    images = [
        (split, image) for split, split_images in tree.splits.items() for image in split_images
    ]
    rels = [image.name or _rel(src, image.path) for _, image in images]
    keys = _source_keys([image for _, image in images])
    checks: list[list | None] = [None] * len(images)
    for i, (rel, key) in enumerate(zip(rels, keys, strict=True)):
        hit = known.get(rel)
        if hit is not None and hit[:-3] == key:  # [*key, problem, width, height]
            checks[i] = hit
    # in file order: a tar (or a disk) read front to back, not in the order of the labels
    todo = sorted(
        (i for i, check in enumerate(checks) if check is None),
        key=lambda i: (str(images[i][1].path), images[i][1].offset or 0),
    )
    done = len(images) - len(todo)
    report = on_progress or (lambda phase, done, total: None)
    report(CHECK, done, len(images))
    journal = _Journal(dest, src)
    try:
        problems = _checked([images[i][1] for i in todo], processes)
        for n, (i, result) in enumerate(zip(todo, problems, strict=True), start=1):
            checks[i] = [*keys[i], *result]
            journal.add(rels[i], checks[i])
            if n % 64 == 0 or n == len(todo):
                report(CHECK, done + n, len(images))
    finally:
        journal.close()
    record = {"src": str(src.resolve()), "images": dict(zip(rels, checks, strict=True))}
    _atomic_write_text(dest / CHECKS_NAME, json.dumps(record) + "\n")
    (dest / JOURNAL_NAME).unlink(missing_ok=True)
    good: dict[str, list[SourceImage]] = {split: [] for split in tree.splits}
    rejected: list[RejectedImage] = []
    pixels: dict[SourceImage, tuple[int, int]] = {}
    for (split, image), rel, check in zip(images, rels, checks, strict=True):
        problem, width, height = check[-3:] if check is not None else ("not checked", 0, 0)
        if problem is None:
            good[split].append(image)
            pixels[image] = (width, height)
        else:
            rejected.append(RejectedImage(split=split, path=rel, reason=problem))
    for split, split_images in good.items():
        if not split_images:
            first = next(r for r in rejected if r.split == split)
            raise SparknetError(
                f"no image of the {split} split of {src} decodes ({len(tree.splits[split])} "
                f"tried, e.g. {first.path}: {first.reason}): replace the damaged files"
            )
    changed = len(set(rels) ^ finished) if finished else 0
    return CheckedTree(good, rejected, changed, pixels)


def _rel(src: Path, path: Path) -> str:
    return Path(os.path.relpath(path, src)).as_posix()


def _empty_classes(tree: ImageTree, checked: CheckedTree) -> list[str]:
    """One warning per class whose every train image was rejected (it cannot be learnt)."""
    usable = {image.label for image in checked.good.get("train", [])}
    return [
        f"warning: class {c.wnid} has no train image that decodes: the model cannot learn it"
        for c in tree.classes
        if c.index not in usable
    ]


#: held by the `data shard` writing into a destination (exclusive) and by each `data upload`
#: reading from it (shared); never deleted: deleting races the lock
LOCK_NAME = ".sparknet-shard.lock"


@contextlib.contextmanager
def _dest_lock(dest: Path) -> Iterator[None]:
    """One writer per destination: a second run would delete the first's in-flight temps, and an
    upload would send bytes that differ from the sha256 it tags them with. An flock is released
    by the kernel when its holder dies, so a killed run never blocks the next."""
    fd = os.open(dest / LOCK_NAME, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SparknetError(
                f"another `sparknet data shard` or `data upload` is using {dest}: wait for it "
                "to finish (or give another destination)"
            ) from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading_lock(src: Path) -> Iterator[None]:
    """Held (shared) while an upload reads a dataset dir, so no `data shard` rewrites a shard
    between its hash and its send; refused in one line while a shard run holds the dir. A
    read-only dir without the lock file cannot be sharded into either: no lock is needed."""
    try:
        fd = os.open(src / LOCK_NAME, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError:
        try:
            fd = os.open(src / LOCK_NAME, os.O_RDONLY)
        except OSError:
            yield
            return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SparknetError(
                f"a `sparknet data shard` is writing into {src}: wait for it to finish, then upload"
            ) from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _pool_ignoring_sigint(workers: int) -> Iterator[multiprocessing.pool.Pool]:
    """A spawned pool whose processes leave Ctrl-C (sent to the whole foreground group) to the
    parent, which stops the pool and prints one line; each worker would otherwise print its own
    KeyboardInterrupt traceback.

    The processes are started while this thread blocks SIGINT: a blocked signal stays blocked
    across exec, so they never see it, imports included. A Ctrl-C in the meantime is not lost
    (as it would be with SIGINT ignored): another thread may take it, so a handler notes it, and
    it is raised once the pool is up and in the `with`, so the pool is terminated."""
    # spawn, not fork: the caller may hold threads (Spark, torch) that fork would break
    ctx = multiprocessing.get_context("spawn")
    if threading.current_thread() is not threading.main_thread():  # cannot touch handlers
        with ctx.Pool(workers) as pool:
            yield pool
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # it unblocks SIGINT when it starts itself
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = ctx.Pool(workers)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, previous)
        raise
    with pool:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending Ctrl-C: noted now
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt
        yield pool


def _os_error(exc: OSError, dest: Path) -> SparknetError:
    """One line for a file system error outside the source images (those are named by
    `_read_image`): the destination is not a directory, not writable, or full."""
    where = exc.filename2 or exc.filename or dest  # a rename's target, not its random temp
    if exc.errno == errno.EISDIR:
        fix = "a directory is in the way of that file: move it away"
    elif exc.errno == errno.ENOSPC:
        fix = "free some space or give another destination"
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR):
        fix = f"{dest}, or a directory above it, is a file: give a directory"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "give a destination you can write to"
    else:
        fix = "check the path, or give another destination"
    return SparknetError(f"cannot write {where} ({exc.strerror or exc}): {fix}")


def _reshuffled(changed: int, written: list[str], names: list[str]) -> list[str]:
    """A warning when images added or removed since the last run made shards be rewritten: the
    seeded shuffle and the even cut span a whole split, so one image more or less moves most
    images to another shard (and `data upload` sends those shards again)."""
    if not changed or not written:
        return []
    return [
        f"warning: {changed} source images were added or removed since the last run; the shuffle "
        f"spans each whole split, so {len(written)} of {len(names)} shards were rewritten "
        "(`sparknet data upload` sends them again)"
    ]


#: a phase over fewer images runs on threads by default: a spawned process costs ~1 s of CPU to
#: start (Python and the imports), which threads do not pay; over more, processes win, because
#: threads share one GIL for what is not decoding (measured on 2 cores, 108 KB photos: checking
#: ran at 830 images/s on 2 threads and 1,090 on 2 processes once started, each pool ~2 s to
#: start; break-even near 7,600 images)
PROCESS_MIN_IMAGES = 10_000
#: the most processes the default starts (each holds ~100 MB of imports)
MAX_DEFAULT_PROCESSES = 32


def _workers(processes: int | None, images: int, jobs: int) -> tuple[str, int]:
    """("processes" | "threads", how many) for a phase over `images` images in `jobs` jobs:
    `--processes N` as given (1: serially, here), else processes on every core for a big
    source and threads for a small one; never more workers than jobs."""
    if processes is not None:
        n = min(processes, jobs)
        return ("processes" if n > 1 else "threads"), max(1, n)
    cores = os.cpu_count() or 1
    if cores > 1 and images >= PROCESS_MIN_IMAGES and jobs > 1:
        return "processes", min(cores, MAX_DEFAULT_PROCESSES, jobs)
    return "threads", max(1, min(cores, jobs))


def write_dataset(
    src: Path,
    dest: Path,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    seed: int = 0,
    processes: int | None = None,
    classes: list[str] | None = None,
    resize: Resize | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> WriteReport:
    """Scan `src`, write every split's shards into `dest` and then `manifest.json`.

    Shards already written by an earlier run with the same plan and intact bytes are kept
    (`reused`); shards of an old plan that this one does not name are removed (`removed`).
    Images that do not decode are left out and listed in the manifest's `rejected`, as are files
    whose names are not JPEGs (`skipped`). `classes` keeps only those wnids (indexed 0..N-1);
    `resize` stores big images shrunk.
    Any old manifest is removed first, so `dest` reads as unfinished until this run completes.
    `processes` None checks and writes on every core, with threads for a small source and
    processes for a big one (`_workers`); a number uses that many processes for both.
    `on_progress(phase, done, total)` counts images of the "check" phase (decoding every image),
    then of the "write" phase (as each shard is finished).
    """
    if processes is not None and processes < 1:
        raise SparknetError(f"processes must be at least 1, got {processes}")
    if resize is not None and not (resize.max_side >= MIN_SIDE and 1 <= resize.quality <= 100):
        raise SparknetError(
            f"--max-side must be at least {MIN_SIDE} and --quality 1..100, got "
            f"{resize.max_side} and {resize.quality}"
        )
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        scan(src, classes)  # its one-line error, before DEST is made
    _check_not_inside(src, dest)
    new = not dest.exists()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        # the lock first: indexing the official train tar reads a million headers, which a
        # second run into the same DEST should not do before it is refused
        with _dest_lock(dest):
            try:
                tree = scan(src, classes)
            except SparknetError:
                if new:  # a bad SRC leaves no DEST behind
                    (dest / LOCK_NAME).unlink(missing_ok=True)
                    with contextlib.suppress(OSError):
                        dest.rmdir()
                raise
            return _write_dataset(
                tree, src, dest, shard_bytes, seed, processes, resize, on_progress
            )
    except OSError as exc:
        raise _os_error(exc, dest) from None  # from None: the chained trace would print it twice


def _check_not_inside(src: Path, dest: Path) -> None:
    """DEST inside SRC's train/ or val/ would be read as a class dir (of shards) by every run."""
    from sparknet.data.imagenet import KAGGLE_DATA

    target = dest.resolve()
    for split in ("train", "val"):
        for where in (src / split, src / KAGGLE_DATA / split):
            if where.is_dir() and target.is_relative_to(where.resolve()):
                raise SparknetError(
                    f"{dest} is inside {where}, where every directory is read as a class: "
                    "give a DEST outside it"
                )


def _write_dataset(
    tree: ImageTree,
    src: Path,
    dest: Path,
    shard_bytes: int,
    seed: int,
    processes: int | None,
    resize: Resize | None,
    on_progress: Callable[[str, int, int], None] | None,
) -> WriteReport:
    """`write_dataset` once the source is scanned, under DEST's lock; may raise OSError about
    the destination."""
    report = on_progress or (lambda phase, done, total: None)
    checked = check_images(tree, src, dest, processes, report)
    plans = {
        split: plan_shards(
            images,
            split=split,
            seed=seed,
            target_bytes=shard_bytes,
            resize=resize,
            pixels=checked.pixels,
        )
        for split, images in checked.good.items()
    }
    jobs = [(plan, dest) for split_plans in plans.values() for plan in split_plans]
    (dest / MANIFEST_NAME).unlink(missing_ok=True)
    _remove_stale_temps(dest)

    results: dict[str, ShardResult] = {}
    total = sum(len(plan.images) for plan, _ in jobs)
    written = 0

    def record(result: ShardResult) -> None:
        nonlocal written
        results[result.info.name] = result
        written += result.info.samples
        report(WRITE, written, total)

    report(WRITE, 0, total)
    kind, workers = _workers(processes, total, len(jobs))
    if kind == "threads" and workers > 1:  # a small source: see PROCESS_MIN_IMAGES
        with ThreadPoolExecutor(workers, thread_name_prefix="sparknet-shard") as pool:
            for result in pool.map(_ensure_shard, jobs):
                record(result)
    elif workers <= 1:
        for job in jobs:
            record(_ensure_shard(job))
    else:
        with _pool_ignoring_sigint(workers) as pool:
            for result in pool.imap_unordered(_ensure_shard, jobs):
                record(result)

    removed = _remove_orphans(dest, {plan.name for plan, _ in jobs})
    manifest = Manifest(
        classes=tree.classes,
        splits={
            split: [results[p.name].info for p in split_plans]
            for split, split_plans in plans.items()
        },
        rejected=[*checked.rejected, *tree.skipped],
        subset_of=tree.source_classes if tree.num_classes < tree.source_classes else None,
        max_side=resize.max_side if resize is not None else None,
        quality=resize.quality if resize is not None else None,
    )
    _atomic_write_text(dest / MANIFEST_NAME, manifest.dumps())
    names = [plan.name for plan, _ in jobs]
    return WriteReport(
        manifest=manifest,
        written=[n for n in names if not results[n].kept],
        reused=[n for n in names if results[n].kept],
        removed=removed,
        warnings=[
            *_empty_classes(tree, checked),
            *_reshuffled(checked.changed, [n for n in names if not results[n].kept], names),
        ],
        rejected=checked.rejected,
        skipped=tree.skipped,
        other_classes_val=tree.other_classes_val,
    )
