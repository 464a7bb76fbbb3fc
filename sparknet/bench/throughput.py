"""Does training through sparknet cost throughput compared with the PyTorch loop it wraps?

With one worker there is nothing to average, so any gap between a sparknet round and the same
steps in a plain loop is pure framework cost: the Spark job per round, the weights' broadcast and
return, loading them into the model, the inner optimizer's state on disk. The goal is that this
cost stays under 5% when a round holds a few seconds of compute.

Both sides run in one process, on the same model (same factory, same seed), the same data and
batch size, with 2 torch threads: the embedded `local[2]` session gives its single task
`spark.task.cpus=2`. Round 1 is left out of sparknet's figure, since it pays for starting Spark's
Python worker, importing torch and building the data; the plain loop gets a few untimed warm-up
steps in exchange. The plain loop runs tau steps between every two sparknet rounds (from the
driver's per-round callback, while the Spark worker idles), so a burst of load from anything else
on the machine falls on both sides alike instead of on whichever ran at that moment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparknet.bench.common import (
    descendant_faults,
    machine_note,
    median,
    steal_note,
    write_results,
)
from sparknet.bench.workloads import SYNTHETIC_IMAGES, synthetic_images
from sparknet.config import TrainConfig
from sparknet.errors import SparknetError
from sparknet.models import build_model
from sparknet.training.driver import train
from sparknet.training.spark_settings import MALLOC_THRESHOLD

NAME = "throughput"
THREADS = 2
WARMUP_STEPS = 5
GOAL = 0.95


def plain_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    batch_size: int,
    gen: torch.Generator,
) -> float:
    """Seconds for `steps` SGD steps over shuffled batches: the loop a user would write."""
    x, y = data
    perm, pos = torch.randperm(len(x), generator=gen), 0
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        if pos + batch_size > len(x):
            perm, pos = torch.randperm(len(x), generator=gen), 0
        idx = perm[pos : pos + batch_size]
        pos += batch_size
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
    return time.perf_counter() - t0


class PlainLoop:
    """The plain side: tau steps per call, run from sparknet's per-round callback."""

    def __init__(self, cfg: TrainConfig, data: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.cfg, self.data = cfg, data
        num_classes = int(data[1].max()) + 1
        torch.manual_seed(cfg.seed)  # as `prepare` does: the model sparknet starts from
        self.model = build_model(cfg.model, tuple(data[0].shape[1:]), num_classes)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.chunk_s: list[float] = []
        # Minor page faults per chunk here, and per round in Spark's Python workers: on this VM a
        # fresh page costs enough that malloc handing memory back and forth shows in step times.
        self.chunk_faults: list[int] = []
        self.round_worker_faults: list[int] = []
        self._worker_faults = descendant_faults("pyspark")

    def warm_up(self) -> None:
        torch.set_num_threads(THREADS)
        plain_steps(
            self.model, self.optimizer, self.data, WARMUP_STEPS, self.cfg.batch_size, self.gen
        )

    def on_round(self, row: dict[str, Any]) -> None:
        now = descendant_faults("pyspark")
        self.round_worker_faults.append(
            sum(n - self._worker_faults.get(pid, 0) for pid, n in now.items())
        )
        self._worker_faults = now
        if row["round"] < self.cfg.rounds:  # one chunk between every two rounds
            torch.set_num_threads(THREADS)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            self.chunk_s.append(
                plain_steps(
                    self.model,
                    self.optimizer,
                    self.data,
                    self.cfg.tau,
                    self.cfg.batch_size,
                    self.gen,
                )
            )
            self.chunk_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            self._worker_faults = descendant_faults("pyspark")  # the chunk is not the worker's


def same_allocator_as_workers() -> None:
    """Give the plain loop the glibc malloc thresholds sparknet's Spark workers run with.

    Without them glibc returns every large tensor to the kernel after a step and faults it back
    in on the next; the workers are spared that (see `MALLOC_THRESHOLD`), so the plain loop is
    too, and the ratio measures the framework rather than the allocator.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_trim_threshold, MALLOC_THRESHOLD)
    libc.mallopt(m_mmap_threshold, MALLOC_THRESHOLD)


def run(*, rounds: int, tau: int, batch_size: int, model: str, out: Path) -> dict[str, Any]:
    """`sparknet bench throughput`: prints its figures and writes `<out>/throughput.json`."""
    if rounds < 2:
        raise SparknetError("--rounds must be >= 2: round 1 is not measured")

    same_allocator_as_workers()
    machine = machine_note()
    steps = (rounds - 1) * tau
    print(
        f"workload: model {model}, synthetic 3x32x32, batch {batch_size}, "
        f"{THREADS} threads; sparknet K=1, tau={tau}, {rounds} rounds "
        f"(rounds 2..{rounds} measured); plain loop {steps} steps, {tau} after "
        f"each of rounds 1..{rounds - 1}"
    )
    cfg = TrainConfig(
        model=model,
        data=SYNTHETIC_IMAGES,
        workers=1,
        tau=tau,
        rounds=rounds,
        batch_size=batch_size,
        optimizer="sgd",
        eval_every=0,
        checkpoint_every=0,
        master="local[2,4]",
    )
    train_set, _ = synthetic_images()
    plain = PlainLoop(cfg, (train_set.tensors[0], train_set.tensors[1]))
    plain.warm_up()

    with tempfile.TemporaryDirectory(prefix="sparknet-bench-") as tmp:
        t0 = time.perf_counter()
        run_cfg = cfg.model_copy(update={"out": str(Path(tmp) / "run")})
        rows = train(run_cfg, on_round=plain.on_round).metrics
        wall_s = time.perf_counter() - t0

    measured = rows[1:]
    samples = sum(r["samples"] for r in measured)
    total_s = sum(r["seconds"]["total"] for r in measured)
    compute_s = sum(r["seconds"]["compute"] for r in measured)
    spark_rate = samples / total_s
    plain_rate = steps * batch_size / sum(plain.chunk_s)
    ratio = spark_rate / plain_rate
    overhead = [r["seconds"]["total"] - r["seconds"]["compute"] for r in measured]
    pair_ratios = [c / r["seconds"]["total"] for c, r in zip(plain.chunk_s, measured, strict=True)]

    print("\nper round (s): sparknet total / compute / broadcast+load / aggregate | plain")
    for r in rows:
        s = r["seconds"]
        i = r["round"] - 1
        plain_col = f"{plain.chunk_s[i]:6.2f}" if i < len(plain.chunk_s) else "     -"
        note = "  (round 1 not measured: worker start-up)" if r["round"] == 1 else ""
        print(
            f"  round {r['round']}: {s['total']:6.2f} / {s['compute']:6.2f} / "
            f"{s['broadcast']:5.2f} / {s['aggregate']:5.2f} | {plain_col}{note}"
        )
    print(f"  train() wall incl. session start, round 1, plain chunks, final eval: {wall_s:.1f} s")
    print(
        f"  sparknet non-compute time per measured round: median {median(overhead):.3f} s "
        f"({sum(overhead) / total_s:.1%} of round time)"
    )
    print(
        f"  sparknet throughput inside the task alone (samples / compute s): "
        f"{samples / compute_s:.1f}"
    )
    print(
        f"  per-pair ratio (plain chunk s / following sparknet round s): "
        f"{', '.join(f'{x:.3f}' for x in pair_ratios)}"
    )
    worker_faults = sum(plain.round_worker_faults[1:]) / (len(measured) * tau)
    plain_faults = sum(plain.chunk_faults) / steps
    print(
        f"  minor page faults per step: sparknet worker {worker_faults:,.0f}, "
        f"plain loop {plain_faults:,.0f} (each is a fresh 4 KiB page)"
    )
    print(f"\nthroughput sparknet: {spark_rate:8.1f} samples/s")
    print(f"throughput plain:    {plain_rate:8.1f} samples/s")
    print(f"ratio sparknet/plain: {ratio:.3f}  (goal >= {GOAL})")

    steal_note(machine)
    results = {
        "machine": machine,
        "workload": {
            "model": model,
            "batch_size": batch_size,
            "tau": tau,
            "rounds": rounds,
            "threads": THREADS,
            "plain_steps": steps,
        },
        "sparknet_samples_per_s": spark_rate,
        "plain_samples_per_s": plain_rate,
        "ratio": ratio,
        "pair_ratios": pair_ratios,
        "sparknet_compute_only_samples_per_s": samples / compute_s,
        "sparknet_overhead_s_per_round_median": median(overhead),
        "sparknet_train_wall_s": wall_s,
        "plain_chunk_s": plain.chunk_s,
        "minor_faults_per_step": {"sparknet_worker": worker_faults, "plain": plain_faults},
        "sparknet_round_worker_faults": plain.round_worker_faults,
        "plain_chunk_faults": plain.chunk_faults,
        "rounds": rows,
        "headline": [
            {
                "metric": "training throughput, samples/s",
                "sparknet": spark_rate,
                "reference": plain_rate,
                "reference_name": "plain loop",
                "ratio": ratio,
                "goal": f">= {GOAL}",
            },
            {
                "metric": "  share of sparknet round time in compute",
                "sparknet": compute_s / total_s,
                "reference": 1.0,
                "reference_name": "no overhead",
                "ratio": compute_s / total_s,
                "goal": "",
            },
        ],
    }
    print(f"\nwrote {write_results(NAME, results, out)}")
    return results
