"""The dataset manifest: what shards a dataset has, what is in them, and the class list.

A dataset is a directory (local or an S3 prefix) of WebDataset tar shards plus `manifest.json`.
The manifest is written (and uploaded) last, so a dataset without one is unfinished and is never
read. Every shard is recorded with its sample count, byte size and sha256: readers map a sample
position to a shard without opening any, and `verify` checks bytes against it.

Shard members are `<key>.jpg` (encoded image bytes) and `<key>.cls` (the class index, ASCII).

Format versions: 1 has classes and splits. 2 adds `rejected`, the source images `data shard` left
out (they do not decode, or their names are not JPEGs'). 3 adds `subset_of` (the dataset holds
some of its source's classes, indexed 0..N-1 in sorted-wnid order, not the source's indices) and
`max_side`/`quality` (images longer than max_side were stored shrunk to it). 4 adds `held_out`
(val was held out of the source's train images, a seeded fraction of each class). A
manifest is written at the lowest version that holds what it has, so a plain dataset stays
readable by sparknet releases that know only version 1 (they refuse a later version with a
one-line error, as they would any manifest they cannot read).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sparknet.errors import SparknetError

MANIFEST_NAME = "manifest.json"
FORMAT = "sparknet-shards"
VERSION = 1
#: the version of a manifest that lists rejected images
VERSION_REJECTED = 2
#: the version of a manifest of a class subset or of shrunk images
VERSION_SUBSET = 3
#: the version of a manifest whose val split was held out of train
VERSION_HELD_OUT = 4
#: a shard's file name: `<split>-<6-digit index>.tar`
SHARD_PATTERN = r"^[a-z]+-\d{6}\.tar$"


_HASH_CHUNK = 1 << 20


def sha256_stream(f: BinaryIO, on_chunk: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a stream read to its end in 1 MiB chunks (shards are hundreds of MiB)."""
    digest = hashlib.sha256()
    while chunk := f.read(_HASH_CHUNK):
        digest.update(chunk)
        if on_chunk is not None:
            on_chunk(len(chunk))
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f)


class ShardInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=SHARD_PATTERN)
    samples: int = Field(ge=0)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ClassInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    wnid: str
    name: str | None = None


class RejectedImage(BaseModel):
    """A source image that `data shard` did not pack: where it was and why it cannot be used."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    split: str
    path: str
    reason: str


class HeldOut(BaseModel):
    """How `data shard --val-fraction` made val from a source without one: in every class, the
    `fraction` (rounded, at least one image left in train) of its images that rank first by
    sha256 of the seed and the image's name in the source. The same source, fraction and seed
    hold out the same images; an image added to a class moves at most one other."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fraction: float = Field(gt=0, lt=1)
    seed: int
    method: Literal["per-class-sha256-rank"] = "per-class-sha256-rank"


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["sparknet-shards"] = FORMAT
    version: Literal[1, 2, 3, 4] = VERSION
    classes: list[ClassInfo]
    splits: dict[str, list[ShardInfo]]
    rejected: list[RejectedImage] = Field(default_factory=list)
    #: how many classes the source has when this dataset holds only some of them: class indices
    #: then run 0..N-1 over the kept classes, not the source's (e.g. ImageNet-1k's) indices
    subset_of: int | None = Field(None, ge=2)
    #: `data shard --max-side`: images longer than this were stored shrunk to it, as JPEGs of
    #: `quality`
    max_side: int | None = Field(None, ge=1)
    quality: int | None = Field(None, ge=1, le=100)
    #: `data shard --val-fraction`: the val split is these images of the source's train
    held_out: HeldOut | None = None

    @model_validator(mode="after")
    def _version_follows_content(self) -> Manifest:
        """The lowest version that holds what this manifest has (see the module docstring)."""
        if self.held_out is not None:
            version = VERSION_HELD_OUT
        elif self.subset_of is not None or self.max_side is not None:
            version = VERSION_SUBSET
        elif self.rejected:
            version = VERSION_REJECTED
        else:
            version = VERSION
        object.__setattr__(self, "version", version)
        return self

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def shards(self, split: str) -> list[ShardInfo]:
        """The shards of `split`; a one-line error naming the splits there are when it is absent."""
        if split not in self.splits or not self.splits[split]:
            have = ", ".join(sorted(self.splits)) or "none"
            raise SparknetError(f"the dataset has no {split!r} split (it has: {have})")
        return self.splits[split]

    def samples(self, split: str) -> int:
        return sum(s.samples for s in self.shards(split))

    def dumps(self) -> str:
        # an older reader forbids keys it does not know: leave out the empty ones
        exclude = {
            k
            for k in ("rejected", "subset_of", "max_side", "quality", "held_out")
            if not getattr(self, k)
        }
        return json.dumps(self.model_dump(mode="json", exclude=exclude), indent=1) + "\n"

    @classmethod
    def loads(cls, text: str | bytes, where: str) -> Manifest:
        """Parse a manifest; `where` names it in the error (a path or URI)."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "manifest"
            raise SparknetError(
                f"{where} is not a sparknet dataset manifest ({loc}: {err['msg']}); "
                "re-create it with `sparknet data shard`"
            ) from exc
