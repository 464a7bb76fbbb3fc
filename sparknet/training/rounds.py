"""The round loops on the driver: broadcast, let every worker run tau steps, average, step (the
`spark` transport, a Spark job a round), or follow the rows of one barrier stage (`allreduce`);
each round's row is recorded before its checkpoint is published.

Kept apart from `driver`, which holds what surrounds the loops (the checks, resume, the session,
the transport chosen): the loops and their state read on their own. Executors import this module
by name, for the task functions a round pickles (`_train_work`, `_eval_work`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from sparknet.config import TrainConfig
from sparknet.data.frames import Frames
from sparknet.errors import SparknetError
from sparknet.training import checkpoint
from sparknet.training.allreduce import RESTARTS, AllReduceTransport, Diverged, StageFailed
from sparknet.training.events import EventLog
from sparknet.training.outer import OuterOptimizer, mean_update
from sparknet.training.problem import Problem
from sparknet.training.report import MetricsLog, eval_row, round_row
from sparknet.training.rundir import CONFIG_FILE, Lock, RunDir
from sparknet.training.session import stop_quietly
from sparknet.training.state import StateLayout
from sparknet.training.transport import SparkTransport
from sparknet.training.worker import (
    Contribution,
    EvalResult,
    RoundTask,
    evaluate_partition,
    train_partition,
)

RoundCallback = Callable[[dict[str, Any]], None]
#: something the user should know that does not stop the run (one line, without "warning: ")
WarningCallback = Callable[[str], None]


def write_config(run: RunDir, cfg: TrainConfig) -> None:
    run.store.write_bytes(CONFIG_FILE, cfg.to_yaml().encode())


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


@dataclass
class Begin:
    """Where the round loop starts: fresh from the model's initial weights, or a checkpoint."""

    layout: StateLayout
    outer: OuterOptimizer
    integers: dict[str, np.ndarray]
    rounds: int
    elapsed_s: float
    #: settings a resume changed with --allow-change: {name: {"stored": x, "now": y}}
    changes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Loop:
    """What both round loops share: the run, its reports and the caller's callbacks."""

    cfg: TrainConfig
    problem: Problem
    run: RunDir
    lock: Lock
    spark: Any
    own_session: bool
    metrics: MetricsLog
    events: RunEvents
    on_round: RoundCallback | None
    warn: WarningCallback

    def record(self, row: dict[str, Any], begin: Begin) -> None:
        """A round's row into metrics.jsonl and the event file (before its checkpoint is
        published: a published checkpoint always has its row; a resume drops the rows past its
        checkpoint, so a row without one is harmless)."""
        if row["round"] == begin.rounds + 1 and begin.changes:
            row["resumed_with_changes"] = begin.changes
        self.metrics.append(row)
        self.events.round(row)


def spark_rounds(loop: Loop, begin: Begin, placed: Frames | None) -> bytes:
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
                write_config(run, cfg)
            if loop.on_round is not None:
                loop.on_round(row)
    finally:
        if pending is not None:
            _abandon(run, pending, loop.spark if loop.own_session else None)
    return checkpoint.state_dict_bytes(layout.unflatten(theta, integers))


def allreduce_rounds(loop: Loop, begin: Begin, placed: Frames | None) -> bytes:
    """The rounds as one barrier stage (the `allreduce` transport). A failed stage runs again
    from the last complete checkpoint, at most `allreduce.RESTARTS` times; returns the final
    weights (the last round always ends with a checkpoint) as model.safetensors bytes."""
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
        write_config(run, cfg)
    except BaseException:
        if loop.own_session:
            stop_quietly(loop.spark)  # a cancelled rank may still be writing a checkpoint
        with contextlib.suppress(SparknetError):
            checkpoint.discard_incomplete(run.store)
        raise
    return checkpoint.read_weights(run.store, cfg.rounds)


def _one_stage(
    loop: Loop,
    transport,
    base: RoundTask,
    stage_begin: Begin,
    begin: Begin,
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


def _restart_state(loop: Loop, begin: Begin) -> Begin:
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
    return Begin(begin.layout, outer, ckpt.integers, ckpt.rounds, ckpt.elapsed_s)


class RunEvents:
    """TensorBoard event files next to metrics.jsonl. The writer knows only local dirs: for an S3
    run dir it writes into a local temp dir and its file is uploaded after every round (S3 has
    no append: the whole file each time, as metrics.jsonl)."""

    def __init__(self, run: RunDir, cfg: TrainConfig, start: int) -> None:
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
