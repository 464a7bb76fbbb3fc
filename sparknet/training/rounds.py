"""The round loops on the driver, one per transport.

Broadcast, let every worker run tau steps, average, step (the `spark` transport, a Spark job a
round), or follow the rows of one barrier stage (`allreduce`); each round's row is recorded
before its checkpoint is published.

Kept apart from `driver`, which holds what surrounds the loops (the checks, resume, the session,
the transport chosen): the loops and their state read on their own. Executors import this module
by name, for the task functions a round pickles (`train_work`, `eval_work`).
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
from sparknet.errors import SparknetError, first_line
from sparknet.training import checkpoint, schedule, tau_choice
from sparknet.training.allreduce import RESTARTS, AllReduceTransport, Diverged, StageFailed
from sparknet.training.events import EventLog
from sparknet.training.outer import OuterOptimizer, mean_update, outer_at
from sparknet.training.problem import Problem
from sparknet.training.progress_guard import Guard
from sparknet.training.report import EARLY, MetricsLog, eval_row, round_row
from sparknet.training.retention import Retention
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
    #: an executor joined after a loss: the partitions are to be spread again (`spread_out`)
    spread: bool = False
    #: what the rows dropped by a restarted stage said (they would otherwise be lost with them)
    carried: dict[str, list[str]] = field(default_factory=dict)

    def dropped(self, rows: list[dict[str, Any]]) -> None:
        """Rows a restarted allreduce stage or a `spark` replay drops: their losses and joins
        go into the next row."""
        for row in rows:
            for key in ("executors_lost", "executors_joined"):
                self.carried.setdefault(key, []).extend(row.get(key, []))

    def after_round(self, row: dict[str, Any], transport) -> None:
        """On a cluster: the executors there are after the round in its row, and those lost
        and joined since the round before (a dead worker, its replacement). A join after a
        loss asks for the partitions to be spread again (`spread_out`): the lost executor's
        tasks moved onto the others and would stay there."""
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
            self.spread = self.spread or self.lost

    def spread_out(self, transport) -> None:
        """Spread the partitions over the executors there are now, when a join asked for it.
        Called where every partition that moves finds its inner state in a checkpoint (right
        after one is published, or as a replay starts from one): never a miss."""
        if self.spread:
            self.spread = False
            transport.rebalance()


def _raise_diverged(contrib: Contribution, done: int, run: RunDir) -> None:
    bad = next(r for r in contrib.reports if r.diverged is not None)
    raise SparknetError(
        "{cause}; last good checkpoint: {last}",
        cause=Diverged.at(done, bad.partition, bad.diverged), last=_last_good(run),
    )  # fmt: skip


def _last_good(run: RunDir) -> str:
    last = checkpoint.latest(run.store)
    return "none" if last is None else run.child(checkpoint.name(last))


def train_work(task: RoundTask, theta, partition, attempt, threads, local_dir, rows):
    return train_partition(
        task, theta, partition, attempt=attempt, threads=threads, local_dir=local_dir, rows=rows
    )


def eval_work(task: RoundTask, theta, partition, attempt, threads, local_dir, rows):
    return evaluate_partition(task, theta, partition, threads=threads, rows=rows)


@dataclass
class StartPoint:
    """Where the round loop starts: fresh from the model's initial weights, or a checkpoint."""

    layout: StateLayout
    outer: OuterOptimizer
    integers: dict[str, np.ndarray]
    rounds: int
    elapsed_s: float
    #: settings a resume changed with --allow-change: {name: {"stored": x, "now": y}}
    changes: dict[str, Any] = field(default_factory=dict)
    #: under tau auto, the chooser as the checkpoint left it (`TauChooser.state`)
    tau_state: dict[str, Any] | None = None
    #: the inner steps taken by then: the global step the lr schedule counts
    steps: int = 0

    @staticmethod
    def from_checkpoint(
        cfg: TrainConfig, run: RunDir, rounds: int, layout: StateLayout
    ) -> StartPoint:
        """Where the checkpoint after `rounds` left the run: its weights, integer state, elapsed
        time and outer momentum (a resume and a replay go on from there alike)."""
        ckpt = checkpoint.load(run.store, rounds, layout)
        outer = outer_at(cfg, layout, ckpt.theta, ckpt.outer_momentum)
        # a checkpoint from before the count was kept: its rounds at the run's first tau
        steps = ckpt.rounds * cfg.first_tau if ckpt.steps is None else ckpt.steps
        return StartPoint(
            layout, outer, ckpt.integers, ckpt.rounds, ckpt.elapsed_s, tau_state=ckpt.tau_state,
            steps=steps,
        )  # fmt: skip


@dataclass
class RunContext:
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
    #: the run's progress guard, which the workers report to (None: no guard)
    guard: Guard | None = None
    #: which checkpoints the run dir keeps (None: every one)
    retention: Retention | None = None

    def first_task(self, begin: StartPoint, run_id: str) -> RoundTask:
        """The task of the first round from `begin`; a later round's is a `replace` of it."""
        problem = self.problem
        return RoundTask(
            self.cfg, problem.source, run_id, begin.rounds, begin.layout, begin.integers,
            problem.num_classes, problem.source.input_shape, self.run.store.uri,
            tau=tau_choice.next_tau(self.cfg, begin.tau_state), step=begin.steps,
        )  # fmt: skip

    def record(self, row: dict[str, Any], begin: StartPoint) -> None:
        """A round's row into metrics.jsonl and the event file (before its checkpoint is
        published: a published checkpoint always has its row; a resume drops the rows past its
        checkpoint, so a row without one is harmless)."""
        if row["round"] == begin.rounds + 1 and begin.changes:
            row["resumed_with_changes"] = begin.changes
        self.metrics.append(row)
        self.events.round(row)

    def prune(self) -> None:
        """The checkpoints past those the run keeps deleted (`retention`), the best recorded.
        One that cannot be deleted stays, said in a warning: the run goes on."""
        if self.retention is None:
            return
        try:
            self.retention.prune(self.metrics.rounds)
        except (SparknetError, OSError) as exc:
            self.lock.check()  # a lost lock stops the run, as at any other write
            self.warn(f"old checkpoints were not deleted (they stay): {first_line(exc)}")

    def rewind(self, rounds: int) -> list[dict[str, Any]]:
        """Back to the checkpoint after `rounds`: the rounds past it run again, so their rows
        leave metrics.jsonl and TensorBoard's curves (each round shows once); returns them."""
        dropped = self.metrics.keep(rounds)
        if dropped:
            self.events.rewind(rounds)
        return dropped


#: how many times in a row the `spark` transport replays from one checkpoint before the run
#: fails (the replayed rounds found partitions without their inner state again: executors keep
#: being lost); a checkpoint written since starts the count again
REPLAYS = RESTARTS


def spark_rounds(loop: RunContext, begin: StartPoint, placed: Frames | None) -> bytes:
    """The rounds as one Spark job each (the `spark` transport); returns the final weights as
    model.safetensors bytes.

    A round in which a partition found no inner optimizer state (its executor was lost, so its
    task ran on another) is not stepped with: the rounds since the last complete checkpoint (or
    since the run began) run again from there, and the run ends with the weights of a run
    without the loss (`_Segment`)."""
    cfg, run = loop.cfg, loop.run
    layout = begin.layout
    train_frame = placed.train if placed is not None else None
    eval_frame = placed.eval if placed is not None else None
    evaluates = placed is None or eval_frame is not None
    pending: int | None = None  # the round of a checkpoint being written, until its manifest is
    try:
        beacon = loop.guard.beacon if loop.guard is not None else None
        transport = SparkTransport(loop.spark.sparkContext, cfg.workers, beacon=beacon)
        base = loop.first_task(begin, run_id="")  # each segment's own run_id replaces it
        executors = _Executors()
        seg = _Segment.at(loop, begin)  # a copy: a replay may go back to `begin` itself
        theta, integers, r, replays = seg.outer.theta.numpy(), seg.integers, seg.first, 0
        steps, train_size = seg.steps, loop.problem.source.train_size
        chooser, tau = tau_choice.chooser_of(cfg, begin.tau_state), base.tau
        start_up = True  # this process's first round, and a replay's
        while r < cfg.rounds:
            loop.lock.check()
            done = r + 1
            pending = done if checkpoint.published(cfg, done, evaluates) else None
            stage = checkpoint.begin(run.store, done) if pending is not None else None
            task = replace(
                base, run_id=seg.run_id, round=r, integers=integers, checkpoint_dir=stage, tau=tau,
                step=steps,
            )  # fmt: skip
            t0 = time.perf_counter()
            contrib, broadcast_s = transport.map_reduce(
                theta, functools.partial(train_work, task), Contribution.combine, train_frame
            )
            missed = _missed(contrib) if r > seg.first else []
            if missed:  # not stepped with: replayed from the last checkpoint
                seen: dict[str, Any] = {}  # the executors lost and joined, for the next row
                executors.after_round(seen, transport)
                if replays == REPLAYS:
                    raise _replays_spent(done, seg.first)
                replays += 1
                if pending is not None:  # the workers wrote states into it: not the run's
                    checkpoint.discard(run.store, pending)
                    pending = None
                again = _restart_state(loop, begin)
                seg = _Segment.at(loop, again)
                chooser = tau_choice.chooser_of(cfg, again.tau_state)
                tau = tau_choice.next_tau(cfg, again.tau_state)
                executors.dropped([*loop.rewind(seg.first), seen])
                loop.warn(_replay_line(done, missed, seg.first, replays))
                transport.rebalance()  # every state comes from the checkpoint now: spread
                executors.spread = False
                theta, integers, r = seg.outer.theta.numpy(), seg.integers, seg.first
                steps, start_up = seg.steps, True
                continue
            if contrib.delta_sum is None:
                _raise_diverged(contrib, done, run)
            seg.outer.lr = schedule.outer_lr(cfg, train_size, steps, r, task.tau)
            theta = seg.outer.step(mean_update(contrib.delta_sum, contrib.workers))
            integers = contrib.integers
            round_s = time.perf_counter() - t0
            row = round_row(done, contrib.reports, round_s, broadcast_s, start_up)
            start_up = False
            row.update(schedule.round_fields(cfg, train_size, steps, r, task.tau))
            steps += task.tau
            tau = tau_choice.after_round(chooser, task.tau, row)
            executors.after_round(row, transport)
            if evaluates and checkpoint.due(cfg.eval_every, done, cfg.rounds):
                eval_task = replace(task, integers=integers, checkpoint_dir=None)
                ev, _ = transport.map_reduce(
                    theta, functools.partial(eval_work, eval_task), EvalResult.combine, eval_frame
                )
                row.update(eval_row(ev))
            marker = checkpoint.target_marker(cfg, row, done)
            stop = EARLY in marker  # the target reached before the last round: the run ends
            row.update(marker)
            row["elapsed_s"] = seg.elapsed_s + time.perf_counter() - seg.t_start
            loop.record(row, begin)
            if pending is not None:
                checkpoint.write(
                    run.store, done, layout, theta, integers, seg.outer.momentum_buffer,
                    row["elapsed_s"], cfg.to_yaml(),
                    tau_state=None if chooser is None else chooser.state(), steps=steps,
                )  # fmt: skip
                pending = None
                write_config(run, cfg)
                replays = 0
                loop.prune()
                executors.spread_out(transport)  # a partition that moves finds it there
            if loop.on_round is not None:
                loop.on_round(row)
            r += 1
            if stop:
                break
    finally:
        if pending is not None:
            _abandon(run, pending, loop.spark if loop.own_session else None)
    return checkpoint.state_dict_bytes(layout.unflatten(theta, integers))


@dataclass
class _Segment:
    """Where the `spark` transport's rounds run from: the run's beginning, or the checkpoint a
    replay went back to. Its tasks key their executor-local inner states by `run_id`, new for
    each segment: its first round finds none there and reads every state from the checkpoint
    (round 0 needs none), exactly as a resume does, and no state that a dropped round wrote (a
    missed partition's fresh one) is ever read again."""

    first: int
    outer: OuterOptimizer
    integers: dict[str, np.ndarray]
    elapsed_s: float
    #: the inner steps taken before its first round
    steps: int = 0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    t_start: float = field(default_factory=time.perf_counter)

    @staticmethod
    def at(loop: RunContext, b: StartPoint) -> _Segment:
        """A segment from `b`, with an outer optimizer of its own (`b`'s is never stepped)."""
        outer = outer_at(loop.cfg, b.layout, b.outer.theta.numpy(), b.outer.momentum_buffer)
        return _Segment(b.rounds, outer, b.integers, b.elapsed_s, steps=b.steps)


def _missed(contrib: Contribution) -> list[int]:
    """The partitions of a round that found no inner optimizer state."""
    return sorted(r.partition for r in contrib.reports if r.inner_state_miss)


def _from_where(rounds: int) -> str:
    return f"checkpoint {checkpoint.name(rounds)}" if rounds else "the start (no checkpoint yet)"


def _replay_line(done: int, missed: list[int], again: int, replays: int) -> str:
    """The warning of one replay: the round that found the miss, what runs again, from where."""
    which = f"partition{'s' if len(missed) > 1 else ''} {', '.join(map(str, missed))}"
    rounds = f"round {done}" if again + 1 == done else f"rounds {again + 1}-{done}"
    return (
        f"round {done}: {which} found no inner optimizer state (an executor was lost or the "
        f"partition moved); running {rounds} again from {_from_where(again)}, so that the run "
        f"ends as without the loss (replay {replays} of at most {REPLAYS})"
    )


def _replays_spent(done: int, again: int) -> SparknetError:
    then = "run it again with {@resume=True}" if again else "run it again"
    return SparknetError(
        "round {done}: partitions still found no inner optimizer state after {replays} replays "
        "from {where}: executors keep being lost; " + then + " once the cluster keeps its "
        "executors, or train with {@inner_state=reset}",
        done=done, replays=REPLAYS, where=_from_where(again), reset="reset",
    )  # fmt: skip


def allreduce_rounds(loop: RunContext, begin: StartPoint, placed: Frames | None) -> bytes:
    """The rounds as one barrier stage (the `allreduce` transport). A failed stage runs again
    from the last complete checkpoint, at most `allreduce.RESTARTS` times; returns the final
    weights (the last round always ends with a checkpoint) as model.safetensors bytes."""
    cfg, run = loop.cfg, loop.run
    transport = AllReduceTransport(
        loop.spark.sparkContext, cfg.workers, placed, loop.guard, pack=cfg.pack_workers
    )
    base = loop.first_task(begin, run_id=uuid.uuid4().hex[:12])
    executors = _Executors()
    restarts = 0
    stage_begin = begin
    try:
        while True:
            try:
                first = replace(
                    base, round=stage_begin.rounds, integers=stage_begin.integers,
                    tau=tau_choice.next_tau(cfg, stage_begin.tau_state), step=stage_begin.steps,
                )  # fmt: skip
                _one_stage(loop, transport, first, stage_begin, begin, restarts, executors)
                loop.prune()  # the last round's checkpoint is published: its turn
                break
            except Diverged as exc:
                raise SparknetError(
                    "{cause}; last good checkpoint: {last}", cause=exc, last=_last_good(run)
                ) from exc
            except StageFailed as exc:
                if exc.permanent or restarts == RESTARTS:
                    raise SparknetError(f"the allreduce stage failed: {exc}") from exc
                restarts += 1
                checkpoint.discard_incomplete(run.store)
                _wait_to_restart(loop, transport, exc)
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
    last = loop.metrics.rounds[-1]["round"]  # cfg.rounds, or where stop_at ended the run
    return checkpoint.read_weights(run.store, last)


def _one_stage(
    loop: RunContext,
    transport,
    base: RoundTask,
    stage_begin: StartPoint,
    begin: StartPoint,
    restarts: int,
    executors: _Executors,
) -> None:
    """One barrier stage from `stage_begin`: each row recorded, then acknowledged (rank 0 then
    publishes the round's checkpoint), then shown."""
    rows = transport.stage(
        base, stage_begin.outer.theta.numpy(), stage_begin.outer.momentum_buffer,
        stage_begin.elapsed_s, restarts, stage_begin.tau_state,
    )  # fmt: skip
    for message in rows:
        if isinstance(message, int):  # the stage (re)starts after this round
            executors.dropped(loop.rewind(message))
            continue
        loop.lock.check()
        row = message.row
        executors.after_round(row, transport)
        loop.record(row, begin)
        acknowledged = message.acks
        message.ack()
        if acknowledged:  # rank 0 now writes this round's checkpoint: those before are complete
            loop.prune()
        if loop.on_round is not None:
            loop.on_round(row)


def _wait_to_restart(loop: RunContext, transport: AllReduceTransport, exc: StageFailed) -> None:
    """A failed stage runs again only where it can: a barrier stage needs a task slot for every
    worker at once, and on a static cluster a lost host never comes back (Spark would hold the
    stage, waiting without end). With executors that cannot run it, wait up to
    no_executor_timeout_s (0: without end) for the lost ones to come back or be replaced; then
    the run ends in one line naming them."""
    why = transport.cannot_run()
    if why is None:
        return
    stopped = loop.guard.stopped if loop.guard is not None else {}
    lost = transport.lost()
    if lost and all(one.split("@", 1)[0] in stopped for one in lost):
        # stopped by the progress guard for a frozen worker: Spark starts none in their place
        raise SparknetError(
            "the allreduce stage cannot run again: {lost} {were} stopped (a worker there made no "
            "progress), so {why}; check that host (a hung GPU, a stuck file system) and "
            "{@resume=True}, or {@resume=True} {@allow_change=True} with fewer {@workers} (last "
            "good checkpoint: {last})",
            lost=_lost_ones(lost), were="was" if len(lost) == 1 else "were", why=why,
            last=_last_good(loop.run),
        )  # fmt: skip
    wait_s = loop.cfg.no_executor_timeout_s
    upto = f"up to {wait_s:g} s" if wait_s else "without end (no_executor_timeout_s is 0)"
    failed = f"the allreduce stage failed ({exc})"
    if why != exc.why:  # the driver's own check failed it, in these words
        failed += f" and cannot run again yet: {why}"
    loop.warn(
        f"{failed}; waiting {upto} for {_lost_ones(transport.lost())} to come back or be replaced"
    )
    why = transport.wait_until_runnable(wait_s)
    if why is not None:
        lost = transport.lost()
        one = len(lost) == 1
        raise SparknetError(
            "the allreduce stage cannot run again: {lost} {are} gone and no executor came in "
            "{their} place in {wait_s} s, so {why}; bring the host back and {@resume=True}, or "
            "{@resume=True} {@allow_change=True} with fewer {@workers} (last good checkpoint: "
            "{last}; no_executor_timeout_s sets the wait)",
            lost=_lost_ones(lost), are="is" if one else "are", their="its" if one else "their",
            wait_s=f"{wait_s:g}", why=why, last=_last_good(loop.run),
        )  # fmt: skip


def _lost_ones(lost: list[str]) -> str:
    """The lost executors in words: "executor 1@10.0.0.5", "executors 1@a, 2@b"."""
    if not lost:
        return "the lost executors"
    return f"executor{'s' if len(lost) > 1 else ''} {', '.join(lost)}"


def _restart_state(loop: RunContext, begin: StartPoint) -> StartPoint:
    """Where a failed stage runs again from: the last complete checkpoint, or where the run
    began when none was written since."""
    last = checkpoint.latest(loop.run.store)
    if last is None or last <= begin.rounds:
        return begin
    return StartPoint.from_checkpoint(loop.cfg, loop.run, last, begin.layout)


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

    def rewind(self, rounds: int) -> None:
        """The rounds past `rounds` run again: TensorBoard drops what was written for them."""
        self.log.purge(rounds + 1)
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
