"""The decode check `data shard` runs on every image before any shard is planned.

Journaled as it goes, so an interrupted or repeated run decodes only the images it has not
checked yet.

Kept apart from writing: a phase of its own over images rather than shards, with its own files
in the destination (CHECKS_NAME, JOURNAL_NAME) and its own way of resuming.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sparknet.data.decode import inspect_image
from sparknet.data.imagenet import ImageTree, SourceImage
from sparknet.data.manifest import RejectedImage
from sparknet.data.shard_files import FILE_MODE, atomic_write_text, read_image
from sparknet.data.shard_plan import source_keys
from sparknet.data.shard_pool import CHECK, phase_workers, pool_ignoring_sigint
from sparknet.errors import SparknetError

#: decode-check results of an earlier run, so a re-run decodes only new or changed images
CHECKS_NAME = ".sparknet-checks.json"
#: decode-check results as they come (one JSON line each), so an interrupted or killed run keeps
#: what it checked; folded into CHECKS_NAME when the check phase ends
JOURNAL_NAME = ".sparknet-checks.jsonl"
#: images handed to the check pool at a time: bounds memory (1.3M futures would be gigabytes)
#: and what Ctrl-C waits for
CHECK_BATCH = 1024


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
        pass  # no record, or an unreadable one: every image is checked again
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
    return tuple(inspect_image(read_image(image)))  # type: ignore[return-value]


def _batches(items: list, size: int) -> Iterator[list]:
    for lo in range(0, len(items), size):
        yield items[lo : lo + size]


def _checked(
    images: list[SourceImage], processes: int | None
) -> Iterator[tuple[str | None, int, int]]:
    """`_inspect` of each image, in order, on the workers `phase_workers` picks.

    Handed over CHECK_BATCH images at a time, so an interrupted run stops within one batch."""
    if not images:
        return
    kind, n = phase_workers(processes, len(images), len(images))
    if kind == "processes":
        with pool_ignoring_sigint(n) as pool:
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
    keys = source_keys([image for _, image in images])
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
    atomic_write_text(dest / CHECKS_NAME, json.dumps(record) + "\n")
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
