"""Which images go into which shard.

Each split shuffled once with a seed, then cut evenly into shards of about the target size (or
into a given number of shards), each with a fingerprint of what it holds.

Kept apart from writing (`shard_files`): a plan is arithmetic on file sizes and stats, the same
on every run from the same source, and its fingerprint is what a resumed run compares a shard's
sidecar with.
"""

from __future__ import annotations

import hashlib
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparknet.data.imagenet import SourceImage
from sparknet.errors import SparknetError

#: tar stores each member as a 512-byte header plus its data padded to 512-byte blocks
TAR_BLOCK = 512
#: a streamed tar ends with two zero blocks and is padded to a 10 KiB record: at most 21 blocks
TAR_TAIL = 21 * TAR_BLOCK
#: USTAR's name field; a longer member name costs a PAX header (2 blocks) in front of it
TAR_NAME_MAX = 100


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


def _tar_bytes(size: int, key: str) -> int:
    """What one sample (`<key>.jpg` of `size` bytes and a short `<key>.cls`) takes in a tar."""
    per_member = TAR_BLOCK + (2 * TAR_BLOCK if len(key) + 4 > TAR_NAME_MAX else 0)
    return 2 * per_member + -(-size // TAR_BLOCK) * TAR_BLOCK + TAR_BLOCK


def _file_key(st: os.stat_result) -> list[int]:
    """What says a source file is unchanged since a run: size and mtime alone miss an overwrite
    that keeps the mtime (`cp -p`, `rsync -t`); that sets the ctime (and a copy-and-rename a new
    inode), which no user tool can set back."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def source_keys(images: list[SourceImage]) -> list[list[int]]:
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


def _cut_into(tar_sizes: np.ndarray, count: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges: `count` parts (at most one per item), none empty, even in bytes where the
    midpoint cut leaves no part empty, else even in items (a few huge images among small ones)."""
    count = min(count, len(tar_sizes))
    ends = np.cumsum(tar_sizes)
    midpoints = ends - tar_sizes / 2
    part = np.minimum((midpoints * count / max(int(ends[-1]), 1)).astype(np.int64), count - 1)
    if np.all(np.bincount(part, minlength=count) > 0):
        bounds = (np.flatnonzero(np.diff(part)) + 1).tolist()
    else:
        bounds = [len(tar_sizes) * k // count for k in range(1, count)]
    return list(zip([0, *bounds], [*bounds, len(tar_sizes)], strict=True))


def plan_shards(
    images: list[SourceImage],
    *,
    split: str,
    seed: int,
    target_bytes: int,
    resize: Resize | None = None,
    pixels: dict[SourceImage, tuple[int, int]] | None = None,
    count: int | None = None,
) -> list[ShardPlan]:
    """Shuffle a split's images with `seed` and cut them into shards of about `target_bytes`.

    The cut works from the file sizes plus tar overhead: it is the even cut (each image goes to the
    share its byte midpoint falls in, so there is no runt last shard) into the fewest shards that
    all stay at or under the target. An image bigger than the target gets a shard of its own.
    `count` cuts into that many shards instead, whatever their size (fewer only where the split
    has fewer images): a small dataset gets a shard for each worker.
    """
    if target_bytes <= 0:
        raise SparknetError(f"the shard size must be positive, got {target_bytes} bytes")
    if count is not None and count < 1:
        raise SparknetError("{@shards=value} must be at least 1", value=count)
    if not images:
        return []
    order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(images))
    shuffled = [images[i] for i in order]
    keys = source_keys(shuffled)
    sizes = [
        image.size if image.size is not None else key[0]
        for image, key in zip(shuffled, keys, strict=True)
    ]
    if resize is not None and pixels is not None:
        sizes = [
            resize.estimate(size, *pixels.get(image, (0, 0)))
            for size, image in zip(sizes, shuffled, strict=True)
        ]
    tar_sizes = np.array(
        [_tar_bytes(size, image.key) for size, image in zip(sizes, shuffled, strict=True)]
    )
    if count is not None:
        groups = _cut_into(tar_sizes, count)
    else:
        groups = _even_cut(tar_sizes, room=max(1, target_bytes - TAR_TAIL))
    return [
        ShardPlan(
            name=f"{split}-{number:06d}.tar",
            images=shuffled[lo:hi],
            fingerprint=_fingerprint(shuffled[lo:hi], keys[lo:hi], resize),
            resize=resize,
        )
        for number, (lo, hi) in enumerate(groups)
    ]
