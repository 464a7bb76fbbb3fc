"""Turn an image tree into WebDataset tar shards plus `manifest.json`, resumably and in parallel.

Training reads big sequential tar shards instead of 1.28M small files (S3 and disks both want
that). Each split is shuffled once with a seed before it is cut, so every shard is a fair sample
of all classes and a worker that streams a few shards still sees every class.

Writing ImageNet takes a while, so it resumes: each shard gets a sidecar `.<name>.json` recording
the plan's fingerprint and the shard's sha256, written only after the shard is in place. A shard
whose sidecar matches its plan and its bytes is kept. The manifest is written last: a
destination without one is unfinished and readers refuse it. One writer per destination.

This module runs it as a whole (the destination's lock, the phases in order, the manifest); the
plan, the shard files, the decode check and the phases' workers are `shard_plan`, `shard_files`,
`shard_checks` and `shard_pool`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparknet.data.holdout import hold_out
from sparknet.data.imagenet import KAGGLE_DATA, ImageTree, is_image_folder, scan
from sparknet.data.manifest import MANIFEST_NAME, HeldOut, Manifest, RejectedImage
from sparknet.data.shard_checks import CheckedTree, check_images
from sparknet.data.shard_files import (
    FILE_MODE,
    ShardResult,
    atomic_write_text,
    ensure_shard,
    remove_orphans,
    remove_stale_temps,
)
from sparknet.data.shard_plan import Resize, plan_shards
from sparknet.data.shard_pool import WRITE, phase_workers, pool_ignoring_sigint
from sparknet.errors import SparknetError

DEFAULT_SHARD_BYTES = 256 * 2**20
#: the smallest `--max-side`: below it crops would be upscaled at any usual training size
MIN_SIDE = 32


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


def _os_error(exc: OSError, dest: Path) -> SparknetError:
    """One line for a file system error outside the source images (those are named by
    `read_image`): the destination is not a directory, not writable, or full."""
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
    shards: int | None = None,
    val_fraction: float | None = None,
) -> WriteReport:
    """Scan `src`, write every split's shards into `dest` and then `manifest.json`.

    Shards already written by an earlier run with the same plan and intact bytes are kept
    (`reused`); shards of an old plan that this one does not name are removed (`removed`).
    Images that do not decode are left out and listed in the manifest's `rejected`, as are files
    whose names are not JPEGs (`skipped`). `classes` keeps only those wnids (indexed 0..N-1);
    `resize` stores big images shrunk. `shards` cuts each split into that many shards (fewer
    where a split has fewer images; train must have enough) instead of by `shard_bytes`.
    `val_fraction` holds out that share of each class's train images as val (`holdout`, with
    `seed`), for a source without val such as a plain ImageFolder root; the manifest records it.
    Any old manifest is removed first, so `dest` reads as unfinished until this run completes.
    `processes` None checks and writes on every core, with threads for a small source and
    processes for a big one (`phase_workers`); a number uses that many processes for both.
    `on_progress(phase, done, total)` counts images of the "check" phase (decoding every image),
    then of the "write" phase (as each shard is finished).
    """
    if processes is not None and processes < 1:
        raise SparknetError(f"processes must be at least 1, got {processes}")
    if resize is not None and not (resize.max_side >= MIN_SIDE and 1 <= resize.quality <= 100):
        raise SparknetError(
            "{@max_side} must be at least {least} and {@quality} 1..100, got {side} and {quality}",
            least=MIN_SIDE,
            side=resize.max_side,
            quality=resize.quality,
        )
    if shards is not None and shards < 1:
        raise SparknetError("{@shards=value} must be at least 1", value=shards)
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
                # what can be known before decoding: a fraction that holds out nothing of the
                # files found holds out nothing of those that decode, too few files are too few
                # images; both are asked again of the images that decode (`_write_dataset`)
                checked_tree = (
                    hold_out(tree, val_fraction, seed, str(src))[0]
                    if val_fraction is not None
                    else tree
                )
                _check_shard_count(checked_tree, shards)
            except SparknetError:
                if new:  # a bad SRC leaves no DEST behind
                    (dest / LOCK_NAME).unlink(missing_ok=True)
                    with contextlib.suppress(OSError):
                        dest.rmdir()
                raise
            return _write_dataset(
                tree, src, dest, shard_bytes, seed, processes, resize, on_progress, shards,
                val_fraction,
            )  # fmt: skip
    except OSError as exc:
        raise _os_error(exc, dest) from None  # from None: the chained trace would print it twice


def _check_not_inside(src: Path, dest: Path) -> None:
    """DEST inside SRC's train/ or val/ (or inside a plain ImageFolder root) would be read as a
    class dir (of shards) by every run."""
    target = dest.resolve()
    places = [src] if is_image_folder(src) else []
    places += [
        where for split in ("train", "val") for where in (src / split, src / KAGGLE_DATA / split)
    ]
    for where in places:
        if where.is_dir() and target.is_relative_to(where.resolve()):
            raise SparknetError(
                f"{dest} is inside {where}, where every directory is read as a class: "
                "give a DEST outside it"
            )


def _check_shard_count(tree: ImageTree, shards: int | None, decoded: str = "") -> None:
    """Train needs an image for each of `shards` shards: every worker streams shards of its
    own, and an empty shard would starve one. `decoded`: how the message qualifies the images
    (" that decode", once they are checked)."""
    have = len(tree.splits.get("train", []))
    if shards is not None and shards > have:
        raise SparknetError(
            "{@shards=value} is more than the {have} train images{decoded}: give at most {have}",
            value=shards,
            have=have,
            decoded=decoded,
        )


def _decodable(
    tree: ImageTree,
    checked: CheckedTree,
    src: Path,
    seed: int,
    shards: int | None,
    val_fraction: float | None,
) -> tuple[CheckedTree, HeldOut | None]:
    """`checked` with val held out of the images that decode (so a class never loses its last
    train image to a file that does not), and `shards` checked against them."""
    held = None
    if val_fraction is not None:
        good, held = hold_out(replace(tree, splits=checked.good), val_fraction, seed, str(src))
        checked = replace(checked, good=good.splits)
    _check_shard_count(replace(tree, splits=checked.good), shards, " that decode")
    return checked, held


def _write_dataset(
    tree: ImageTree,
    src: Path,
    dest: Path,
    shard_bytes: int,
    seed: int,
    processes: int | None,
    resize: Resize | None,
    on_progress: Callable[[str, int, int], None] | None,
    shards: int | None = None,
    val_fraction: float | None = None,
) -> WriteReport:
    """`write_dataset` once the source is scanned, under DEST's lock; may raise OSError about
    the destination."""
    report = on_progress or (lambda phase, done, total: None)
    checked = check_images(tree, src, dest, processes, report)
    checked, held = _decodable(tree, checked, src, seed, shards, val_fraction)
    plans = {
        split: plan_shards(
            images,
            split=split,
            seed=seed,
            target_bytes=shard_bytes,
            resize=resize,
            pixels=checked.pixels,
            count=shards,
        )
        for split, images in checked.good.items()
    }
    jobs = [(plan, dest) for split_plans in plans.values() for plan in split_plans]
    (dest / MANIFEST_NAME).unlink(missing_ok=True)
    remove_stale_temps(dest)

    results: dict[str, ShardResult] = {}
    total = sum(len(plan.images) for plan, _ in jobs)
    written = 0

    def record(result: ShardResult) -> None:
        nonlocal written
        results[result.info.name] = result
        written += result.info.samples
        report(WRITE, written, total)

    report(WRITE, 0, total)
    kind, workers = phase_workers(processes, total, len(jobs))
    if kind == "threads" and workers > 1:  # a small source: see PROCESS_MIN_IMAGES
        with ThreadPoolExecutor(workers, thread_name_prefix="sparknet-shard") as pool:
            for result in pool.map(ensure_shard, jobs):
                record(result)
    elif workers <= 1:
        for job in jobs:
            record(ensure_shard(job))
    else:
        with pool_ignoring_sigint(workers) as pool:
            for result in pool.imap_unordered(ensure_shard, jobs):
                record(result)

    removed = remove_orphans(dest, {plan.name for plan, _ in jobs})
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
        held_out=held,
    )
    atomic_write_text(dest / MANIFEST_NAME, manifest.dumps())
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
