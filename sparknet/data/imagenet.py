"""ImageNet (ILSVRC2012) on disk: find its images and their labels.

`scan` reads what people actually have: the extracted tree (`train/<wnid>/*.JPEG`, val sorted
into `val/<wnid>/` as torchvision's ImageNet leaves it, or flat), Kaggle's (`ILSVRC/Data/
CLS-LOC/...`, flat `val/` labelled by `LOC_val_solution.csv`), the downloads of image-net.org as
they come (`ILSVRC2012_img_train.tar`, `ILSVRC2012_img_val.tar`, the devkit: see `ilsvrc`), and
a half-extracted train/ of `<wnid>.tar` files. The class list comes from train: class index =
position of the wnid in sorted order, the convention torchvision's ImageFolder and every ImageNet
checkpoint use, so indices agree with pretrained models. A subset of classes (`classes`) is
indexed 0..N-1 in its own sorted order. Any other tree of `train/<class>/*.jpg` works too, and so
does a plain ImageFolder root (`<class>/*.jpg`, no train/ or val/: it is all train, and `holdout`
can make its val).

Scanning never needs torch (only a torchvision `meta.bin` is read with it); decoding the images
found is `decode`'s.
"""

from __future__ import annotations

import csv
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from sparknet.data import ilsvrc
from sparknet.data.manifest import ClassInfo, RejectedImage
from sparknet.errors import SparknetError, no_such_directory

IMAGE_SUFFIXES = frozenset({".jpeg", ".jpg"})
#: where Kaggle's ImageNet puts the image directories, relative to the download's root
KAGGLE_DATA = Path("ILSVRC", "Data", "CLS-LOC")
SYNSET_MAPPING = "LOC_synset_mapping.txt"
WORDS = "words.txt"
#: torchvision's ImageNet writes (wnid -> class words, val wnids) here with torch.save
TORCHVISION_META = "meta.bin"
VAL_SOLUTION = "LOC_val_solution.csv"
SKIPPED_REASON = "skipped: not a .JPEG/.jpg file name"


@dataclass(frozen=True)
class SourceImage:
    """One image and its class index; `key` is its WebDataset sample key (unique, no dots).

    `name` is how the manifest and messages call it, relative to the source (a tar member's is
    `<tar>/<member>`). A tar member's bytes are `size` bytes of `path` from `offset`.
    """

    path: Path
    label: int
    key: str
    name: str = ""
    offset: int | None = None
    size: int | None = None

    def read_bytes(self) -> bytes:
        if self.offset is None or self.size is None:
            return self.path.read_bytes()
        return ilsvrc.read_range(self.path, self.offset, self.size)


@dataclass(frozen=True)
class ImageTree:
    """What `scan` found: the class list (index = position), each split's images (sorted), the
    files left out for their names (`skipped`), and the val images of classes not kept."""

    classes: list[ClassInfo]
    splits: dict[str, list[SourceImage]]
    skipped: list[RejectedImage] = field(default_factory=list)
    other_classes_val: int = 0
    #: how many classes the source's train has; more than `classes` for a subset
    source_classes: int = 0

    @property
    def num_classes(self) -> int:
        return len(self.classes)


class _Found(NamedTuple):
    """An image before it has a label and key: where its bytes are and its name in the source."""

    path: Path
    name: str
    offset: int | None = None
    size: int | None = None
    #: how many folders down in its class folder it lies (0: in the class folder itself)
    depth: int = 0


def scan(src: Path, classes: list[str] | None = None) -> ImageTree:
    """The classes and images under `src`: a dir holding train/ (and val/), Kaggle's root, or the
    dir holding the official ILSVRC2012 downloads. `classes` keeps only those wnids, in train and
    val alike (val images of the others are counted in `other_classes_val`).

    Raises a one-line SparknetError saying what to fix for a missing SRC, no train, an empty
    class, an unknown class in `classes`, or val images that cannot be labelled.
    """
    src = Path(src)
    if not src.exists():
        raise no_such_directory(src)
    if not src.is_dir():
        raise SparknetError(
            f"{src}: is not a directory; pass the directory that holds train/ and val/ (or class "
            f"folders), the one holding {ilsvrc.TRAIN_TAR}, or the Kaggle ImageNet root"
        )
    folder = is_image_folder(src)
    data = src if folder else _data_root(src)
    train_dir = src if folder else (data / "train" if data is not None else None)
    meta_dirs = _meta_dirs(src, data)
    devkit_path = ilsvrc.find_devkit(src)
    devkit = ilsvrc.read_devkit(devkit_path) if devkit_path is not None else None
    skipped: list[RejectedImage] = []
    train_classes = _class_dirs(src, src, tars=False) if folder else _train_classes(src, data)
    wnids = _kept(sorted(train_classes), classes, src)
    index = {w: i for i, w in enumerate(wnids)}
    names = devkit.names if devkit is not None else _class_names(meta_dirs)
    labelled: dict[str, list[tuple[_Found, int]]] = {"train": []}
    for w in wnids:
        images = _images(train_classes[w](), "train", skipped)
        if not images:
            raise SparknetError(
                f"{_where(src, train_dir, w)} has no images (*.JPEG/*.jpg): add its images or "
                "remove it"
            )
        labelled["train"].extend((f, index[w]) for f in images)
    val, other = (
        ([], 0)
        if folder
        else _scan_val(src, data, meta_dirs, devkit, index, set(train_classes), classes, skipped)
    )
    if val:
        labelled["val"] = val
    return ImageTree(
        classes=[ClassInfo(index=i, wnid=w, name=names.get(w)) for i, w in enumerate(wnids)],
        splits={split: _with_keys(pairs) for split, pairs in labelled.items()},
        skipped=skipped,
        other_classes_val=other,
        source_classes=len(train_classes),
    )


def _where(src: Path, train_dir: Path | None, wnid: str) -> str:
    """How an error names the place class `wnid` comes from."""
    if train_dir is not None and (train_dir / wnid).is_dir():
        return f"class directory {train_dir / wnid}"
    return (
        f"class tar {wnid}.tar in {train_dir if train_dir is not None else src / ilsvrc.TRAIN_TAR}"
    )


def is_image_folder(src: Path) -> bool:
    """Whether `src` is a plain ImageFolder root: it holds the class folders itself, and nothing
    of the layouts `_data_root` finds (the train tar, Kaggle's tree, a train/ or val/ that holds
    class folders or class tars, an empty train/ where the train tar is to be extracted).

    A train/ or val/ that holds images and no folders is a class of an ImageFolder that happens
    to bear that name; a val/ of images with no train/ beside it and no other class folder is
    ImageNet's flat val without its train (refused by `scan` with what to add)."""
    src = Path(src)
    if not src.is_dir() or any(p.exists() for p in (src / ilsvrc.TRAIN_TAR, src / "ILSVRC")):
        return False
    folders = [e.name for e in os.scandir(src) if e.is_dir() and not e.name.startswith(".")]
    if any(_holds_classes(src / split) for split in ("train", "val") if split in folders):
        return False
    if (src / "train").exists() and "train" not in folders:
        return False  # a file named train: not a class, and not ImageNet's
    if folders == ["val"]:
        return False
    return bool(folders)


def _holds_classes(split: Path) -> bool:
    """Whether a train/ or val/ is ImageNet's: class folders or `<wnid>.tar` files in it, or
    nothing at all (a train/ made to extract the train tar into)."""
    entries = [e for e in os.scandir(split) if not e.name.startswith(".")]
    return not entries or any(e.is_dir() or e.name.endswith(".tar") for e in entries)


def _data_root(src: Path) -> Path | None:
    """The directory holding train/: `src` itself, or Kaggle's `ILSVRC/Data/CLS-LOC` under it;
    None when train comes from the train tar in `src`."""
    tar = (src / ilsvrc.TRAIN_TAR).is_file()
    if (src / "train").is_dir() and not (tar and _nothing_in(src / "train")):
        return src  # an empty train/ beside the tar is where someone meant to extract it
    if (src / KAGGLE_DATA / "train").is_dir():
        return src / KAGGLE_DATA
    if tar:
        return None
    raise SparknetError(
        f"no train/ directory, class folders or {ilsvrc.TRAIN_TAR} in {src}: pass the directory "
        f"that holds train/ and val/ (or a folder per class), the one holding the ImageNet "
        f"downloads ({ilsvrc.TRAIN_TAR}, {ilsvrc.VAL_TAR}, {ilsvrc.DEVKIT_TAR}), or the Kaggle "
        f"ImageNet root (with {KAGGLE_DATA}/train/)"
    )


def _nothing_in(directory: Path) -> bool:
    return not any(not e.name.startswith(".") for e in os.scandir(directory))


def _meta_dirs(src: Path, data: Path | None) -> list[Path]:
    """Where the label files may be: SRC, the data root, and the Kaggle root above CLS-LOC."""
    dirs = [src] if data is None else [src, data]
    if data is not None and data.parts[-3:] == KAGGLE_DATA.parts:
        dirs.append(data.parents[2])
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _find(meta_dirs: list[Path], name: str) -> Path | None:
    return next((d / name for d in meta_dirs if (d / name).is_file()), None)


def _class_names(meta_dirs: list[Path]) -> dict[str, str]:
    """wnid -> human-readable name from torchvision's `meta.bin`, Kaggle's
    `LOC_synset_mapping.txt` or `words.txt` (the devkit's meta.mat comes before all three)."""
    meta_bin = _find(meta_dirs, TORCHVISION_META)
    if meta_bin is not None:
        return _torchvision_names(meta_bin)
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


def _torchvision_names(path: Path) -> dict[str, str]:
    """torchvision's `meta.bin`: `torch.save((wnid -> tuple of words, val wnids))`. Loaded with
    weights_only (plain containers and strings only: a pickle must not run code)."""
    import torch  # only for this file; scanning otherwise never needs torch

    try:
        wnid_to_words, _ = torch.load(path, weights_only=True)
        return {str(w): ", ".join(str(x) for x in words) for w, words in wnid_to_words.items()}
    except Exception as exc:  # torch.load raises many types for a foreign or damaged file
        raise SparknetError(
            f"{path} is not torchvision's ImageNet meta.bin ({type(exc).__name__}): remove it "
            "or let torchvision write it again"
        ) from None


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


def _train_classes(src: Path, data: Path | None) -> dict[str, Callable[[], list[_Found]]]:
    """wnid -> a function listing that class's files: class dirs and `<wnid>.tar` files in
    train/ (a half-extracted download), or the synset tars inside the train tar. Listing is
    deferred so that a subset of classes reads only its own."""
    if data is None:
        tar = src / ilsvrc.TRAIN_TAR
        out: dict[str, Callable[[], list[_Found]]] = {}
        for inner in ilsvrc.tar_members(tar):
            wnid, suffix = os.path.splitext(PurePosixPath(inner.name).name)
            if suffix != ".tar" or not wnid:
                continue
            if wnid in out:  # two tars of one class: one would replace the other's images
                raise SparknetError(
                    f"{tar} holds two tars of class {wnid} (the second is {inner.name}): it is "
                    f"not as downloaded; download {ilsvrc.TRAIN_TAR} again"
                )
            out[wnid] = lambda inner=inner: [
                _Found(tar, f"{ilsvrc.TRAIN_TAR}/{inner.name}/{m.name}", m.offset, m.size)
                for m in ilsvrc.nested_members(tar, inner)
            ]
        if not out:
            raise SparknetError(
                f"{tar} holds no <wnid>.tar files: it is not ImageNet's train tar; download "
                f"{ilsvrc.TRAIN_TAR} again"
            )
        return out
    return _class_dirs(src, data / "train", tars=True)


def _class_dirs(src: Path, train: Path, *, tars: bool) -> dict[str, Callable[[], list[_Found]]]:
    """wnid -> a function listing that class's files, for the class dirs in `train` and, with
    `tars`, its `<wnid>.tar` files (an extraction half done)."""
    dirs = {
        _utf8(train, e.name): e.path
        for e in os.scandir(train)
        if e.is_dir() and not e.name.startswith(".")
    }
    tars_found = {
        _utf8(train, e.name)[: -len(".tar")]: e.path
        for e in os.scandir(train)
        if tars and e.name.endswith(".tar") and not e.name.startswith(".") and e.is_file()
    }
    both = sorted(set(dirs) & set(tars_found))
    if both:
        raise SparknetError(
            f"{train} has both {both[0]}/ and {both[0]}.tar: an extraction stopped half way? "
            "Remove the one that is not complete"
        )
    if not dirs and not tars_found:
        raise SparknetError(
            f"{train} has no class directories: put each class's images in train/<wnid>/ (in "
            "an ImageFolder root, a class folder named train or val holds images, no folders)"
        )
    out = {w: (lambda p=Path(p): _class_files(src, p)) for w, p in dirs.items()}
    for w, p in tars_found.items():
        out[w] = lambda p=Path(p): [
            _Found(p, f"{_rel(src, p)}/{m.name}", m.offset, m.size) for m in ilsvrc.tar_members(p)
        ]
    return out


def _rel(src: Path, path: Path | str) -> str:
    return Path(os.path.relpath(path, src)).as_posix()


def _dir_files(src: Path, directory: Path) -> list[_Found]:
    """The regular files of a directory (hidden ones are no one's images), sorted by name."""
    return [
        _Found(directory / name, _rel(src, directory / name))
        for name in sorted(
            _utf8(directory, e.name)
            for e in os.scandir(directory)
            if not e.name.startswith(".") and e.is_file()
        )
    ]


def _class_files(src: Path, directory: Path) -> list[_Found]:
    """The files of a class folder and of every folder below it, as torchvision's ImageFolder
    takes them (os.walk, links followed; a folder reached twice through links is read once),
    hidden ones left out, sorted by name."""
    out: list[_Found] = []
    seen: set[str] = set()
    for here, subdirs, files in os.walk(directory, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:  # a link back up the tree: os.walk would go round it for ever
            subdirs[:] = []
            continue
        seen.add(real)
        subdirs[:] = sorted(_utf8(Path(here), d) for d in subdirs if not d.startswith("."))
        depth = len(Path(here).relative_to(directory).parts)
        for name in files:
            path = Path(here) / name
            if not name.startswith(".") and path.is_file():
                _utf8(Path(here), name)
                out.append(_Found(path, _rel(src, path), depth=depth))
    return sorted(out, key=lambda f: f.name)


def _images(found: list[_Found], split: str, skipped: list[RejectedImage]) -> list[_Found]:
    """The JPEGs of `found`, sorted by name; any other file is added to `skipped` (a `.png` or
    `.JPEG.bak` is not read, and the user should know how many were not)."""
    out = []
    for f in sorted(found, key=lambda f: f.name):
        base = PurePosixPath(f.name).name
        if os.path.splitext(base)[1].lower() in IMAGE_SUFFIXES:
            out.append(f)
        elif not base.startswith("."):
            skipped.append(RejectedImage(split=split, path=f.name, reason=SKIPPED_REASON))
    return out


def read_class_list(value: str) -> list[str]:
    """`--classes`: a file with one wnid per line (blank lines and `#` comments ignored), or
    wnids separated by commas."""
    path = Path(value)
    if path.is_dir():
        raise SparknetError(
            "{@classes=value} is a directory: give a file of wnids or wnid,...", value=value
        )
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8-sig")  # a BOM is not part of the first wnid
        except (OSError, UnicodeDecodeError) as exc:
            raise SparknetError(
                "{@classes} file {value} cannot be read as UTF-8 text ({kind}): give a text file "
                "of wnids, one a line",
                value=value,
                kind=exc.__class__.__name__,
            ) from None
        lines = (line.split("#", 1)[0] for line in text.splitlines())
        wnids = [w for line in lines for w in line.replace(",", " ").split()]
    elif os.sep in value or (value.endswith(".txt") and "," not in value):
        raise SparknetError(
            "{@classes} file {value} does not exist: give a file or wnid,wnid,...", value=value
        )
    else:
        wnids = value.replace(",", " ").split()
    if not wnids:
        raise SparknetError(
            "{@classes=value} names no class: give wnid,wnid,... or a file", value=repr(value)
        )
    return wnids


def _kept(wnids: list[str], classes: list[str] | None, src: Path) -> list[str]:
    """The classes to shard, sorted: all of train's, or `classes` when every one is in train."""
    if classes is None:
        return wnids
    have = set(wnids)
    unknown = sorted(set(classes) - have)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise SparknetError(
            "{@classes} names {first}{more}, which is not a train class of {src} ({count} "
            "classes): fix the list",
            first=unknown[0],
            more=more,
            src=src,
            count=len(wnids),
        )
    return sorted(set(classes))


def _scan_val(
    src: Path,
    data: Path | None,
    meta_dirs: list[Path],
    devkit: ilsvrc.Devkit | None,
    index: dict[str, int],
    train_wnids: set[str],
    classes: list[str] | None,
    skipped: list[RejectedImage],
) -> tuple[list[tuple[_Found, int]], int]:
    """Val's (image, label) pairs and how many val images of classes not kept were left out.

    val/<wnid>/* when val/ has class dirs; a flat val/ labelled by Kaggle's CSV or the devkit; or
    the val tar labelled by the devkit."""
    val_dir = data / "val" if data is not None else None
    flat: list[_Found] = []
    if val_dir is not None and val_dir.is_dir():
        subdirs = sorted(
            _utf8(val_dir, e.name)
            for e in os.scandir(val_dir)
            if e.is_dir() and not e.name.startswith(".")
        )
        if subdirs:
            return _val_class_dirs(src, val_dir, subdirs, index, train_wnids, classes, skipped)
        flat = _images(_dir_files(src, val_dir), "val", skipped)
        where = str(val_dir)
    if (not flat) and (src / ilsvrc.VAL_TAR).is_file():  # no val/, or an empty one
        tar = src / ilsvrc.VAL_TAR
        found = [
            _Found(tar, f"{ilsvrc.VAL_TAR}/{m.name}", m.offset, m.size)
            for m in ilsvrc.tar_members(tar)
        ]
        flat, where = _images(found, "val", skipped), str(tar)
    if not flat:
        return [], 0
    label_of, source = _flat_val_labels(src, meta_dirs, devkit, where)
    pairs, other = [], []
    for f in flat:
        stem = PurePosixPath(f.name).stem
        w = label_of(stem)
        if w is None:
            raise SparknetError(
                f"validation image {src / f.name} is not labelled by {source}: remove the "
                "image or use the labels that came with it"
            )
        if w in index:
            pairs.append((f, index[w]))
        else:
            other.append((f, w))
    if other and classes is None:
        f, w = other[0]
        raise SparknetError(
            "{other} of {total} validation images are labelled with classes that are not in "
            "train (e.g. {example}: {wnid}, by {source}): pass {@classes} with the classes to "
            "keep (a file of wnids, or wnid,wnid,...) to leave the others out, or add their "
            "train images",
            other=len(other),
            total=len(flat),
            example=src / f.name,
            wnid=w,
            source=source,
        )
    return pairs, len(other)


def _flat_val_labels(
    src: Path, meta_dirs: list[Path], devkit: ilsvrc.Devkit | None, where: str
) -> tuple[Callable[[str], str | None], str]:
    """stem -> wnid for flat val images, and what labels them: Kaggle's CSV, else the devkit."""
    solution_path = _find(meta_dirs, VAL_SOLUTION)
    if solution_path is not None:
        return _read_val_solution(solution_path).get, str(solution_path)
    if devkit is not None:
        wnids = devkit.val_wnids

        def from_devkit(stem: str) -> str | None:
            n = ilsvrc.val_number(stem)
            return wnids[n - 1] if n is not None and 1 <= n <= len(wnids) else None

        return from_devkit, devkit.where
    looked = " or ".join(str(d) for d in meta_dirs)
    raise SparknetError(
        f"{where} holds val images directly but nothing labels them (looked in {looked} for "
        f"{ilsvrc.DEVKIT_TAR} and {VAL_SOLUTION}): put the ILSVRC2012 devkit ({ilsvrc.DEVKIT_TAR})"
        f" in {src}, or sort the images into val/<wnid>/"
    )


def _val_class_dirs(
    src: Path,
    val_dir: Path,
    subdirs: list[str],
    index: dict[str, int],
    train_wnids: set[str],
    classes: list[str] | None,
    skipped: list[RejectedImage],
) -> tuple[list[tuple[_Found, int]], int]:
    out, other = [], 0
    for w in subdirs:
        if w not in train_wnids:
            raise SparknetError(
                f"validation directory {val_dir / w} is not a class in train/ "
                f"({len(train_wnids)} classes): remove it or add train/{w}/"
            )
        if w not in index:
            other += len(_images(_class_files(src, val_dir / w), "val", []))
            continue
        images = _images(_class_files(src, val_dir / w), "val", skipped)
        if not images:
            raise SparknetError(
                f"class directory {val_dir / w} has no images (*.JPEG/*.jpg): add its images "
                "or remove it"
            )
        out.extend((f, index[w]) for f in images)
    return out, other


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


def _with_keys(labelled: list[tuple[_Found, int]]) -> list[SourceImage]:
    """Give every image of a split a sample key unique within the split.

    The key is the file stem with anything but letters, digits, `_` and `-` replaced by `_`:
    WebDataset splits a member name at its first dot, and ImageNet's stems are unique already.
    An image in a subfolder of its class folder has its path below the class folder in its key
    (`nested/deep.jpg`: `nested_deep`). Stems that clash (e.g. `train/cat/1.jpg` and
    `train/dog/1.jpg` in a non-ImageNet tree) get their class directory (or tar) as a prefix,
    and anything still clashing a counter, in order.
    """
    names = [PurePosixPath(f.name) for f, _ in labelled]
    # an image in a subfolder of its class folder: its path below the class folder, `a/b/c`
    stems = [
        "_".join([*name.parent.parts[len(name.parent.parts) - f.depth :], name.stem])
        for name, (f, _) in zip(names, labelled, strict=True)
    ]
    keys = [_NOT_KEY.sub("_", stem) for stem in stems]
    clashes = Counter(keys)
    keys = [
        _NOT_KEY.sub("_", f"{name.parents[f.depth].name}_{stem}") if clashes[key] > 1 else key
        for key, name, stem, (f, _) in zip(keys, names, stems, labelled, strict=True)
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
        SourceImage(f.path, label, key, f.name, f.offset, f.size)
        for (f, label), key in zip(labelled, keys, strict=True)
    ]
