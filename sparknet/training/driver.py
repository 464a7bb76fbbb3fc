"""The round loop on the driver: broadcast, let every worker run tau steps, average, step."""

from __future__ import annotations

import functools
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparknet.config import TrainConfig
from sparknet.data.sources import DataSplit, load_data
from sparknet.errors import SparknetError
from sparknet.models import build_model, check_model_accepts
from sparknet.training import checkpoint
from sparknet.training.outer import OuterOptimizer, mean_update
from sparknet.training.report import CURVES, MetricsLog, plot_curves
from sparknet.training.session import start_session
from sparknet.training.state import StateLayout
from sparknet.training.transport import SparkTransport
from sparknet.training.worker import (
    Contribution,
    EvalResult,
    RoundTask,
    evaluate_partition,
    train_partition,
)

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"

RoundCallback = Callable[[dict[str, Any]], None]
#: called once the run is validated and its dir opened: (rounds already done, rounds in all)
StartCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    rounds: int
    metrics: list[dict[str, Any]]

    @property
    def final(self) -> dict[str, Any]:
        return self.metrics[-1]


@dataclass(frozen=True)
class Problem:
    """What the driver checks before any Spark job: data, model and their fit."""

    split: DataSplit
    num_classes: int
    model: torch.nn.Module


def default_run_dir(cfg: TrainConfig) -> Path:
    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "_", text.split(":")[-1]).strip("_") or "x"

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{slug(cfg.model)}-{slug(cfg.data)}-{stamp}"


def prepare(cfg: TrainConfig) -> Problem:
    """Load the data and build the initial model on the driver; fail here, before Spark starts."""
    split = load_data(cfg.data)
    if cfg.workers > len(split.train):
        raise SparknetError(
            f"--workers {cfg.workers} is more than the {len(split.train)} training samples "
            f"of {cfg.data!r}; use at most {len(split.train)} workers"
        )
    num_classes = cfg.num_classes or split.num_classes
    if num_classes is None:
        raise SparknetError(f"cannot tell how many classes {cfg.data!r} has; pass --num-classes")
    if cfg.fail_once_at and cfg.fail_once_at[1] >= cfg.workers:
        raise SparknetError(f"fail_once partition {cfg.fail_once_at[1]} >= --workers {cfg.workers}")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, split.input_shape, num_classes)
    check_model_accepts(model, split.train[0][0], num_classes, cfg.model)
    return Problem(split, num_classes, model)


def _write_config(run_dir: Path, cfg: TrainConfig) -> None:
    tmp = run_dir / f".{CONFIG_FILE}.tmp"
    tmp.write_text(cfg.to_yaml())
    os.replace(tmp, run_dir / CONFIG_FILE)


def _check_run_dir(cfg: TrainConfig, resume: bool) -> Path:
    """The run dir, if it can be used as asked; created only once Spark is up."""
    run_dir = Path(cfg.out)
    if resume:
        if not (run_dir / CONFIG_FILE).is_file():
            raise SparknetError(f"nothing to resume: {run_dir} is not a sparknet run dir")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise SparknetError(
            f"{run_dir} already holds a run; pass --resume to continue it or choose another --out"
        )
    return run_dir


def _due(every: int, done: int, last: int) -> bool:
    return done == last or (every > 0 and done % every == 0)


def _round_row(
    done: int, contrib: Contribution, round_s: float, broadcast_s: float
) -> dict[str, Any]:
    reports = contrib.reports
    samples = sum(r.samples for r in reports)
    load_s = broadcast_s + max(r.load_s for r in reports)
    compute_s = max(r.compute_s for r in reports)
    return {
        "round": done,
        "samples": samples,
        "loss": float(np.mean([r.loss for r in reports])),
        "seconds": {
            "broadcast": load_s,
            "compute": compute_s,
            "aggregate": max(0.0, round_s - load_s - compute_s),
            "total": round_s,
        },
        "samples_per_s": samples / round_s,
        "inner_state_misses": sum(r.inner_state_miss for r in reports),
    }


def _raise_diverged(contrib: Contribution, done: int, run_dir: Path) -> None:
    bad = next(r for r in contrib.reports if r.diverged is not None)
    raise SparknetError(
        f"training diverged at round {done}, worker {bad.partition}: {bad.diverged}; lower "
        f"--lr or check the data; last good checkpoint: {checkpoint.latest(run_dir) or 'none'}"
    )


def _train_work(task: RoundTask, theta, partition, attempt, threads, local_dir) -> Contribution:
    return train_partition(
        task, theta, partition, attempt=attempt, threads=threads, local_dir=local_dir
    )


def _eval_work(task: RoundTask, theta, partition, attempt, threads, local_dir) -> EvalResult:
    return evaluate_partition(task, theta, partition, threads=threads)


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    spark=None,
    on_start: StartCallback | None = None,
    on_round: RoundCallback | None = None,
) -> RunResult:
    """Run (or resume) a training job; writes the run dir of design.md section 4."""
    if cfg.out is None:
        cfg = cfg.model_copy(update={"out": default_run_dir(cfg)})
    problem = prepare(cfg)
    run_dir = _check_run_dir(cfg, resume)
    state = problem.model.state_dict()
    layout = StateLayout.of(state)
    outer = OuterOptimizer(layout.flatten(state), cfg.outer_lr, cfg.outer_momentum)
    integers, start, elapsed0 = layout.integers(state), 0, 0.0
    if resume:
        last = checkpoint.latest(run_dir)
        if last is None:
            raise SparknetError(f"nothing to resume: {run_dir} has no complete checkpoint")
        ckpt = checkpoint.load(last, layout)
        if ckpt.rounds >= cfg.rounds:
            raise SparknetError(
                f"{run_dir} already ran {ckpt.rounds} rounds; pass --rounds > {ckpt.rounds}"
            )
        start, elapsed0, integers = ckpt.rounds, ckpt.elapsed_s, ckpt.integers
        outer = OuterOptimizer(ckpt.theta, cfg.outer_lr, cfg.outer_momentum)
        outer.load_momentum_buffer(ckpt.outer_momentum)
    theta = outer.theta.numpy()

    if on_start is not None:
        on_start(start, cfg.rounds)
    own_session = spark is None
    if own_session:
        spark = start_session(cfg.master, cfg.workers)
    stage: Path | None = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(run_dir, cfg)
        metrics = MetricsLog(run_dir, keep_rounds=start)
        transport = SparkTransport(spark.sparkContext, cfg.workers)
        base = RoundTask(
            cfg, uuid.uuid4().hex[:12], start, layout, integers, problem.num_classes,
            problem.split.input_shape, str(run_dir),
        )  # fmt: skip
        t_start = time.perf_counter()
        for r in range(start, cfg.rounds):
            done = r + 1
            due = _due(cfg.checkpoint_every, done, cfg.rounds)
            stage = checkpoint.staging_dir(run_dir, done) if due else None
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)  # left by an interrupted earlier run
                checkpoint.inner_dir(stage).mkdir(parents=True)
            task = replace(base, round=r, integers=integers, checkpoint_dir=stage and str(stage))
            t0 = time.perf_counter()
            contrib, broadcast_s = transport.map_reduce(
                theta, functools.partial(_train_work, task), Contribution.combine
            )
            if contrib.delta_sum is None:
                _raise_diverged(contrib, done, run_dir)
            theta = outer.step(mean_update(contrib.delta_sum, contrib.workers))
            integers = contrib.integers
            round_s = time.perf_counter() - t0
            row = _round_row(done, contrib, round_s, broadcast_s)
            if _due(cfg.eval_every, done, cfg.rounds):
                eval_task = replace(task, integers=integers, checkpoint_dir=None)
                ev, _ = transport.map_reduce(
                    theta, functools.partial(_eval_work, eval_task), EvalResult.combine
                )
                row.update(eval_loss=ev.loss_sum / ev.count, eval_accuracy=ev.correct / ev.count)
            row["elapsed_s"] = elapsed0 + time.perf_counter() - t_start
            if stage is not None:
                checkpoint.write(
                    run_dir, done, layout, theta, integers, outer.momentum_buffer, row["elapsed_s"]
                )
                stage = None
            metrics.append(row)
            if on_round is not None:
                on_round(row)
    finally:
        if own_session:
            spark.stop()  # first: a cancelled task may still be writing into the stage
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)

    checkpoint.save_state_dict(layout.unflatten(theta, integers), run_dir / MODEL_FILE)
    plot_curves(metrics.rows, run_dir / CURVES)
    return RunResult(run_dir, cfg.rounds, metrics.rows)
