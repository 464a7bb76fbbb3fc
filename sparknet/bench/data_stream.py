"""Does streaming ImageNet shards from S3 cost image throughput, against the same JPEGs in memory?

A training task reads its images as WebDataset shards streamed from S3, and decodes and augments
them on the executor's cores. The goal is that the streaming (the GETs, the tar parsing, the
prefetch thread, the DataLoader around the decode) costs under 10% of the images per second that
decoding and augmenting the same JPEG bytes held in memory reaches, on ONE core.

The images are ImageNet-like: 500x375 crops of scikit-learn's two bundled photos (random crop,
scale, flip, colour jitter and a little sensor noise, no download), JPEG quality tuned so the mean
file lands near ImageNet's ~110 KB. They are written as an ImageNet tree, sharded with
`write_dataset` and uploaded with `upload_dataset` to moto's S3 server, which runs in its own
process on core 1 (standing in for a remote S3, off the measured core); everything measured runs
on core 0 with one torch thread.

- reference: decode (`decode_image`, min_size 224: no draft reduction at 500x375, a full decode)
  and torchvision's transform recipe image by image (RandomResizedCrop 224, flip, ToDtype float,
  Normalize) of every JPEG from a list in memory, torch's CPU generator seeded per sample;
- sparknet: `ShardSource.train_batches` over the S3 store (one partition, loader_workers=0), the
  real task code: S3 GET streams, tar parsing, the prefetch thread, the DataLoader, decode, the
  same crop and flip per image, then float + normalize once per batch. It
  runs rounds of one step, batch k in round k, so every image is read once per repetition; the
  stream stays open from round to round (the task's kept cursor), as in training.
The reference decodes the very images the rounds read, in their order and with their per-sample
seeds, so both sides make the same random crops (the resize work depends on the crop's size).

Also timed, for the breakdown, in steps from one side to the other: the reference also stacking
its outputs into batches; sparknet's DataLoader fed the same items from memory (no stream); the
rounds over the local shard dir (tar parsing and the prefetch thread, no S3); and, alone, the raw
S3 stream (no decode) and decode without the transform.

This VM's speed drifts by tens of percent over seconds even with both cores otherwise idle, so
the paths are interleaved finely: every path does batch k (40 images, a fraction of a second)
before any does batch k+1, in an order reversed every other batch. A pass goes over all images;
one pass warms up and 3 are measured, first for the headline pair alone, then for all the paths
of the breakdown together. Medians are reported, and the headline ratio of every pass.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparknet.bench.common import (
    Counted,
    Step,
    interleaved,
    machine_note,
    median,
    steal_note,
    write_results,
)
from sparknet.bench.photos import (
    BUCKET,
    CLASSES,
    IMAGE_WH,
    MOTO_ENV,
    photo_jpegs,
    s3_server,
    write_tree,
)
from sparknet.data.decode import IMAGENET_MEAN, IMAGENET_STD, TrainDecoder, decode_image
from sparknet.data.loader import decoded_batches, derived_seed
from sparknet.data.shards import write_dataset
from sparknet.data.stream import read_positions
from sparknet.errors import SparknetError

# `# lazy: X` below: boto3 and torchvision only on the paths that use them (the S3 side, the
# reference transforms)

NAME = "data_stream"
GOAL = 0.9
IMAGE_SIZE = 224
PREFIX = "imagenet-like"


# ---- CPU accounting ---------------------------------------------------------------------------


def _core_jiffies() -> dict[int, tuple[int, int]]:
    """core -> (busy, total) jiffies from /proc/stat's per-CPU lines; empty where there are none."""
    out = {}
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *rest = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            fields = [int(x) for x in rest]
            out[int(name[3:])] = (sum(fields) - fields[3] - fields[4], sum(fields))
    return out


def _pid_cpu_s(pid: int) -> float | None:
    """utime + stime of process `pid` so far, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the measured paths -----------------------------------------------------------------------


def memory_path(
    jpegs: list[bytes], seeds: list[int], transform: Callable | None, batch_size: int = 0
) -> Counted:
    """Decode (and transform, when given) every JPEG from memory: the reference loop; with
    `batch_size`, the transformed images are also stacked into batches, as training needs them."""
    batch: list[torch.Tensor] = []
    for data, seed in zip(jpegs, seeds, strict=True):
        image = decode_image(data, min_size=IMAGE_SIZE)
        if transform is not None:
            torch.default_generator.manual_seed(seed)  # same crops as sparknet's; ~1 us
            x = transform(image)
            if batch_size:
                batch.append(x)
                if len(batch) == batch_size:
                    torch.stack(batch)
                    batch = []
    if batch:
        torch.stack(batch)
    return len(jpegs), sum(len(d) for d in jpegs)


def loader_from_memory(jpegs: list[bytes], seeds: list[int], batch_size: int) -> Counted:
    """The same samples through sparknet's DataLoader (`decoded_batches`), handed over from memory
    in batches: the loader and the collate without any shard stream."""
    steps = (
        [(jpegs[k], 0, seeds[k]) for k in range(b, min(b + batch_size, len(jpegs)))]
        for b in range(0, len(jpegs), batch_size)
    )
    images = sum(
        int(batch.x.shape[0])
        for batch in decoded_batches(steps, TrainDecoder(IMAGE_SIZE), workers=0)
    )
    return images, 0


def stream_order(store: Any, shards: list, n: int) -> list[bytes]:
    """The JPEG bytes of the first n stream positions, in the order a training round reads them."""
    items = read_positions(
        shards, lambda info: store.open(info.name), seed=0, workers=1, partition=0, start=0
    )
    try:
        got = [next(items) for _ in range(n)]
    finally:
        items.close()
    if any(s is None for s in got):
        raise RuntimeError("the shard stream skipped samples")
    return [s.data for s in got]  # type: ignore[union-attr]


def sparknet_round(source: Any, run_id: str, rnd: int, batch_size: int) -> Counted:
    """Round `rnd` of one step through `ShardSource.train_batches`: the next `batch_size` stream
    positions, read on from where round `rnd - 1` of the same `run_id` left the stream."""
    from sparknet.data.sources import TaskInput  # lazy: boto3

    inp = TaskInput(partition=0, workers=1, seed=0, run_id=run_id)
    images = skipped = 0
    for batch in source.train_batches(inp, rnd, 1, batch_size):
        images += int(batch.x.shape[0])
        skipped += batch.skipped
    if skipped:
        raise RuntimeError(f"{skipped} samples were skipped")
    return images, 0


def run(*, images: int, batch_size: int, shard_mb: float, reps: int, out: Path) -> dict[str, Any]:
    """`sparknet bench data-stream`: prints its figures and writes `<out>/data_stream.json`."""
    if reps < 1:
        raise SparknetError("--reps must be >= 1")
    if images % batch_size:
        raise SparknetError(
            "--images must be a multiple of --batch-size (a pass reads every image once)"
        )
    units = images // batch_size

    from torchvision.transforms import v2  # lazy: torchvision

    from sparknet.data.sources import ShardSource  # lazy: boto3
    from sparknet.data.store import load_manifest, open_store  # lazy: boto3
    from sparknet.data.transfer import upload_dataset  # lazy: boto3

    machine = machine_note()
    cores = sorted(os.sched_getaffinity(0))
    measured_core = cores[0]
    server_cores = {cores[1]} if len(cores) > 1 else None
    if server_cores is None:
        print("  warning: one core only; the S3 server shares it with the measured loop")

    tmp = Path(tempfile.mkdtemp(prefix="sparknet-bench-"))
    try:
        t0 = time.perf_counter()
        jpegs, quality = photo_jpegs(images)
        sizes = np.array([len(d) for d in jpegs])
        write_tree(tmp / "tree", jpegs)
        report = write_dataset(
            tmp / "tree", tmp / "shards", shard_bytes=int(shard_mb * 2**20), processes=1
        )
        shards = report.manifest.shards("train")
        print(
            f"workload: {images} JPEGs {IMAGE_WH[0]}x{IMAGE_WH[1]} (quality {quality}), "
            f"mean {sizes.mean() / 1e3:.1f} KB (min {sizes.min() / 1e3:.0f}, "
            f"max {sizes.max() / 1e3:.0f}), {CLASSES} classes, in {len(shards)} shards of "
            f"{np.mean([s.bytes for s in shards]) / 2**20:.1f} MiB; image_size {IMAGE_SIZE}, "
            f"batch {batch_size}, {units} rounds of 1 step; measured on core {measured_core}, "
            f"S3 server on "
            f"{'core ' + str(min(server_cores)) if server_cores else 'the same core'} "
            f"(built in {time.perf_counter() - t0:.1f} s)"
        )

        for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(key, None)
        os.environ.update(MOTO_ENV)
        with s3_server(server_cores) as (endpoint, server_pid):
            import boto3  # lazy: boto3

            boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
            uri = f"s3://{BUCKET}/{PREFIX}"
            upload_dataset(tmp / "shards", uri, endpoint_url=endpoint)

            os.sched_setaffinity(0, {measured_core})
            torch.set_num_threads(1)
            s3_store = open_store(uri, endpoint)
            local_store = open_store(tmp / "shards")
            manifest = load_manifest(s3_store)

            def source(store: Any) -> ShardSource:
                return ShardSource(
                    store=store,
                    manifest=manifest,
                    image_size=IMAGE_SIZE,
                    loader_workers=0,
                    cache_dir=None,
                    cache_bytes=0,
                )

            s3_source, local_source = source(s3_store), source(local_store)
            # torchvision's recipe, image by image: crop, flip, to float, normalize. sparknet
            # runs the same crop and flip per image and scales + normalizes once per batch.
            transform = v2.Compose(
                [
                    v2.RandomResizedCrop(IMAGE_SIZE, antialias=True),
                    v2.RandomHorizontalFlip(),
                    v2.ToImage(),
                    v2.ToDtype(torch.float32, scale=True),
                    v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                ]
            )
            # the reference decodes the very images a round reads, in its order and with its
            # per-sample seeds: the same crops, so the same resize work, on both sides
            ordered = stream_order(local_store, shards, images)
            if sorted(ordered) != sorted(jpegs):
                raise RuntimeError("the shards do not hold the images written")
            b = batch_size
            seeds = [derived_seed(0, 0, k // b, k % b) for k in range(images)]
            raw: dict[int, Iterator] = {}  # per repetition: the raw S3 stream, read on per unit

            def raw_take(rep: int, n: int) -> Counted:
                if rep not in raw:
                    raw[rep] = read_positions(
                        shards, lambda info: s3_store.open(info.name), seed=0, workers=1,
                        partition=0, start=0,
                    )  # fmt: skip
                got = [next(raw[rep]) for _ in range(n)]
                return n, sum(len(s.data) for s in got if s is not None)

            def part(k: int) -> slice:
                return slice(k * b, (k + 1) * b)

            #: each path does unit k (batch k) of pass `rep`; a pass reads every image once
            paths: dict[str, Step] = {
                "reference: decode + transform from memory": lambda rep, k: memory_path(
                    ordered[part(k)], seeds[part(k)], transform
                ),
                "sparknet: S3 stream + decode + transform": lambda rep, k: sparknet_round(
                    s3_source, f"s3-{rep}", k, b
                ),
                "reference + torch.stack into batches": lambda rep, k: memory_path(
                    ordered[part(k)], seeds[part(k)], transform, b
                ),
                "sparknet's DataLoader, items from memory": lambda rep, k: loader_from_memory(
                    ordered[part(k)], seeds[part(k)], b
                ),
                "sparknet round over the local shard dir": lambda rep, k: sparknet_round(
                    local_source, f"local-{rep}", k, b
                ),
                "raw S3 stream alone (no decode)": lambda rep, k: raw_take(rep, b),
                "decode only from memory (no transform)": lambda rep, k: memory_path(
                    ordered[part(k)], seeds[part(k)], None
                ),
            }
            ref_name, spark_name = list(paths)[:2]
            cores_before, server_before = _core_jiffies(), _pid_cpu_s(server_pid)
            self_before, t_measure = time.process_time(), time.perf_counter()
            # the headline pair alone, then every path again for the breakdown
            head = interleaved(
                {name: paths[name] for name in (ref_name, spark_name)},
                reps=reps,
                units=units,
            )
            parts = interleaved(paths, reps=reps, units=units, first_rep=reps + 1)
            for it in raw.values():
                it.close()
            measure_s = time.perf_counter() - t_measure
            self_cpu_s = time.process_time() - self_before
            cores_after, server_after = _core_jiffies(), _pid_cpu_s(server_pid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    tick = os.sysconf("SC_CLK_TCK")
    core_busy = {
        c: (cores_after[c][0] - cores_before[c][0]) / max(1, cores_after[c][1] - cores_before[c][1])
        for c in cores_after
        if c in cores_before
    }
    core_busy_s = {c: (cores_after[c][0] - cores_before[c][0]) / tick for c in core_busy}
    server_cpu_s = (
        None if server_before is None or server_after is None else server_after - server_before
    )
    others_on_measured = (
        core_busy_s[measured_core] - self_cpu_s if measured_core in core_busy_s else None
    )

    rates = {name: parts.rate(name) for name in paths}
    ratio = head.rate(spark_name) / head.rate(ref_name)
    # within one pass both sides ran interleaved: the ratio least touched by the VM's drift
    pair_ratios = [r / s for r, s in zip(head.wall[ref_name], head.wall[spark_name], strict=True)]
    print(f"\nheadline pair alone, {reps} passes after a warm-up one:")
    for name in (ref_name, spark_name):
        print(
            f"  {name:44s} {head.rate(name):7.1f} images/s   passes (s): "
            f"{', '.join(f'{x:.3f}' for x in head.wall[name])}"
        )
    print(f"  ratio per pass: {', '.join(f'{x:.3f}' for x in pair_ratios)}")

    print(f"\nbreakdown, every path interleaved, median of {reps} passes:")
    print(f"  {'path':44s} {'images/s':>9s} {'vs ref':>7s} {'ms/image':>9s} {'CPU ms/image':>13s}")
    for name in paths:
        n, nbytes = parts.counted[name]
        w, c = median(parts.wall[name]), median(parts.cpu[name])
        mbs = f"  {nbytes / w / 1e6:.0f} MB/s of JPEG bytes" if nbytes and "stream" in name else ""
        print(
            f"  {name:44s} {rates[name]:9.1f} {rates[name] / rates[ref_name]:7.3f} "
            f"{1e3 * w / n:9.2f} {1e3 * c / n:13.2f}{mbs}"
        )
    local_rate = rates["sparknet round over the local shard dir"]
    raw_name = "raw S3 stream alone (no decode)"
    raw_mbs = parts.counted[raw_name][1] / median(parts.wall[raw_name]) / 1e6
    raw_cpu_ms = 1e3 * median(parts.cpu[raw_name]) / parts.counted[raw_name][0]
    busy_text = ", ".join(f"core {c} {b:.0%}" for c, b in sorted(core_busy.items()))
    print(
        f"  during the measured runs ({measure_s:.0f} s): CPUs busy {busy_text}; this process "
        f"used {self_cpu_s:.1f} CPU s, the S3 server "
        f"{'?' if server_cpu_s is None else f'{server_cpu_s:.1f}'} CPU s, anything else on "
        f"core {measured_core} "
        f"{'?' if others_on_measured is None else f'{max(0.0, others_on_measured):.1f}'} s"
    )
    print(f"\nimages/s sparknet (S3 stream + decode + transform): {head.rate(spark_name):8.1f}")
    print(f"images/s reference (decode + transform, memory):    {head.rate(ref_name):8.1f}")
    print(f"ratio sparknet/reference: {ratio:.3f}  (goal >= {GOAL})")
    print(
        f"  in the breakdown: S3 {rates[spark_name] / rates[ref_name]:.3f}, local shard dir "
        f"{local_rate / rates[ref_name]:.3f}"
    )

    steal_note(machine)
    results = {
        "machine": machine,
        "workload": {
            "images": images,
            "image_wh": list(IMAGE_WH),
            "jpeg_quality": quality,
            "jpeg_mean_bytes": float(sizes.mean()),
            "shards": len(shards),
            "shard_mean_bytes": float(np.mean([s.bytes for s in shards])),
            "image_size": IMAGE_SIZE,
            "batch_size": batch_size,
            "rounds_per_repetition": units,
            "reps": reps,
            "measured_core": measured_core,
            "server_cores": sorted(server_cores) if server_cores else None,
        },
        "ratio": ratio,
        "pair_ratios": pair_ratios,
        "headline_wall_s": head.wall,
        "breakdown_images_per_s": rates,
        "breakdown_wall_s": parts.wall,
        "breakdown_cpu_s": parts.cpu,
        "breakdown_local_dir_ratio": local_rate / rates[ref_name],
        "raw_s3_stream_mb_per_s": raw_mbs,
        "raw_s3_stream_cpu_ms_per_image": raw_cpu_ms,
        "cpu_during_measurement": {
            "seconds": measure_s,
            "core_busy": {str(c): b for c, b in core_busy.items()},
            "self_cpu_s": self_cpu_s,
            "s3_server_cpu_s": server_cpu_s,
            "others_on_measured_core_s": others_on_measured,
        },
        "headline": [
            {
                "metric": "images/s on 1 core, S3 stream + decode + transform",
                "sparknet": head.rate(spark_name),
                "reference": head.rate(ref_name),
                "reference_name": "same JPEGs from memory",
                "ratio": ratio,
                "goal": f">= {GOAL}",
            },
        ],
    }
    print(f"\nwrote {write_results(NAME, results, out)}")
    return results
