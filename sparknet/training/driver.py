"""The round loop on the driver: broadcast, let every worker run tau steps, average, step."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparknet.config import DatasetEntry, TrainConfig, read_run_config
from sparknet.data.frames import Frames
from sparknet.data.sources import Source, is_frame_spec, resolve_source
from sparknet.errors import SparknetError
from sparknet.models import build_model, check_model_accepts
from sparknet.training import checkpoint, rundir
from sparknet.training.outer import OuterOptimizer, mean_update
from sparknet.training.report import MetricsLog, eval_row, plot_curves, round_row
from sparknet.training.rundir import CONFIG_FILE, MODEL_FILE, Lock, RunDir
from sparknet.training.session import (
    check_python_workers,
    check_security_conf,
    is_local_master,
    start_session,
    stop_quietly,
    stopped_from_outside,
    user_modules,
)
from sparknet.training.state import StateLayout
from sparknet.training.transport import SparkTransport, wait_for_executors
from sparknet.training.watchdog import ExecutorWatchdog
from sparknet.training.worker import (
    Contribution,
    EvalResult,
    RoundTask,
    evaluate_partition,
    train_partition,
)

RoundCallback = Callable[[dict[str, Any]], None]
#: called once the run is validated and its dir opened: (rounds already done, rounds in all)
StartCallback = Callable[[int, int], None]
#: what the run is waiting for before its first round: "starting Spark", "starting Python workers"
StatusCallback = Callable[[str], None]
#: something the user should know that does not stop the run (one line, without "warning: ")
WarningCallback = Callable[[str], None]


@dataclass(frozen=True)
class RunResult:
    #: a Path for a local run dir, the s3:// URI for one on S3
    run_dir: Path | str
    rounds: int
    metrics: list[dict[str, Any]]

    @property
    def final(self) -> dict[str, Any]:
        return self.metrics[-1]


@dataclass(frozen=True)
class Problem:
    """What the driver checks before any Spark job: data, model and their fit."""

    source: Source
    num_classes: int
    model: torch.nn.Module


def default_run_dir(cfg: TrainConfig) -> Path:
    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "_", text.split(":")[-1]).strip("_") or "x"

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{slug(cfg.model)}-{slug(cfg.data)}-{stamp}"


def check_num_classes(cfg: TrainConfig, source: Source) -> None:
    """--num-classes against the classes the dataset says it has, before Spark starts: fewer
    would fail at the first batch with a high label, after every retry (minutes in); more gives
    a head whose extra outputs no label reaches, which is what a subset (ImageNet-100, indexed
    0..99) trained with ImageNet-1k's 1000 looks like, so a shard dataset (whose manifest lists
    its classes) needs `--extra-classes` for it."""
    have = source.num_classes
    want = cfg.num_classes
    if want is None or have is None or want == have:
        return
    labels = f"its labels run 0..{have - 1}"
    manifest = getattr(source, "manifest", None)
    if manifest is not None and manifest.subset_of:
        labels += f": a subset of {manifest.subset_of} classes, indexed in its own order"
    if want < have:
        raise SparknetError(
            f"--num-classes {want} is fewer than the {have} classes of {cfg.data} ({labels}); "
            f"pass --num-classes {have} or leave it out"
        )
    # a dataset without a manifest only shows its highest label, not how many classes it has
    if manifest is not None and not cfg.extra_classes:
        raise SparknetError(
            f"--num-classes {want}, but {cfg.data} has {have} classes ({labels}); leave it out, "
            f"or add --extra-classes for a {want}-way head anyway"
        )


def prepare(cfg: TrainConfig, source: Source) -> Problem:
    """Check the data against the settings and build the initial model on the driver."""
    check_security_conf(cfg.master or "local", cfg.spark_conf)  # sparknet-submit: pre-launch
    source.check_workers(cfg.workers)
    check_num_classes(cfg, source)
    num_classes = cfg.num_classes or source.num_classes
    if num_classes is None:
        raise SparknetError(f"cannot tell how many classes {cfg.data!r} has; pass --num-classes")
    local = (cfg.master or "local").startswith("local")  # its tasks use this machine's GPUs
    if cfg.device == "cuda" and local and not torch.cuda.is_available():
        raise SparknetError(
            f"--device cuda, but torch {torch.__version__} sees no GPU on this machine: "
            "pass --device auto or cpu, or install a CUDA build of torch"
        )
    if cfg.fail_once_at and cfg.fail_once_at[1] >= cfg.workers:
        raise SparknetError(f"fail_once partition {cfg.fail_once_at[1]} >= --workers {cfg.workers}")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, source.input_shape, num_classes)
    check_model_accepts(model, source.example(), num_classes, cfg.model)
    return Problem(source, num_classes, model)


def _frame_problem(cfg: TrainConfig, spark, frames: FrameInput) -> tuple[Problem, Frames]:
    from sparknet.data.frames import prepare_frames, read_frame

    train_df = frames.train if frames.train is not None else read_frame(spark, cfg.data)
    eval_df = frames.eval
    if eval_df is None and cfg.eval_data:
        eval_df = read_frame(spark, cfg.eval_data)
    source, placed = prepare_frames(
        train_df, eval_df, workers=cfg.workers, label_col=cfg.label_col,
        input_col=cfg.input_col, num_classes=cfg.num_classes, image_size=cfg.image_size,
        loader_workers=cfg.loader_workers, feature_shape=frames.feature_shape,
        name=cfg.data if frames.train is None else "the DataFrame",
        eval_name=cfg.eval_data if frames.eval is None else "eval_df",
    )  # fmt: skip
    try:
        return prepare(cfg, source), placed
    except BaseException:
        placed.release()
        raise


@dataclass(frozen=True)
class FrameInput:
    """DataFrames handed in by the Python API (`sparknet.fit`); None: read `cfg.data`."""

    train: Any = None
    eval: Any = None
    feature_shape: tuple[int, ...] | None = None


def _write_config(run: RunDir, cfg: TrainConfig) -> None:
    run.store.write_bytes(CONFIG_FILE, cfg.to_yaml().encode())


def _resume_changes(cfg: TrainConfig, run: RunDir) -> dict[str, tuple[Any, Any]]:
    """{setting: (stored, now)} for the settings that decide the weights and differ from the
    stored run's."""
    try:
        stored = TrainConfig(**read_run_config(run.text, cfg.endpoint_url))
    except (ValueError, TypeError) as exc:
        raise SparknetError(
            f"{run.child(CONFIG_FILE)} is not a config sparknet can resume"
        ) from exc
    return cfg.trajectory_changes(stored)


def _effective(changes: dict[str, tuple[Any, Any]], problem: Problem) -> dict[str, tuple]:
    """Leave out changes that change nothing for this problem: a `num_classes` that equals the
    one the dataset gives (the stored run left it to the dataset), an `image_size` of data that
    is not images."""
    out = dict(changes)
    stored, now = out.get("num_classes", (0, 0))
    if {stored, now} == {None, problem.num_classes}:
        del out["num_classes"]
    source = problem.source
    images = getattr(source, "image_size", None) is not None
    if "image_size" in out and not (images and getattr(source, "kind", "image") == "image"):
        del out["image_size"]
    return out


def _accepted(
    changes: dict[str, tuple[Any, Any]], run: RunDir, allow_change: bool
) -> dict[str, Any]:
    """Changes are refused, or with --allow-change returned to be recorded in metrics.jsonl."""
    if changes and not allow_change:
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        raise SparknetError(
            f"resuming {run} would change {listed}, so it would no longer equal an "
            "uninterrupted run; drop the change, or pass --allow-change to continue anyway"
        )
    return {k: {"stored": a, "now": b} for k, (a, b) in changes.items()}


@dataclass
class _Executors:
    """The executors seen at the last round's end (None before the first: they register
    during its wait), and whether one was lost in this run."""

    hosts: dict[str, str] | None = None
    lost: bool = False
    #: what the rows dropped by a restarted stage said (they would otherwise be lost with them)
    carried: dict[str, list[str]] = field(default_factory=dict)

    def dropped(self, rows: list[dict[str, Any]]) -> None:
        """Rows a restarted allreduce stage drops: their losses and joins go into the next row."""
        for row in rows:
            for key in ("executors_lost", "executors_joined"):
                self.carried.setdefault(key, []).extend(row.get(key, []))

    def after_round(self, row: dict[str, Any], transport) -> None:
        """On a cluster: the executors there are after the round in its row, and those lost
        and joined since the round before (a dead worker, its replacement). A join after a
        loss spreads the partitions again: the lost executor's tasks moved onto the others and
        would stay there."""
        now = transport.executors()
        before, self.hosts = self.hosts, now
        if not now and not before:
            return  # a local master
        row["executors"] = len(now)
        if before is None:
            return
        carried, self.carried = self.carried, {}
        lost = carried.get("executors_lost", [])
        lost += [f"{i}@{before[i]}" for i in sorted(set(before) - set(now))]
        joined = carried.get("executors_joined", [])
        joined += [f"{i}@{now[i]}" for i in sorted(set(now) - set(before))]
        if lost:
            row["executors_lost"] = lost
            self.lost = True
        if joined:
            row["executors_joined"] = joined
            if self.lost:
                transport.rebalance()


def _raise_diverged(contrib: Contribution, done: int, run: RunDir) -> None:
    bad = next(r for r in contrib.reports if r.diverged is not None)
    raise SparknetError(
        f"training diverged at round {done}, worker {bad.partition}: {bad.diverged}; lower "
        f"--lr or check the data; last good checkpoint: {_last_good(run)}"
    )


def _last_good(run: RunDir) -> str:
    last = checkpoint.latest(run.store)
    return "none" if last is None else run.child(checkpoint.name(last))


def _train_work(task: RoundTask, theta, partition, attempt, threads, local_dir, rows):
    return train_partition(
        task, theta, partition, attempt=attempt, threads=threads, local_dir=local_dir, rows=rows
    )


def _eval_work(task: RoundTask, theta, partition, attempt, threads, local_dir, rows):
    return evaluate_partition(task, theta, partition, threads=threads, rows=rows)


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    spark=None,
    on_start: StartCallback | None = None,
    on_round: RoundCallback | None = None,
    on_status: StatusCallback | None = None,
    on_warning: WarningCallback | None = None,
    datasets: dict[str, DatasetEntry] | None = None,
    frames: FrameInput | None = None,
    allow_change: bool = False,
) -> RunResult:
    """Run (or resume) a training job; writes the run dir of design.md section 4.

    Everything that can be checked without Spark (settings, the run dir, a shard dataset's
    manifest, the model) is checked before Spark starts; a DataFrame is checked right after.
    A resume may change `rounds` and what does not alter the weights; other changes are refused
    unless `allow_change`, and then recorded in the first resumed round's metrics row.
    """
    if cfg.out is None:
        cfg = cfg.model_copy(update={"out": str(default_run_dir(cfg))})
    if frames is None and is_frame_spec(cfg.data):
        frames = FrameInput()
    run = RunDir.open(cfg.out, cfg.endpoint_url)
    rundir.check_out(run)
    with rundir.locked(run) as lock:
        rundir.check(run, resume)
        checkpoint.discard_incomplete(run.store)  # an interrupted run's; never resumed from
        changes = _resume_changes(cfg, run) if resume else {}
        if resume and checkpoint.latest(run.store) == cfg.rounds:
            _accepted(changes, run, allow_change)
            return _finished(cfg, run)
        return _start(
            cfg, run, lock, resume, (changes, allow_change), spark, on_start, on_round,
            on_status, on_warning, datasets, frames,
        )  # fmt: skip


def _finished(cfg: TrainConfig, run: RunDir) -> RunResult:
    """A resumed run whose last round is already checkpointed needs no Spark: (re)write what an
    interrupt after that checkpoint may have left out (model.safetensors, curves.png)."""
    weights = checkpoint.read_weights(run.store, cfg.rounds)
    run.store.write_bytes(MODEL_FILE, weights)  # the same tensors, the model's own keys
    rows = MetricsLog(run.store, keep_rounds=cfg.rounds).rounds
    plot_curves(rows, run.store)
    return RunResult(run.result, cfg.rounds, rows)


def _start(
    cfg: TrainConfig,
    run: RunDir,
    lock: Lock,
    resume: bool,
    changes: tuple[dict[str, tuple[Any, Any]], bool],
    spark,
    on_start: StartCallback | None,
    on_round: RoundCallback | None,
    on_status: StatusCallback | None,
    on_warning: WarningCallback | None,
    datasets: dict[str, DatasetEntry] | None,
    frames: FrameInput | None,
) -> RunResult:
    """Check the problem, start Spark (unless given a session) and run the rounds."""
    status = on_status or (lambda _text: None)
    own_session = spark is None
    placed: Frames | None = None
    if frames is None:
        problem = prepare(cfg, resolve_source(cfg, datasets))
        accepted = _accepted(_effective(changes[0], problem), run, changes[1])
        begin = _initial_state(cfg, problem, run, resume)
        begin.changes = accepted
        if on_start is not None:
            on_start(begin.rounds, cfg.rounds)
    result: RunResult | None = None
    if frames is not None and on_start is not None:  # before Spark: the bar says which round
        last = checkpoint.latest(run.store) if resume else None
        on_start(last or 0, cfg.rounds)
    try:
        if own_session:
            status("starting Spark")
            spark = start_session(cfg.master, cfg.workers, cfg.spark_conf, cfg.gpus_per_worker)
        if not is_local_master(spark.sparkContext.master):  # a cluster's executors register
            status("waiting for Spark's executors")
            if cores := wait_for_executors(spark.sparkContext, cfg.workers):
                status(f"{len(cores)} executors registered ({sum(cores.values())} cores)")
        cfg = _resolve_transport(cfg, spark, run.on_s3 or cfg.shared_out)  # refusals first
        status("starting Python workers")
        data = None if frames is not None or cfg.data in (datasets or {}) else cfg.data
        check_python_workers(spark, cfg.workers, user_modules(cfg.model, data))
        if frames is not None:
            problem, placed = _frame_problem(cfg, spark, frames)
            accepted = _accepted(_effective(changes[0], problem), run, changes[1])
            begin = _initial_state(cfg, problem, run, resume)
            begin.changes = accepted
        warn = _warner(on_warning)
        on_row = _with_warnings(on_round, warn, begin, cfg.workers * cfg.tau)
        with ExecutorWatchdog(spark.sparkContext, cfg.no_executor_timeout_s):
            result = _run(cfg, problem, begin, run, lock, spark, own_session, placed, on_row, warn)
        return result
    except Exception as exc:  # the application ended under the run: one line, not a traceback
        if spark is not None and (why := stopped_from_outside(spark.sparkContext, exc)):
            raise SparknetError(why) from exc
        raise
    finally:
        if placed is not None:
            placed.release()
        if own_session and spark is not None:
            try:
                stop_quietly(spark)
            except KeyboardInterrupt:
                if result is None:
                    raise  # once every file is written, a signal while Spark stops is no failure


def _resolve_transport(cfg: TrainConfig, spark, every_node_writes: bool) -> TrainConfig:
    """The transport that runs, recorded in the run's config.yaml: `auto` is `allreduce` on a
    cluster master whose executors give every worker a task slot at once (DataFrames too),
    or wherever it can run when `compress` asks for it; else `spark`. An `allreduce` that
    cannot run is an error saying why."""
    if cfg.transport == "spark":
        return cfg
    sc = spark.sparkContext
    why = _allreduce_refusal(sc, cfg, every_node_writes)
    wanted = cfg.transport == "allreduce" or cfg.compress != "none"
    if why is not None and wanted:
        raise SparknetError(why)
    if why is None and (wanted or not is_local_master(sc.master)):
        return cfg.model_copy(update={"transport": "allreduce"})
    return cfg.model_copy(update={"transport": "spark"})


def _allreduce_refusal(sc, cfg: TrainConfig, every_node_writes: bool) -> str | None:
    from sparknet.training import allreduce

    why = allreduce.why_not(sc, cfg.workers, every_node_writes)
    if why is None:
        return None
    asked = "--transport allreduce" if cfg.transport == "allreduce" else "--compress"
    return (
        f"the allreduce transport ({asked}) cannot run here: {why}; use the spark transport"
        f"{' without --compress' if cfg.compress != 'none' else ''}"
    )


def _warner(on_warning: WarningCallback | None) -> WarningCallback:
    """`on_warning`, or a Python warning (the `fit` API has no callback)."""
    return on_warning or (lambda text: warnings.warn(text, RuntimeWarning, stacklevel=3))


def _with_warnings(
    on_round: RoundCallback | None,
    warn: WarningCallback,
    begin: _Begin,
    steps: int,
) -> RoundCallback:
    """`on_round`, after the round's warnings (Python warnings without a callback: the `fit` API):
    - the partitions that found no inner optimizer state (an executor lost, or a partition
      moved): their optimizers started fresh, so the run no longer equals one without the miss.
      Not for the first resumed round of a run that changed the inner optimizer, `inner_state`
      or the number of workers (no usable states are stored for them: expected).
    - an fp16 round whose loss scaler skipped at least half of its `steps` (gradients overflowed):
      the round learnt little or nothing, and only metrics.jsonl would say so."""
    expected = {"optimizer", "inner_state", "workers"} & set(begin.changes)

    def on_row(row: dict[str, Any]) -> None:
        missed = row.get("inner_state_missed")
        if missed and not (row["round"] == begin.rounds + 1 and expected):
            which = ", ".join(map(str, missed))
            warn(
                f"round {row['round']}: partition{'s' if len(missed) > 1 else ''} {which} found "
                "no inner optimizer state (an executor was lost or the partition moved) and "
                "started a fresh optimizer; counted in metrics.jsonl"
            )
        skipped = row.get("skipped_steps", 0)
        if skipped and 2 * skipped >= steps:
            warn(
                f"round {row['round']}: the fp16 loss scaler skipped {skipped} of {steps} steps "
                "(gradients overflowed); if this goes on, lower --lr or use --precision bf16"
            )
        if on_round is not None:
            on_round(row)

    return on_row


@dataclass
class _Begin:
    """Where the round loop starts: fresh from the model's initial weights, or a checkpoint."""

    layout: StateLayout
    outer: OuterOptimizer
    integers: dict[str, np.ndarray]
    rounds: int
    elapsed_s: float
    #: settings a resume changed with --allow-change: {name: {"stored": x, "now": y}}
    changes: dict[str, Any] = field(default_factory=dict)


def _initial_state(cfg: TrainConfig, problem: Problem, run: RunDir, resume: bool) -> _Begin:
    state = problem.model.state_dict()
    layout = StateLayout.of_model(problem.model)
    buffers = layout.buffer_mask()
    if not resume:
        outer = OuterOptimizer(layout.flatten(state), cfg.outer_lr, cfg.outer_momentum, buffers)
        return _Begin(layout, outer, layout.integers(state), 0, 0.0)
    last = checkpoint.latest(run.store)
    if last is None:
        raise SparknetError(
            f"nothing to resume: {run} has no complete checkpoint; run again without --resume "
            "to start it over"
        )
    ckpt = checkpoint.load(run.store, last, layout)
    if ckpt.rounds >= cfg.rounds:
        raise SparknetError(
            f"{run} already ran {ckpt.rounds} rounds; pass --rounds N with N > {ckpt.rounds}"
        )
    outer = OuterOptimizer(ckpt.theta, cfg.outer_lr, cfg.outer_momentum, buffers)
    outer.load_momentum_buffer(ckpt.outer_momentum)
    return _Begin(layout, outer, ckpt.integers, ckpt.rounds, ckpt.elapsed_s)


@dataclass
class _Loop:
    """What both round loops share: the run, its reports and the caller's callbacks."""

    cfg: TrainConfig
    problem: Problem
    run: RunDir
    lock: Lock
    spark: Any
    own_session: bool
    metrics: MetricsLog
    events: _RunEvents
    on_round: RoundCallback | None
    warn: WarningCallback

    def record(self, row: dict[str, Any], begin: _Begin) -> None:
        """A round's row into metrics.jsonl and the event file (before its checkpoint is
        published: a published checkpoint always has its row; a resume drops the rows past its
        checkpoint, so a row without one is harmless)."""
        if row["round"] == begin.rounds + 1 and begin.changes:
            row["resumed_with_changes"] = begin.changes
        self.metrics.append(row)
        self.events.round(row)


def _run(
    cfg: TrainConfig,
    problem: Problem,
    begin: _Begin,
    run: RunDir,
    lock: Lock,
    spark,
    own_session: bool,
    placed: Frames | None,
    on_round: RoundCallback | None,
    warn: WarningCallback,
) -> RunResult:
    events = _RunEvents(run, cfg, begin.rounds)
    try:
        if not begin.changes:  # changed settings are the run's only once a checkpoint has them
            _write_config(run, cfg)
        metrics = MetricsLog(run.store, keep_rounds=begin.rounds)
        loop = _Loop(
            cfg, problem, run, lock, spark, own_session, metrics, events, on_round, warn
        )  # fmt: skip
        if cfg.transport == "allreduce":
            model_bytes = _allreduce_rounds(loop, begin, placed)
        else:
            model_bytes = _spark_rounds(loop, begin, placed)
    finally:
        events.close()
    run.store.write_bytes(MODEL_FILE, model_bytes)
    plot_curves(metrics.rounds, run.store)
    return RunResult(run.result, cfg.rounds, metrics.rounds)


def _spark_rounds(loop: _Loop, begin: _Begin, placed: Frames | None) -> bytes:
    """The rounds as one Spark job each (the `spark` transport); returns the final weights as
    model.safetensors bytes."""
    cfg, problem, run = loop.cfg, loop.problem, loop.run
    layout, outer, integers = begin.layout, begin.outer, begin.integers
    start, elapsed0 = begin.rounds, begin.elapsed_s
    theta = outer.theta.numpy()
    train_frame = placed.train if placed is not None else None
    eval_frame = placed.eval if placed is not None else None
    evaluates = placed is None or eval_frame is not None
    pending: int | None = None  # the round of a checkpoint being written, until its manifest is
    try:
        transport = SparkTransport(loop.spark.sparkContext, cfg.workers)
        base = RoundTask(
            cfg, problem.source, uuid.uuid4().hex[:12], start, layout, integers,
            problem.num_classes, problem.source.input_shape, run.store.uri,
        )  # fmt: skip
        t_start = time.perf_counter()
        executors = _Executors()
        for r in range(start, cfg.rounds):
            loop.lock.check()
            done = r + 1
            pending = done if checkpoint.due(cfg.checkpoint_every, done, cfg.rounds) else None
            stage = checkpoint.begin(run.store, done) if pending is not None else None
            task = replace(base, round=r, integers=integers, checkpoint_dir=stage)
            t0 = time.perf_counter()
            contrib, broadcast_s = transport.map_reduce(
                theta, functools.partial(_train_work, task), Contribution.combine, train_frame
            )
            if contrib.delta_sum is None:
                _raise_diverged(contrib, done, run)
            theta = outer.step(mean_update(contrib.delta_sum, contrib.workers))
            integers = contrib.integers
            round_s = time.perf_counter() - t0
            row = round_row(done, contrib.reports, round_s, broadcast_s)
            executors.after_round(row, transport)
            if evaluates and checkpoint.due(cfg.eval_every, done, cfg.rounds):
                eval_task = replace(task, integers=integers, checkpoint_dir=None)
                ev, _ = transport.map_reduce(
                    theta, functools.partial(_eval_work, eval_task), EvalResult.combine, eval_frame
                )
                row.update(eval_row(ev))
            row["elapsed_s"] = elapsed0 + time.perf_counter() - t_start
            loop.record(row, begin)
            if pending is not None:
                checkpoint.write(
                    run.store, done, layout, theta, integers, outer.momentum_buffer,
                    row["elapsed_s"], cfg.to_yaml(),
                )  # fmt: skip
                pending = None
                _write_config(run, cfg)
            if loop.on_round is not None:
                loop.on_round(row)
    finally:
        if pending is not None:
            _abandon(run, pending, loop.spark if loop.own_session else None)
    return checkpoint.state_dict_bytes(layout.unflatten(theta, integers))


def _allreduce_rounds(loop: _Loop, begin: _Begin, placed: Frames | None) -> bytes:
    """The rounds as one barrier stage (the `allreduce` transport). A failed stage runs again
    from the last complete checkpoint, at most `allreduce.RESTARTS` times; returns the final
    weights (the last round always ends with a checkpoint) as model.safetensors bytes."""
    from sparknet.training.allreduce import RESTARTS, AllReduceTransport, Diverged, StageFailed

    cfg, run = loop.cfg, loop.run
    transport = AllReduceTransport(loop.spark.sparkContext, cfg.workers, placed)
    base = RoundTask(
        cfg, loop.problem.source, uuid.uuid4().hex[:12], begin.rounds, begin.layout,
        begin.integers, loop.problem.num_classes, loop.problem.source.input_shape,
        run.store.uri,
    )  # fmt: skip
    executors = _Executors()
    restarts = 0
    stage_begin = begin
    try:
        while True:
            try:
                _one_stage(loop, transport, replace(base, round=stage_begin.rounds,
                           integers=stage_begin.integers), stage_begin, begin, restarts,
                           executors)  # fmt: skip
                break
            except Diverged as exc:
                raise SparknetError(f"{exc}; last good checkpoint: {_last_good(run)}") from exc
            except StageFailed as exc:
                if exc.permanent or restarts == RESTARTS:
                    raise SparknetError(f"the allreduce stage failed: {exc}") from exc
                restarts += 1
                checkpoint.discard_incomplete(run.store)
                stage_begin = _restart_state(loop, begin)
                loop.warn(
                    f"the allreduce stage failed ({exc}); running it again from round "
                    f"{stage_begin.rounds} (restart {restarts} of {RESTARTS})"
                )
        _write_config(run, cfg)
    except BaseException:
        if loop.own_session:
            stop_quietly(loop.spark)  # a cancelled rank may still be writing a checkpoint
        with contextlib.suppress(SparknetError):
            checkpoint.discard_incomplete(run.store)
        raise
    return checkpoint.read_weights(run.store, cfg.rounds)


def _one_stage(
    loop: _Loop,
    transport,
    base: RoundTask,
    stage_begin: _Begin,
    begin: _Begin,
    restarts: int,
    executors: _Executors,
) -> None:
    """One barrier stage from `stage_begin`: each row recorded, then acknowledged (rank 0 then
    publishes the round's checkpoint), then shown."""
    rows = transport.stage(
        base, stage_begin.outer.theta.numpy(), stage_begin.outer.momentum_buffer,
        stage_begin.elapsed_s, restarts,
    )  # fmt: skip
    for message in rows:
        if isinstance(message, int):  # the stage (re)starts after this round
            executors.dropped(loop.metrics.keep(message))
            continue
        loop.lock.check()
        row = message.row
        executors.after_round(row, transport)
        loop.record(row, begin)
        message.ack()
        if loop.on_round is not None:
            loop.on_round(row)


def _restart_state(loop: _Loop, begin: _Begin) -> _Begin:
    """Where a failed stage runs again from: the last complete checkpoint, or where the run
    began when none was written since."""
    last = checkpoint.latest(loop.run.store)
    if last is None or last <= begin.rounds:
        return begin
    ckpt = checkpoint.load(loop.run.store, last, begin.layout)
    outer = OuterOptimizer(
        ckpt.theta, loop.cfg.outer_lr, loop.cfg.outer_momentum, begin.layout.buffer_mask()
    )
    outer.load_momentum_buffer(ckpt.outer_momentum)
    return _Begin(begin.layout, outer, ckpt.integers, ckpt.rounds, ckpt.elapsed_s)


class _RunEvents:
    """TensorBoard event files next to metrics.jsonl. The writer knows only local dirs: for an S3
    run dir it writes into a local temp dir and its file is uploaded after every round (S3 has
    no append: the whole file each time, as metrics.jsonl)."""

    def __init__(self, run: RunDir, cfg: TrainConfig, start: int) -> None:
        from sparknet.training.events import EventLog

        self.run = run
        self.temp: Path | None = None
        log_dir = run.local if not run.on_s3 else self._temp_dir()
        self.log = EventLog(log_dir, purge_step=start + 1, inner_lr=cfg.lr, outer_lr=cfg.outer_lr)

    def _temp_dir(self) -> Path:
        """A temp dir holding empty stand-ins named as the run's event files on S3: the writer
        then names its new file after theirs (TensorBoard reads a dir's files in name order,
        and a resume's purge must come after the events it drops)."""
        self.temp = _events_temp_dir(self.run)
        shutil.rmtree(self.temp, ignore_errors=True)  # what a killed run on it left
        self.temp.mkdir(mode=0o700, parents=True)
        for name in self.run.store.entries():
            if name.startswith("events.out.tfevents."):
                (self.temp / name).touch()
        return self.temp

    def round(self, row: dict[str, Any]) -> None:
        self.log.round(row)
        self._upload()

    def _upload(self) -> None:
        if self.temp is not None:
            self.run.store.write_bytes(self.log.path.name, self.log.path.read_bytes())

    def close(self) -> None:
        self.log.close()
        if self.temp is not None:
            with contextlib.suppress(SparknetError):  # each round's events are there already
                self._upload()
            shutil.rmtree(self.temp, ignore_errors=True)


def _events_temp_dir(run: RunDir) -> Path:
    """The local dir for an S3 run dir's event file: one per run dir and user, so a run killed
    before removing its own leaves it to the next run on that dir to clean (the run's lock
    keeps two runs of this host from sharing it)."""
    digest = hashlib.sha256(run.store.uri.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"sparknet-events-{os.getuid()}-{digest}"


def _abandon(run: RunDir, rounds: int, own_spark) -> None:
    """Remove the checkpoint a failed or interrupted round left incomplete. Spark (when the run
    owns it) stops first: a cancelled task may still be writing into it. A failure here must not
    hide the one that ended the run; the next run removes what is left."""
    if own_spark is not None:
        stop_quietly(own_spark)
    with contextlib.suppress(SparknetError):
        checkpoint.discard(run.store, rounds)
