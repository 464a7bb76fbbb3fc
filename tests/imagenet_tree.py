"""Synthetic ImageNet-layout trees for the tests: real JPEGs, fake wnids, learnable.

Every class has its own colour, stripe orientation and stripe period; each image adds a random
stripe phase, brightness, colour jitter and noise. That is easy for a small CNN at 32x32 to learn
in a few steps yet not trivial (no two images are identical), and the JPEG sizes vary like real
photos do, which is what shard planning works from.

An image depends only on (seed, class, split, index), never on the layout: the "folders" and
"kaggle" trees built with one seed hold byte-identical images under the same file names, so a
test can check one layout's labels against the other's.
"""

from __future__ import annotations

import colorsys
import csv
import io
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

#: the golden ratio's fractional part: hues k * this (mod 1) stay far apart for any class count
_HUE_STEP = 0.6180339887498949
_SPLIT_CODE = {"train": 0, "val": 1}
JPEG_QUALITY = 90


def wnid(k: int) -> str:
    """A fake but real-looking WordNet id: `n` and 8 digits."""
    return f"n{k:08d}"


def class_name(k: int) -> str:
    """The human-readable name the generated `LOC_synset_mapping.txt` gives class k."""
    return f"synthetic class {k}, stripes"


def val_file_name(n: int) -> str:
    """ILSVRC2012's validation file naming: 1-based, 8 digits."""
    return f"ILSVRC2012_val_{n:08d}.JPEG"


def render(k: int, *, split: str, i: int, size: tuple[int, int], seed: int) -> Image.Image:
    """Image i of class k: class colour and stripes, plus per-image phase, jitter and noise."""
    w, h = size
    rng = np.random.default_rng([seed, k, _SPLIT_CODE[split], i])
    hue = (k * _HUE_STEP + rng.normal(0.0, 0.015)) % 1.0
    base = np.array(colorsys.hsv_to_rgb(hue, 0.75, 0.9), dtype=np.float32)
    angle = np.pi * ((k * 3) % 8) / 8
    period = 10.0 + 6.0 * ((k * 7) % 5)
    xx = np.arange(w, dtype=np.float32)[None, :]
    yy = np.arange(h, dtype=np.float32)[:, None]
    proj = xx * np.float32(np.cos(angle)) + yy * np.float32(np.sin(angle))
    phase = np.float32(rng.uniform(0, 2 * np.pi))
    stripes = 0.5 + 0.5 * np.sin(np.float32(2 * np.pi / period) * proj + phase)
    brightness = np.float32(rng.uniform(0.8, 1.1))
    pixels = (base * brightness) * (0.3 + 0.7 * stripes)[..., None]
    pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * np.float32(0.06)
    return Image.fromarray((np.clip(pixels, 0, 1) * 255).astype(np.uint8))


def _save(image: Image.Image, path: Path) -> None:
    image.save(path, format="JPEG", quality=JPEG_QUALITY)


def make_tree(
    root: Path,
    *,
    classes: int = 10,
    train_per_class: int = 60,
    val_per_class: int = 10,
    size: tuple[int, int] = (160, 120),
    layout: Literal["folders", "kaggle"] = "folders",
    seed: int = 0,
) -> list[str]:
    """Write an ImageNet-like tree under `root` and return its wnids (class k is wnids[k]).

    "folders": `train/<wnid>/<wnid>_<i>.JPEG`, `val/<wnid>/ILSVRC2012_val_<n>.JPEG`.
    "kaggle": `ILSVRC/Data/CLS-LOC/train/<wnid>/<wnid>_<i>.JPEG`, flat
    `ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_<n>.JPEG` labelled by `LOC_val_solution.csv`.
    Both have `LOC_synset_mapping.txt` at `root`. Val images are numbered in a seeded shuffled
    order, as in ILSVRC2012, so a label cannot be guessed from the number.
    """
    if layout not in ("folders", "kaggle"):
        raise ValueError(f"unknown layout {layout!r}")
    wnids = [wnid(k) for k in range(classes)]
    data = root / "ILSVRC" / "Data" / "CLS-LOC" if layout == "kaggle" else root
    root.mkdir(parents=True, exist_ok=True)
    (root / "LOC_synset_mapping.txt").write_text(
        "".join(f"{w} {class_name(k)}\n" for k, w in enumerate(wnids))
    )
    for k, w in enumerate(wnids):
        (data / "train" / w).mkdir(parents=True, exist_ok=True)
        if layout == "folders" and val_per_class:
            (data / "val" / w).mkdir(parents=True, exist_ok=True)
        for i in range(train_per_class):
            image = render(k, split="train", i=i, size=size, seed=seed)
            _save(image, data / "train" / w / f"{w}_{i}.JPEG")
    if layout == "kaggle":
        (data / "val").mkdir(parents=True, exist_ok=True)
    val = [(k, i) for k in range(classes) for i in range(val_per_class)]
    order = np.random.default_rng([seed, 0xA1]).permutation(len(val))
    solution: list[tuple[str, str]] = []
    for n, pos in enumerate(order, start=1):
        k, i = val[pos]
        name = val_file_name(n)
        image = render(k, split="val", i=i, size=size, seed=seed)
        if layout == "kaggle":
            _save(image, data / "val" / name)
            solution.append((Path(name).stem, wnids[k]))
        else:
            _save(image, data / "val" / wnids[k] / name)
    if layout == "kaggle":
        with (root / "LOC_val_solution.csv").open("w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["ImageId", "PredictionString"])
            for image_id, w in sorted(solution):
                # Kaggle's boxes: "<wnid> x0 y0 x1 y1", repeated per object
                out.writerow([image_id, f"{w} 10 20 {size[0] - 10} {size[1] - 20} {w} 0 0 5 5 "])
    return wnids


def _decodes(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception:
        return False
    return True


def corrupt_jpeg(path: Path, *, seed: int = 0) -> None:
    """Overwrite the middle of the JPEG at `path` with garbage so that decoding it raises.

    libjpeg shrugs off some damage to entropy-coded data (it only warns), so garbage that still
    decodes is retried with other garbage, and as a last resort the file is also cut short; the
    result is checked, never assumed.
    """
    original = path.read_bytes()
    rng = np.random.default_rng([seed, 0xBAD])
    start, end = len(original) // 3, 2 * len(original) // 3
    for attempt in range(20):
        garbage = rng.integers(0, 256, size=end - start, dtype=np.uint8).tobytes()
        # 0xFF bytes start markers: a few force "unsupported marker" style errors
        garbage = garbage[:8] + b"\xff\xc0\xff\xff" * (attempt + 1) + garbage[12 + 4 * attempt :]
        data = original[:start] + garbage[: end - start] + original[end:]
        if attempt >= 10:
            data = data[:end]
        if not _decodes(data):
            path.write_bytes(data)
            return
    raise AssertionError(f"could not make {path} undecodable")
