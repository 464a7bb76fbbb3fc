"""The val split that `data shard` holds out of a source without one: a seeded share of each class.

A plain ImageFolder root (class folders, no train/ and val/), or an ImageNet tree without val,
has nothing to measure accuracy on. `hold_out` moves a fraction of every class's train images to
val: stratified, so each class keeps its share in both splits, and deterministic, so a re-run
(and a resumed one) holds out the same images and keeps the shards it wrote.

An image's place is its rank in its class by sha256 of the seed and its name in the source, not
its position in a shuffle: adding or removing an image moves at most one other between the
splits, and the choice never depends on which other classes are kept.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import replace

from sparknet.data.imagenet import ImageTree, SourceImage
from sparknet.data.manifest import HeldOut
from sparknet.errors import SparknetError

TRAIN, VAL = "train", "val"


def held_out_count(images: int, fraction: float) -> int:
    """How many of a class's `images` go to val: `fraction` of them rounded half up, but never
    the last one (a class needs a train image to be learnt)."""
    return max(0, min(math.floor(images * fraction + 0.5), images - 1))


def _rank(seed: int, image: SourceImage) -> str:
    return hashlib.sha256(f"{seed}\0{image.name}".encode()).hexdigest()


def hold_out(tree: ImageTree, fraction: float, seed: int, source: str) -> tuple[ImageTree, HeldOut]:
    """`tree` with `fraction` of each class's train images moved to a new val split (see the
    module docstring), and the record the manifest keeps of it.

    Args:
        tree: what `scan` found; it must have no val split of its own.
        fraction: the share of each class held out, above 0 and below 1.
        seed: picks which images; the same seed picks the same ones.
        source: how messages name the source (its path).

    Example::

        >>> held_out_count(10, 0.2), held_out_count(3, 0.5), held_out_count(1, 0.5)
        (2, 2, 0)
    """
    if not 0 < fraction < 1:
        raise SparknetError(
            "{@val_fraction=value} must be above 0 and below 1: the share of each class's "
            "images held out for val",
            value=fraction,
        )
    own = len(tree.splits.get(VAL, []))
    if own:
        raise SparknetError(
            "{source} has a val split of its own ({own} images); {@val_fraction} makes one "
            "where there is none: leave it out, or move val/ away to hold out a share of train",
            source=source,
            own=own,
        )
    by_class: dict[int, list[SourceImage]] = defaultdict(list)
    for image in tree.splits[TRAIN]:
        by_class[image.label].append(image)
    chosen: set[SourceImage] = set()
    for images in by_class.values():
        ranked = sorted(images, key=lambda image: _rank(seed, image))
        chosen.update(ranked[: held_out_count(len(images), fraction)])
    if not chosen:
        most = max(len(v) for v in by_class.values())
        if most < 2:
            raise SparknetError(
                "every class of {source} has one image, which training needs: add images, or "
                "leave {@val_fraction} out",
                source=source,
            )
        raise SparknetError(
            "{@val_fraction=value} holds out no image: the largest class of {source} has {most} "
            "images; raise it to at least {least}",
            value=fraction,
            source=source,
            most=most,
            least=math.ceil(500 / most) / 1000,
        )
    train = [image for image in tree.splits[TRAIN] if image not in chosen]
    val = [image for image in tree.splits[TRAIN] if image in chosen]
    splits = {**tree.splits, TRAIN: train, VAL: val}
    return replace(tree, splits=splits), HeldOut(fraction=fraction, seed=seed)
