"""What does bf16 autocast cost or gain against fp32, on this machine's CPU?

On GPUs bf16 (and fp16) autocast is the point: tensor cores run half-precision matmuls several
times faster. On a CPU the result depends on its bf16 support (AVX512-BF16, AMX) and on which
kernels oneDNN has; this figure shows that the path works and what it costs or gains here. fp16
(autocast plus a loss scaler) is printed beside it.

Both sides run the worker's own code, `train_partition`, in this process (no Spark: the
framework's per-round cost is `throughput`'s subject), on the same model, data, batch size and
threads. Precisions alternate call by call, so drift in this VM's speed falls on all alike; the
figures are medians of samples / compute seconds as the worker reports them.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparknet.bench.common import machine_note, median, steal_note, write_results
from sparknet.bench.workloads import INPUT_SHAPE, NUM_CLASSES, SYNTHETIC_IMAGES
from sparknet.config import TrainConfig
from sparknet.data.sources import TensorSource
from sparknet.models import build_model
from sparknet.training.state import StateLayout
from sparknet.training.worker import RoundTask, train_partition

NAME = "precision"
THREADS = 2
PRECISIONS = ("fp32", "bf16", "fp16")


def make_task(precision: str, model: str, tau: int, batch_size: int, run_dir: str) -> RoundTask:
    """One worker's round at `precision`; no optimizer state kept (fp16 keeps its loss scale,
    a few bytes, in `run_dir`'s temp store)."""
    cfg = TrainConfig(
        model=model,
        data=SYNTHETIC_IMAGES,
        workers=1,
        tau=tau,
        batch_size=batch_size,
        precision=precision,
        inner_state="reset",
        device="cpu",
    )
    torch.manual_seed(cfg.seed)
    state = build_model(model, INPUT_SHAPE, NUM_CLASSES).state_dict()
    layout = StateLayout.of(state)
    source = TensorSource.load(SYNTHETIC_IMAGES)
    return RoundTask(
        cfg, source, uuid.uuid4().hex[:12], 0, layout, layout.integers(state), NUM_CLASSES,
        INPUT_SHAPE, run_dir, cfg.first_tau,
    )  # fmt: skip


def samples_per_s(task: RoundTask, theta: np.ndarray, local_dir: str) -> float:
    report = train_partition(task, theta, 0, threads=THREADS, local_dir=local_dir).reports[0]
    return report.samples / report.compute_s


def run(*, repeats: int, tau: int, batch_size: int, model: str, out: Path) -> dict[str, Any]:
    """`sparknet bench precision`: prints its figures and writes `<out>/precision.json`."""
    machine = machine_note()
    print(
        f"workload: model {model}, synthetic 3x32x32, batch {batch_size}, "
        f"{THREADS} threads, {tau} steps per call, {repeats} calls per precision "
        "(after one unmeasured warm-up call each), precisions interleaved"
    )
    rates: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
        tasks = {p: make_task(p, model, tau, batch_size, tmp) for p in PRECISIONS}
        theta = tasks["fp32"].layout.flatten(
            build_model(model, INPUT_SHAPE, NUM_CLASSES).state_dict()
        )
        for p in PRECISIONS:
            samples_per_s(tasks[p], theta, tmp)
        for _ in range(repeats):
            for p in PRECISIONS:
                rates[p].append(samples_per_s(tasks[p], theta, tmp))

    rate = {p: median(r) for p, r in rates.items()}
    for p in PRECISIONS:
        shown = ", ".join(f"{x:.0f}" for x in rates[p])
        print(f"  {p}: median {rate[p]:8.1f} samples/s  ({shown})")
    ratio = rate["bf16"] / rate["fp32"]
    print(f"\nratio bf16/fp32: {ratio:.3f}  (on a GPU with tensor cores expect > 1)")
    print(f"ratio fp16/fp32: {rate['fp16'] / rate['fp32']:.3f}")

    steal_note(machine)
    results = {
        "machine": machine,
        "workload": {
            "model": model,
            "batch_size": batch_size,
            "tau": tau,
            "repeats": repeats,
            "threads": THREADS,
            "device": "cpu",
        },
        "samples_per_s": rates,
        "headline": [
            {
                "metric": "bf16 autocast training on the CPU, samples/s",
                "sparknet": rate["bf16"],
                "reference": rate["fp32"],
                "reference_name": "fp32",
                "ratio": ratio,
                "goal": "",
            },
            {
                "metric": "  fp16 autocast + loss scaling",
                "sparknet": rate["fp16"],
                "reference": rate["fp32"],
                "reference_name": "fp32",
                "ratio": rate["fp16"] / rate["fp32"],
                "goal": "",
            },
        ],
    }
    print(f"\nwrote {write_results(NAME, results, out)}")
    return results
