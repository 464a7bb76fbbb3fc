"""ImageNet-like JPEGs with no download, and a moto S3 server to stream them from.

What `sparknet bench data-stream`, `images-per-core` and `shard-workers` measure with.

The images are 500x375 crops of scikit-learn's two bundled photos (random crop, scale, flip,
colour jitter and a little sensor noise), JPEG quality tuned so the mean file lands near
ImageNet's ~110 KB. moto's S3 server runs in a child process pinned to its own core, standing in
for a remote S3 off the measured one.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

# `# lazy: X` below: scikit-learn (seconds) and moto only where photos are cut or the S3
# server starts

IMAGE_WH = (500, 375)
TARGET_BYTES = 110_000
QUALITIES = range(85, 99)
CLASSES = 10
BUCKET = "sparknet-bench"
#: fake credentials for moto; the endpoint is passed explicitly
MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


# ---- the images -------------------------------------------------------------------------------


def photo_images(n: int, seed: int = 0) -> list[Image.Image]:
    """n distinct 500x375 RGB photos cut from scikit-learn's two bundled 640x427 ones."""
    from sklearn.datasets import load_sample_images  # lazy: scikit-learn

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(seed)
    w_out, h_out = IMAGE_WH
    out = []
    for i in range(n):
        photo = photos[i % len(photos)]
        pw, ph = photo.size
        h = int(min(ph, pw * h_out / w_out) * rng.uniform(0.55, 1.0))
        w = int(h * w_out / h_out)
        x, y = int(rng.integers(0, pw - w + 1)), int(rng.integers(0, ph - h + 1))
        image = photo.crop((x, y, x + w, y + h)).resize(IMAGE_WH, Image.Resampling.BICUBIC)
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.75, 1.25))
        image = ImageEnhance.Contrast(image).enhance(rng.uniform(0.8, 1.2))
        image = ImageEnhance.Color(image).enhance(rng.uniform(0.6, 1.4))
        pixels = np.asarray(image, dtype=np.float32)
        pixels += rng.normal(0.0, 4.0, (h_out, w_out, 1)).astype(np.float32)  # sensor noise
        out.append(Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)))
    return out


def encode(image: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def photo_jpegs(n: int) -> tuple[list[bytes], int]:
    """n ImageNet-like JPEGs, and the quality whose mean size on a sample is nearest 110 KB."""
    images = photo_images(n)
    sample = images[:16]
    quality = min(
        QUALITIES,
        key=lambda q: abs(np.mean([len(encode(im, q)) for im in sample]) - TARGET_BYTES),
    )
    return [encode(im, quality) for im in images], quality


def write_tree(root: Path, jpegs: list[bytes]) -> None:
    """`train/<wnid>/<wnid>_<i>.JPEG`, image i in class i % CLASSES."""
    for i, data in enumerate(jpegs):
        wnid = f"n{i % CLASSES:08d}"
        (root / "train" / wnid).mkdir(parents=True, exist_ok=True)
        (root / "train" / wnid / f"{wnid}_{i}.JPEG").write_bytes(data)


# ---- moto's S3 server in its own process, on its own core ---------------------------------


def _serve_s3(conn: Connection, cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    from moto.server import ThreadedMotoServer  # lazy: moto

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port()[1])
    with contextlib.suppress(EOFError):
        conn.recv()  # anything, or the parent's end closing, means stop
    server.stop()


@contextlib.contextmanager
def s3_server(cpus: set[int] | None) -> Iterator[tuple[str, int]]:
    """(endpoint URL, pid) of a moto S3 server running in a child process pinned to `cpus`."""
    parent, child = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(
        target=_serve_s3, args=(child, cpus), name="moto-s3", daemon=True
    )
    proc.start()
    child.close()
    try:
        if not parent.poll(60):
            raise RuntimeError("moto's S3 server did not start within 60 s")
        port = parent.recv()
        assert proc.pid is not None
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        parent.close()
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
