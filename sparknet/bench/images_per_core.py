"""Images per second per core at 224 px: sparknet's shard stream against torchvision's recipe.

Measured with full-size shards and with `data shard --max-side` shards, with what the smaller
images cost in accuracy.

Throughput, on ONE core with one torch thread (moto's S3 server on the other core, standing in for
a remote S3): the training transform at 224 px (random-resized crop, flip, to float, normalize)
of the same 500x375 ImageNet-like JPEGs (~110 KB, cut from scikit-learn's two bundled photos; see
`photos`) through
- torchvision's standard recipe: `ImageFolder` on the extracted files + `DataLoader` (the
  pytorch/examples ImageNet transforms: RandomResizedCrop, RandomHorizontalFlip, ToTensor,
  Normalize), num_workers 0;
- sparknet: `ShardSource.train_batches` streaming full-size shards from S3 (the real task code,
  loader_workers 0; `TrainDecoder` decodes at a reduced DCT scale where the crop allows);
- sparknet: the same from shards written with `--max-side 256` (quality 90).
The paths are interleaved batch by batch (this VM's speed drifts); medians of the passes.
Goals: >= 1.1x torchvision at full size, >= 2.5x with --max-side 256.

Accuracy (`--accuracy`, on by default): a set of real photographs, 8 classes = the quadrants of
the two bundled photos, each image a random crop inside its quadrant resized to 500x375 with
colour jitter, sharded full size and with --max-side; the same `sparknet train` (cnn at 64 px,
K=2, the same rounds and seeds) on each; mean top-1 on the val split over the seeds (one
training's top-1 moves by points with its seed). Goal: within 2 points.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageEnhance

from sparknet.bench.common import interleaved, machine_note, steal_note, write_results
from sparknet.bench.data_stream import sparknet_round
from sparknet.bench.photos import (
    BUCKET,
    IMAGE_WH,
    MOTO_ENV,
    encode,
    photo_jpegs,
    s3_server,
    write_tree,
)
from sparknet.data.decode import IMAGENET_MEAN, IMAGENET_STD
from sparknet.data.shard_plan import Resize
from sparknet.data.shards import write_dataset
from sparknet.errors import SparknetError

# `# lazy: X` below: boto3, torchvision and scikit-learn only on the paths that use them (the S3
# side, torchvision's reference loader, the accuracy photos)

NAME = "images_per_core"
IMAGE_SIZE = 224
MAX_SIDE = 256
GOAL_FULL, GOAL_SMALL, GOAL_POINTS = 1.1, 2.5, 2.0


@dataclass(frozen=True)
class Settings:
    """The options of `sparknet bench images-per-core`."""

    images: int
    batch_size: int
    reps: int
    accuracy: bool
    per_class: int
    tau: int
    rounds: int
    seeds: int


# ---- throughput -------------------------------------------------------------------------------


def torchvision_loader(root: Path, batch_size: int, seed: int):
    """pytorch/examples' ImageNet training data path, as most people run it."""
    from torchvision import datasets, transforms  # lazy: torchvision

    recipe = transforms.Compose(
        [
            transforms.RandomResizedCrop(IMAGE_SIZE),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        datasets.ImageFolder(str(root), recipe),
        batch_size=batch_size, shuffle=True, num_workers=0, generator=generator,
    )  # fmt: skip


def throughput(args: Settings, tmp: Path) -> dict[str, Any]:
    from sparknet.data.sources import ShardSource  # lazy: boto3
    from sparknet.data.store import load_manifest, open_store  # lazy: boto3
    from sparknet.data.transfer import upload_dataset  # lazy: boto3

    jpegs, quality = photo_jpegs(args.images)
    write_tree(tmp / "tree", jpegs)
    sizes = np.array([len(d) for d in jpegs])
    datasets = {
        "full": write_dataset(tmp / "tree", tmp / "full", shard_bytes=12 << 20),
        f"max-side {MAX_SIDE}": write_dataset(
            tmp / "tree", tmp / "small", shard_bytes=12 << 20, resize=Resize(MAX_SIDE)
        ),
    }
    shard_mb = {k: sum(s.bytes for s in r.manifest.shards("train")) / 2**20
                for k, r in datasets.items()}  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))
    measured, server = cores[0], ({cores[1]} if len(cores) > 1 else None)
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(key, None)
    os.environ.update(MOTO_ENV)
    b = args.batch_size
    units = args.images // b
    with s3_server(server) as (endpoint, _pid):
        import boto3  # lazy: boto3

        boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        sources = {}
        for (name, _), local in zip(datasets.items(), ("full", "small"), strict=True):
            uri = f"s3://{BUCKET}/{local}"
            upload_dataset(tmp / local, uri, endpoint_url=endpoint)
            store = open_store(uri, endpoint)
            sources[name] = ShardSource(store, load_manifest(store), IMAGE_SIZE, 0, None, 0)
        os.sched_setaffinity(0, {measured})
        torch.set_num_threads(1)
        loaders: dict[int, Any] = {}

        def torchvision_batch(rep: int, k: int) -> tuple[int, int]:
            if rep not in loaders:
                loaders[rep] = iter(torchvision_loader(tmp / "tree" / "train", b, rep))
            x, _ = next(loaders[rep])
            return int(x.shape[0]), 0

        paths = {
            "torchvision: ImageFolder + DataLoader": torchvision_batch,
            **{
                f"sparknet: S3 shards, {name}": (
                    lambda rep, k, s=source, n=name: sparknet_round(s, f"{n}-{rep}", k, b)
                )
                for name, source in sources.items()
            },
        }
        result = interleaved(paths, reps=args.reps, units=units)
    ref = next(iter(paths))
    rates = {name: result.rate(name) for name in paths}
    print(
        f"\nthroughput: {args.images} JPEGs {IMAGE_WH[0]}x{IMAGE_WH[1]} (quality {quality}, mean "
        f"{sizes.mean() / 1e3:.0f} KB) at {IMAGE_SIZE} px, batch {b}, on core {measured}, "
        f"median of {args.reps} passes:"
    )
    for name, rate in rates.items():
        print(f"  {name:44s} {rate:7.1f} images/s  {rate / rates[ref]:5.2f}x")
    for k, mb in shard_mb.items():
        print(f"  shards {k}: {mb:.1f} MiB")
    return {
        "images": args.images,
        "jpeg_quality": quality,
        "jpeg_mean_bytes": float(sizes.mean()),
        "shard_mib": shard_mb,
        "images_per_s": rates,
        "wall_s": result.wall,
        "ratio_full": rates["sparknet: S3 shards, full"] / rates[ref],
        "ratio_small": rates[f"sparknet: S3 shards, max-side {MAX_SIDE}"] / rates[ref],
    }


# ---- accuracy ---------------------------------------------------------------------------------


def quadrant_photos(per_class: int, split: str, seed: int) -> list[tuple[int, Image.Image]]:
    """(class, 500x375 image): class = one quadrant of one of the two bundled photos; each image
    a random crop inside that quadrant, with colour jitter. Real pixels, learnable classes."""
    from sklearn.datasets import load_sample_images  # lazy: scikit-learn

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    out = []
    for c in range(4 * len(photos)):
        photo = photos[c // 4]
        pw, ph = photo.size
        qx, qy = (c % 2) * pw // 2, ((c // 2) % 2) * ph // 2
        for _ in range(per_class):
            w = int(pw / 2 * rng.uniform(0.45, 0.9))
            h = int(w * IMAGE_WH[1] / IMAGE_WH[0])
            x = qx + int(rng.integers(0, pw // 2 - w + 1))
            y = qy + int(rng.integers(0, max(1, ph // 2 - h + 1)))
            image = photo.crop((x, y, x + w, y + h)).resize(IMAGE_WH, Image.Resampling.BICUBIC)
            image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.7, 1.3))
            image = ImageEnhance.Color(image).enhance(rng.uniform(0.6, 1.4))
            out.append((c, image))
    return out


def photo_tree(root: Path, per_class: int, val_per_class: int) -> None:
    for split, n in (("train", per_class), ("val", val_per_class)):
        for i, (c, image) in enumerate(quadrant_photos(n, split, seed=0)):
            wnid = f"n{c:08d}"
            (root / split / wnid).mkdir(parents=True, exist_ok=True)
            (root / split / wnid / f"{wnid}_{i}.JPEG").write_bytes(encode(image, 90))


def train_top1(data: Path, out: Path, args: Settings, seed: int) -> float:
    cmd = [
        str(Path(sys.executable).with_name("sparknet")), "train", "--data", str(data),
        "--model", "cnn", "--image-size", "64", "--workers", "2", "--tau", str(args.tau),
        "--rounds", str(args.rounds), "--batch-size", "32", "--seed", str(seed), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"training failed: {done.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return float([r for r in rows if "eval_accuracy" in r][-1]["eval_accuracy"])


def measure_accuracy(args: Settings, tmp: Path) -> dict[str, Any]:
    photo_tree(tmp / "photos", args.per_class, args.per_class // 3)
    write_dataset(tmp / "photos", tmp / "photos-full", shard_bytes=8 << 20)
    write_dataset(
        tmp / "photos", tmp / "photos-small", shard_bytes=8 << 20, resize=Resize(MAX_SIDE)
    )
    small_name = f"max-side {MAX_SIDE}"
    top1: dict[str, list[float]] = {"full": [], small_name: []}
    for seed in range(args.seeds):  # one training's top-1 moves by points with its seed
        for name, data in (("full", "photos-full"), (small_name, "photos-small")):
            top1[name].append(train_top1(tmp / data, tmp / f"run-{data}-{seed}", args, seed))
    mean = {k: float(np.mean(v)) for k, v in top1.items()}
    points = 100 * (mean["full"] - mean[small_name])
    print(
        f"\naccuracy: 8 classes of real photographs, {args.per_class} train images each; cnn at "
        f"64 px, K=2, tau {args.tau}, {args.rounds} rounds, seeds 0..{args.seeds - 1}:"
    )
    for k, v in top1.items():
        print(f"  top-1 from {k} shards: mean {100 * mean[k]:.1f}%  per seed "
              f"{', '.join(f'{100 * x:.1f}' for x in v)}")  # fmt: skip
    print(f"  full - max-side, means: {points:+.1f} points (goal: within {GOAL_POINTS})")
    return {"top1": top1, "mean": mean, "points": points, "per_class": args.per_class,
            "tau": args.tau, "rounds": args.rounds, "seeds": args.seeds}  # fmt: skip


def run(
    *,
    images: int,
    batch_size: int,
    reps: int,
    accuracy: bool,
    per_class: int,
    tau: int,
    rounds: int,
    seeds: int,
    out: Path,
) -> dict[str, Any]:
    """`sparknet bench images-per-core`: prints its figures, writes `<out>/images_per_core.json`."""
    args = Settings(images, batch_size, reps, accuracy, per_class, tau, rounds, seeds)
    if args.images % args.batch_size:
        raise SparknetError("--images must be a multiple of --batch-size")
    machine = machine_note()
    tmp = Path(tempfile.mkdtemp(prefix="sparknet-bench-"))
    t0 = time.perf_counter()
    try:
        results: dict[str, Any] = {"machine": machine, "throughput": throughput(args, tmp)}
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        if args.accuracy:
            results["accuracy"] = measure_accuracy(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tp = results["throughput"]
    print(
        f"\nratio sparknet/torchvision, images/s per core at {IMAGE_SIZE} px: full size "
        f"{tp['ratio_full']:.2f} (goal >= {GOAL_FULL}), max-side {MAX_SIDE} "
        f"{tp['ratio_small']:.2f} (goal >= {GOAL_SMALL})  [{time.perf_counter() - t0:.0f} s]"
    )
    steal_note(machine)
    results["headline"] = [
        {"metric": "images/s per core at 224 px vs torchvision, full-size shards",
         "sparknet": tp["images_per_s"]["sparknet: S3 shards, full"],
         "reference": tp["images_per_s"]["torchvision: ImageFolder + DataLoader"],
         "reference_name": "torchvision ImageFolder + DataLoader",
         "ratio": tp["ratio_full"], "goal": f">= {GOAL_FULL}"},
        {"metric": f"images/s per core at 224 px vs torchvision, --max-side {MAX_SIDE} shards",
         "sparknet": tp["images_per_s"][f"sparknet: S3 shards, max-side {MAX_SIDE}"],
         "reference": tp["images_per_s"]["torchvision: ImageFolder + DataLoader"],
         "reference_name": "torchvision ImageFolder + DataLoader",
         "ratio": tp["ratio_small"], "goal": f">= {GOAL_SMALL}"},
    ]  # fmt: skip
    print(f"\nwrote {write_results(NAME, results, out)}")
    return results
