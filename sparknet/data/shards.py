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

from sparknet.data.imagenet import ImageTree, SourceImage, image_problem, scan
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


def _fingerprint(images: list[SourceImage], stats: list[os.stat_result]) -> str:
    digest = hashlib.sha256()
    for image, st in zip(images, stats, strict=True):
        digest.update(f"{image.key}\t{image.label}\t{_file_key(st)}\n".encode())
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
    stats = [os.stat(image.path) for image in shuffled]
    groups = _even_cut(
        np.array(
            [_tar_bytes(st.st_size, image.key) for st, image in zip(stats, shuffled, strict=True)]
        ),
        room=max(1, target_bytes - TAR_TAIL),
    )
    return [
        ShardPlan(
            name=f"{split}-{number:06d}.tar",
            images=shuffled[lo:hi],
            fingerprint=_fingerprint(shuffled[lo:hi], stats[lo:hi]),
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
        return image.path.read_bytes()
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


def _load_checks(dest: Path, src: Path) -> dict[str, list]:
    """An earlier run's decode checks of this source: relative path -> [*_file_key, problem]."""
    try:
        record = json.loads((dest / CHECKS_NAME).read_text())
        if record["src"] == str(src.resolve()):
            return {str(k): list(v) for k, v in record["images"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}


def _check_image(image: SourceImage, rel: str, known: dict[str, list]) -> list:
    """[*_file_key, problem] of one image: from `known` when the file has not changed since,
    else decoded now (`image_problem`)."""
    try:
        st = os.stat(image.path)
    except OSError as exc:
        raise SparknetError(
            f"cannot read {image.path} ({exc.strerror or exc}): replace it or remove it, "
            "then run again"
        ) from exc
    key = _file_key(st)
    hit = known.get(rel)
    if hit is not None and hit[:-1] == key:
        return hit
    return [*key, image_problem(_read_image(image))]


def check_images(tree: ImageTree, src: Path, dest: Path, threads: int) -> CheckedTree:
    """Decode-check every image before any shard is planned, so shards hold only images training
    can decode and no shard is planned around images that will be left out. The results are kept
    in `dest` (CHECKS_NAME): a re-run decodes only new or changed files.

    A split with no image that decodes is refused in one line (it would make empty shards)."""
    known = _load_checks(dest, src)
    images = [
        (split, image) for split, split_images in tree.splits.items() for image in split_images
    ]
    rels = [Path(os.path.relpath(image.path, src)).as_posix() for _, image in images]
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="sparknet-check") as pool:
        checks = list(
            pool.map(lambda i: _check_image(images[i][1], rels[i], known), range(len(rels)))
        )
    record = {"src": str(src.resolve()), "images": dict(zip(rels, checks, strict=True))}
    _atomic_write_text(dest / CHECKS_NAME, json.dumps(record) + "\n")
    good: dict[str, list[SourceImage]] = {split: [] for split in tree.splits}
    rejected: list[RejectedImage] = []
    for (split, image), rel, check in zip(images, rels, checks, strict=True):
        problem = check[-1]
        if problem is None:
            good[split].append(image)
        else:
            rejected.append(RejectedImage(split=split, path=rel, reason=problem))
    for split, split_images in good.items():
        if not split_images:
            first = next(r for r in rejected if r.split == split)
            raise SparknetError(
                f"no image of the {split} split of {src} decodes ({len(tree.splits[split])} "
                f"tried, e.g. {first.path}: {first.reason}): replace the damaged files"
            )
    changed = len(set(rels) ^ set(known)) if known else 0
    return CheckedTree(good, rejected, changed)


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
    KeyboardInterrupt traceback. The processes are started while SIGINT is ignored: an ignored
    signal stays ignored across exec, so they ignore it from their first instruction on, imports
    included. The parent's handler is back before any job runs."""
    # spawn, not fork: the caller may hold threads (Spark, torch) that fork would break
    ctx = multiprocessing.get_context("spawn")
    if threading.current_thread() is not threading.main_thread():  # cannot touch handlers
        with ctx.Pool(workers) as pool:
            yield pool
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = ctx.Pool(workers)
    finally:
        signal.signal(signal.SIGINT, previous)
    with pool:
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


def _threads(jobs: int) -> int:
    """Writer threads when `--processes` is not given: one per core, at most one per shard."""
    return max(1, min(os.cpu_count() or 1, jobs))


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
    (`reused`); shards of an old plan that this one does not name are removed (`removed`).
    Images that do not decode are left out and listed in the manifest's `rejected`.
    Any old manifest is removed first, so `dest` reads as unfinished until this run completes.
    `processes` None writes with one thread per core; a number uses that many processes (for
    machines with many cores, where tar writing under the GIL would cap threads).
    `on_progress(done, total)` counts shards, starting at 0.
    """
    if processes is not None and processes < 1:
        raise SparknetError(f"processes must be at least 1, got {processes}")
    src = Path(src)
    tree = scan(src)
    dest = Path(dest)
    try:
        return _write_dataset(tree, src, dest, shard_bytes, seed, processes, on_progress)
    except OSError as exc:
        raise _os_error(exc, dest) from None  # from None: the chained trace would print it twice


def _write_dataset(
    tree: ImageTree,
    src: Path,
    dest: Path,
    shard_bytes: int,
    seed: int,
    processes: int | None,
    on_progress: Callable[[int, int], None] | None,
) -> WriteReport:
    """`write_dataset` once the source is scanned; may raise OSError about the destination."""
    dest.mkdir(parents=True, exist_ok=True)
    with _dest_lock(dest):
        checked = check_images(tree, src, dest, processes or _threads(os.cpu_count() or 1))
        plans = {
            split: plan_shards(images, split=split, seed=seed, target_bytes=shard_bytes)
            for split, images in checked.good.items()
        }
        jobs = [(plan, dest) for split_plans in plans.values() for plan in split_plans]
        (dest / MANIFEST_NAME).unlink(missing_ok=True)
        _remove_stale_temps(dest)

        results: dict[str, ShardResult] = {}

        def record(result: ShardResult) -> None:
            results[result.info.name] = result
            if on_progress is not None:
                on_progress(len(results), len(jobs))

        if on_progress is not None:
            on_progress(0, len(jobs))
        workers = min(processes or _threads(len(jobs)), len(jobs))
        if processes is None and workers > 1:
            # threads by default: decoding, hashing and file I/O release the GIL, and a thread
            # costs nothing to start, where each spawned process pays ~0.5 s of CPU to start
            # Python and its imports (measured on 2 busy cores: 2 processes lost to 1, 2 threads
            # used the CPU of 1)
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
            rejected=checked.rejected,
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
        )
