"""Replicas of image-net.org's three ILSVRC2012 downloads, built from a `make_tree` folder tree.

- `ILSVRC2012_img_train.tar`: one `<wnid>.tar` per class inside, each holding
  `<wnid>_<i>.JPEG`, as downloaded (member order is not sorted, as in the real file);
- `ILSVRC2012_img_val.tar`: the flat `ILSVRC2012_val_<n>.JPEG` files;
- `ILSVRC2012_devkit_t12.tar.gz`: `data/meta.mat` (a `synsets` struct array written with
  scipy, with the real fields, leaves with ILSVRC2012_IDs that are NOT in sorted-wnid order, and
  non-leaf synsets after them, as in the real one) and
  `data/ILSVRC2012_validation_ground_truth.txt` (line n: the id of val image n).

The folder tree they are made from is the ground truth: the same file names hold the same bytes.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
from scipy.io import savemat

from tests.imagenet_tree import class_name

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
DEVKIT_TAR = "ILSVRC2012_devkit_t12.tar.gz"
#: non-leaf synsets in the replica's meta.mat (the real one has 860 after its 1,000 leaves)
NON_LEAVES = 3


def ilsvrc_ids(wnids: list[str], seed: int = 0) -> dict[str, int]:
    """The replica's wnid -> ILSVRC2012_ID (1..N): a seeded permutation, so that the id order is
    not the sorted-wnid order, as in the real devkit (n01440764 is id 449 there)."""
    order = np.random.default_rng([seed, 0x1D5]).permutation(len(wnids))
    return {wnids[pos]: n for n, pos in enumerate(order, start=1)}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            _add(tar, name, data)
    return out.getvalue()


def _meta_mat(wnids: list[str], ids: dict[str, int]) -> bytes:
    fields = [
        "ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children",
        "wordnet_height", "num_train_images",
    ]  # fmt: skip
    rows = [
        (ids[w], w, class_name(int(w[1:])), "a replica", 0, np.zeros((1, 0)), 0, 1300)
        for w in sorted(wnids, key=ids.get)
    ]
    n = len(wnids)
    for k in range(NON_LEAVES):  # parents: ids after the leaves, with children
        rows.append(
            (n + k + 1, f"n{90000000 + k:08d}", f"group {k}", "", 2, np.array([1, 2]), 1, 0)
        )
    synsets = np.zeros((len(rows), 1), dtype=[(f, object) for f in fields])
    for i, row in enumerate(rows):
        synsets[i, 0] = row
    out = io.BytesIO()
    savemat(out, {"synsets": synsets})
    return out.getvalue()


def make_downloads(folders: Path, dest: Path, wnids: list[str]) -> dict[str, int]:
    """Write the three downloads of the `make_tree` tree `folders` into `dest`; wnid -> id."""
    dest.mkdir(parents=True, exist_ok=True)
    ids = ilsvrc_ids(wnids)
    with tarfile.open(dest / TRAIN_TAR, "w", format=tarfile.GNU_FORMAT) as outer:
        for w in reversed(wnids):  # the real tar is not in sorted order either
            files = sorted((folders / "train" / w).iterdir(), key=lambda p: p.name, reverse=True)
            _add(outer, f"{w}.tar", _tar_bytes([(p.name, p.read_bytes()) for p in files]))
    val = sorted((p for p in (folders / "val").glob("*/*")), key=lambda p: p.name)
    with tarfile.open(dest / VAL_TAR, "w", format=tarfile.GNU_FORMAT) as tar:
        for p in val:
            _add(tar, p.name, p.read_bytes())
    truth = "".join(f"{ids[p.parent.name]}\n" for p in val)
    with tarfile.open(dest / DEVKIT_TAR, "w:gz") as tar:
        _add(tar, "ILSVRC2012_devkit_t12/data/meta.mat", _meta_mat(wnids, ids))
        _add(
            tar, "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt", truth.encode()
        )
        _add(tar, "ILSVRC2012_devkit_t12/readme.txt", b"replica\n")
    return ids
