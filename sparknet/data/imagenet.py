"""ImageNet (ILSVRC2012) on disk: find its images and labels, decode them, and transform them.

`scan` reads the two layouts people actually have: the classic one (`train/<wnid>/*.JPEG`, val
sorted into `val/<wnid>/`) and Kaggle's (`ILSVRC/Data/CLS-LOC/...` with a flat `val/` labelled
by `LOC_val_solution.csv`). The class list always comes from train/: class index = position of
the wnid in sorted order, the convention torchvision's ImageFolder and every ImageNet checkpoint
use, so indices agree with pretrained models. Any other tree of `train/<class>/*.jpg` works too.

torchvision is imported lazily: scanning and shard writing (many processes) never need torch.
"""

from __future__ import annotations

import csv
import io
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from sparknet.data.manifest import ClassInfo
from sparknet.errors import SparknetError

if TYPE_CHECKING:
    import torch
    from torchvision.transforms.v2 import Compose

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

IMAGE_SUFFIXES = frozenset({".jpeg", ".jpg"})
#: where Kaggle's ImageNet puts the image directories, relative to the download's root
KAGGLE_DATA = Path("ILSVRC", "Data", "CLS-LOC")
SYNSET_MAPPING = "LOC_synset_mapping.txt"
WORDS = "words.txt"
VAL_SOLUTION = "LOC_val_solution.csv"
#: the eval resize keeps ImageNet's standard 224/256 crop ratio at any image size
EVAL_CROP_RATIO = 224 / 256


@dataclass(frozen=True)
class SourceImage:
    """One image file and its class index; `key` is its WebDataset sample key (unique, no dots)."""

    path: Path
    label: int
    key: str


@dataclass(frozen=True)
class ImageTree:
    """What `scan` found: the class list (index = position) and each split's images, sorted."""

    classes: list[ClassInfo]
    splits: dict[str, list[SourceImage]]

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def scan(src: Path) -> ImageTree:
    """The classes and images under `src`: the dir holding train/ (and val/), or Kaggle's root.

    Raises a one-line SparknetError saying what to fix for a missing SRC, no train/, an empty class
    dir, or val images that cannot be labelled with a train class.
    """
    src = Path(src)
    if not src.is_dir():
        raise SparknetError(
            f"{src} does not exist or is not a directory: pass the directory that holds train/ "
            f"and val/ (or the Kaggle ImageNet root, with {KAGGLE_DATA}/)"
        )
    data = _data_root(src)
    meta_dirs = _meta_dirs(src, data)
    train_dir = data / "train"
    wnids = _subdirs(train_dir)
    if not wnids:
        raise SparknetError(
            f"{train_dir} has no class directories: put each class's images in train/<wnid>/"
        )
    names = _class_names(meta_dirs)
    classes = [ClassInfo(index=i, wnid=w, name=names.get(w)) for i, w in enumerate(wnids)]
    index = {w: i for i, w in enumerate(wnids)}

    labelled: dict[str, list[tuple[Path, int]]] = {
        "train": [(p, index[w]) for w in wnids for p in _class_images(train_dir / w)]
    }
    val_dir = data / "val"
    if val_dir.is_dir():
        val = _scan_val(val_dir, index, meta_dirs)
        if val:
            labelled["val"] = val
    return ImageTree(
        classes=classes, splits={split: _with_keys(pairs) for split, pairs in labelled.items()}
    )


def _data_root(src: Path) -> Path:
    """The directory holding train/: `src` itself, or Kaggle's `ILSVRC/Data/CLS-LOC` under it."""
    if (src / "train").is_dir():
        return src
    if (src / KAGGLE_DATA / "train").is_dir():
        return src / KAGGLE_DATA
    raise SparknetError(
        f"no train/ directory in {src}: pass the directory that holds train/ and val/ "
        f"(or the Kaggle ImageNet root, with {KAGGLE_DATA}/train/)"
    )


def _meta_dirs(src: Path, data: Path) -> list[Path]:
    """Where the label files may be: SRC, the data root, and the Kaggle root above CLS-LOC."""
    dirs = [src, data]
    if data.parts[-3:] == KAGGLE_DATA.parts:
        dirs.append(data.parents[2])
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _find(meta_dirs: list[Path], name: str) -> Path | None:
    return next((d / name for d in meta_dirs if (d / name).is_file()), None)


def _class_names(meta_dirs: list[Path]) -> dict[str, str]:
    """wnid -> human-readable name from Kaggle's `LOC_synset_mapping.txt` or `words.txt`."""
    mapping = _find(meta_dirs, SYNSET_MAPPING)
    words = _find(meta_dirs, WORDS)
    if mapping is not None:
        pairs = (
            line.split(maxsplit=1) for line in mapping.read_text(encoding="utf-8").splitlines()
        )
    elif words is not None:
        pairs = (line.split("\t", 1) for line in words.read_text(encoding="utf-8").splitlines())
    else:
        return {}
    return {p[0].strip(): p[1].strip() for p in pairs if len(p) == 2 and p[1].strip()}


def _utf8(directory: Path, name: str) -> str:
    """`name` (of an entry of `directory`) when it is valid UTF-8: the manifest is JSON, which
    cannot hold the lone surrogates Python decodes other bytes to, and no reader could load it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(directory / name).decode("utf-8", "backslashreplace")
        raise SparknetError(
            f"{shown} has a name that is not valid UTF-8: rename it (or remove it), then run again"
        ) from None
    return name


def _subdirs(directory: Path) -> list[str]:
    """The sorted names of `directory`'s class directories (hidden ones are not classes)."""
    return sorted(
        _utf8(directory, e.name)
        for e in os.scandir(directory)
        if e.is_dir() and not e.name.startswith(".")
    )


def _is_image(entry: os.DirEntry[str]) -> bool:
    return (
        not entry.name.startswith(".")
        and os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES
        and entry.is_file()
    )


def _images_in(directory: Path) -> list[Path]:
    return [
        directory / name
        for name in sorted(_utf8(directory, e.name) for e in os.scandir(directory) if _is_image(e))
    ]


def _class_images(directory: Path) -> list[Path]:
    images = _images_in(directory)
    if not images:
        raise SparknetError(
            f"class directory {directory} has no images (*.JPEG/*.jpg): add its images or remove it"
        )
    return images


def _scan_val(
    val_dir: Path, index: dict[str, int], meta_dirs: list[Path]
) -> list[tuple[Path, int]]:
    """val/<wnid>/* when val/ has class dirs; otherwise a flat val/ labelled by Kaggle's CSV."""
    subdirs = _subdirs(val_dir)
    if subdirs:
        out = []
        for w in subdirs:
            if w not in index:
                raise SparknetError(
                    f"validation directory {val_dir / w} is not a class in train/ "
                    f"({len(index)} classes): remove it or add train/{w}/"
                )
            out.extend((p, index[w]) for p in _class_images(val_dir / w))
        return out
    flat = _images_in(val_dir)
    if not flat:
        return []
    solution_path = _find(meta_dirs, VAL_SOLUTION)
    if solution_path is None:
        where = " or ".join(str(d) for d in meta_dirs)
        raise SparknetError(
            f"{val_dir} holds images directly but no {VAL_SOLUTION} labels them (looked in "
            f"{where}): put Kaggle's {VAL_SOLUTION} in {meta_dirs[0]}, "
            "or sort the images into val/<wnid>/"
        )
    solution = _read_val_solution(solution_path)
    out = []
    for path in flat:
        w = solution.get(path.stem)
        if w is None:
            raise SparknetError(
                f"validation image {path} is not in {solution_path}: "
                "remove the image or use the CSV that came with it"
            )
        if w not in index:
            raise SparknetError(
                f"validation image {path} is labelled {w} in {solution_path}, which is not a "
                f"class in train/ ({len(index)} classes): add train/{w}/ or remove the image"
            )
        out.append((path, index[w]))
    return out


def _read_val_solution(path: Path) -> dict[str, str]:
    """ImageId -> wnid from `LOC_val_solution.csv` (the first word of each PredictionString)."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None or [h.strip() for h in header[:2]] != ["ImageId", "PredictionString"]:
            raise SparknetError(
                f"{path} does not start with the header ImageId,PredictionString: "
                f"use Kaggle's {VAL_SOLUTION}"
            )
        out = {}
        for n, row in enumerate(rows, start=2):
            if not row:
                continue
            words = row[1].split() if len(row) >= 2 else []
            if not words:
                raise SparknetError(
                    f"{path} line {n} has no wnid in its PredictionString: use Kaggle's "
                    f"{VAL_SOLUTION}"
                )
            out[row[0].strip()] = words[0]
    return out


_NOT_KEY = re.compile(r"[^A-Za-z0-9_-]")


def _with_keys(labelled: list[tuple[Path, int]]) -> list[SourceImage]:
    """Give every image of a split a sample key unique within the split.

    The key is the file stem with anything but letters, digits, `_` and `-` replaced by `_`:
    WebDataset splits a member name at its first dot, and ImageNet's stems are unique already.
    Stems that clash (e.g. `train/cat/1.jpg` and `train/dog/1.jpg` in a non-ImageNet tree) get
    their class directory as a prefix, and anything still clashing a counter, in path order.
    """
    keys = [_NOT_KEY.sub("_", path.stem) for path, _ in labelled]
    clashes = Counter(keys)
    keys = [
        _NOT_KEY.sub("_", f"{path.parent.name}_{path.stem}") if clashes[key] > 1 else key
        for key, (path, _) in zip(keys, labelled, strict=True)
    ]
    clashes, taken = Counter(keys), set(keys)
    for n, key in enumerate(keys):
        if clashes[key] > 1:
            suffix = 1
            while f"{key}_{suffix}" in taken:
                suffix += 1
            keys[n] = f"{key}_{suffix}"
            taken.add(keys[n])
    return [
        SourceImage(path=path, label=label, key=key)
        for (path, label), key in zip(labelled, keys, strict=True)
    ]


def image_problem(data: bytes) -> str | None:
    """Why `data` is not an image training can decode (one line), or None when it is.

    `verify` checks the file's structure and `load` decodes every pixel, which is what finds a
    truncated or garbled JPEG; `data shard` calls this on every image so that a bad file is named
    once, at shard time, instead of being skipped silently on every epoch.
    """
    if not data:
        return "empty file"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. corrupt EXIF: a warning, the pixels are fine
            with Image.open(io.BytesIO(data)) as image:
                image.verify()
            with Image.open(io.BytesIO(data)) as image:
                image.load()
    except Exception as exc:  # PIL raises many types for bad data (OSError, SyntaxError, ...)
        return _without_addresses(" ".join(str(exc).split())) or type(exc).__name__
    return None


def _without_addresses(reason: str) -> str:
    """PIL names the stream it read (`<_io.BytesIO object at 0x7f...>`): an address that differs
    every run and tells the user nothing."""
    return re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", reason).strip()


def decode_image(data: bytes, min_size: int | None = None) -> Image.Image:
    """Decode encoded image bytes to an RGB PIL image; raises on corrupt data.

    With `min_size`, a JPEG is decoded at the smallest of libjpeg's 1/2, 1/4, 1/8 scales whose
    shorter side is still >= min_size (PIL's draft mode): training at 32-64 px on CPU then skips
    most of the IDCT work, several times faster than decoding a 500x375 photo in full.
    """
    image = Image.open(io.BytesIO(data))
    if min_size is not None:
        # draft picks the largest scale with both sides >= the requested ones; a no-op if not JPEG
        image.draft("RGB", (min_size, min_size))
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def train_transform(image_size: int) -> Compose:
    """ImageNet training augmentation: random-resized crop and flip, to a uint8 CHW tensor.

    Scaling to float and normalizing happen once per batch (`normalize`), not per image: one
    vectorised op instead of a few per image, and a quarter of the bytes through the DataLoader's
    worker queues. All randomness is drawn from torch's global CPU generator, so seeding it
    before each sample makes its augmentation reproducible (a retried task sees the same crops).
    """
    from torchvision.transforms import v2

    return v2.Compose(
        [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip(), v2.ToImage()]
    )


def eval_resize(image_size: int) -> int:
    """The shorter side an eval image is resized to before the centre crop (256 for 224)."""
    return round(image_size / EVAL_CROP_RATIO)


def eval_transform(image_size: int) -> Compose:
    """ImageNet evaluation: resize the shorter side to size*256/224, centre crop; uint8 CHW."""
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.Resize(eval_resize(image_size), antialias=True),
            v2.CenterCrop(image_size),
            v2.ToImage(),
        ]
    )


def normalize(batch: torch.Tensor) -> torch.Tensor:
    """A uint8 (N, 3, H, W) batch to float32 scaled to [0, 1] and normalized with ImageNet's
    mean and std, as `ToDtype(scale=True)` + `Normalize` would do image by image."""
    import torch

    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return batch.to(torch.float32).div_(255).sub_(mean).div_(std)
