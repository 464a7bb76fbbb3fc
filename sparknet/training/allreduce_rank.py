"""The `allreduce` transport as each rank runs it.

One task of the barrier stage sets up the process group, then trains, exchanges and steps every
round, and rank 0 reports to the driver.

Kept apart from `allreduce` (the driver's side: where a stage can run, the channel, restarts):
this is what runs on the executors, in one long Spark task, and it meets the driver only in
`StagePlan` and rank 0's lines on the channel.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pyspark import BarrierTaskContext, SparkFiles

from sparknet.config import TrainConfig
from sparknet.data.frames import rank_rows
from sparknet.data.store import open_store
from sparknet.errors import is_permanent
from sparknet.training import checkpoint, device, netbind, progress, schedule, tau_choice
from sparknet.training.compress import exchange_mean
from sparknet.training.outer import OuterOptimizer, outer_at
from sparknet.training.report import EARLY, eval_row, round_row
from sparknet.training.state import StateLayout
from sparknet.training.sync import Exchange, Synchronizer, fragments_of
from sparknet.training.transport import TaskFault, array_of, threads_per_task
from sparknet.training.worker import (
    EvalResult,
    InjectedFailure,
    LiveInner,
    RoundTask,
    WorkerReport,
    evaluate_partition,
    train_partition,
)


@dataclass(frozen=True)
class StagePlan:
    """What every rank of a stage starts from; shipped inside the tasks."""

    base: RoundTask  # round: the first round the stage runs
    weights: Any  # a broadcast of (theta, outer momentum or None), both in band
    elapsed_s: float
    channel: tuple[str, int]
    token: str
    #: the driver's restart count: the fault drill fires in the first stage only
    restart: int
    #: executor "host:port" -> cores, for each rank's torch threads (empty on a local master)
    cores: dict[str, int]
    task_cpus: int
    gpus: int
    #: False for a DataFrame run without an eval frame (as under the spark transport)
    evaluates: bool = True
    #: where each rank reports its progress (None: no guard)
    beacon: progress.Beacon | None = None
    #: the process group's timeout: past the driver's deadline for a frozen rank, so that the
    #: driver names it first (None: torch's default)
    collective_timeout_s: float | None = None
    #: under tau auto, the chooser as the stage's checkpoint left it (rank 0 chooses)
    tau_state: dict[str, Any] | None = None


def stage_task(plan: StagePlan, frames: bool):
    """A rank's task; with `frames` its items are its partition's Arrow blobs of both frames,
    read once and kept for the whole stage."""

    def run(items: Iterator) -> Iterator[int]:
        rows = rank_rows(items) if frames else None
        if rows is None:
            for _ in items:
                pass
        ctx = BarrierTaskContext.get()
        _Rank(plan, ctx, rows).run()
        yield ctx.partitionId()

    return run


def _rank_threads(plan: StagePlan, ctx: BarrierTaskContext) -> int:
    """Torch threads for this rank: its executor's cores over the stage's tasks there; on a
    local master the task's own cpus."""
    addresses = [info.address for info in ctx.getTaskInfos()]
    mine = addresses[ctx.partitionId()]
    if mine not in plan.cores:
        return max(1, ctx.cpus())
    return threads_per_task(plan.cores[mine], addresses.count(mine), plan.task_cpus, plan.gpus)


def _backend(on: torch.device) -> str:
    """NCCL for the update on GPUs (gloo for the small host-side exchanges), gloo on CPUs."""
    return "cpu:gloo,cuda:nccl" if on.type == "cuda" else "gloo"


def _process_group(
    ctx: BarrierTaskContext, on: torch.device, timeout_s: float | None = None
) -> None:
    """The default process group over the stage's tasks, made with one allGather: rank 0
    opens a TCPStore on its node's address and that address and port go round (~25 ms, not
    the default init's rendezvous of a second or more). The store and gloo listen on the
    node's cluster address (the one its executor advertises) only: neither is authenticated
    nor encrypted (`netbind`). `timeout_s` bounds each collective's wait (the driver's progress
    guard fails a frozen rank well before)."""
    if dist.is_initialized():  # a cancelled stage's, in a reused Python worker
        dist.destroy_process_group()
    rank, infos = ctx.partitionId(), ctx.getTaskInfos()
    world = len(infos)
    mine = netbind.listen_address(_host_of(infos[rank].address))
    netbind.bind_collectives(mine)
    store = netbind.store_server(mine, world) if rank == 0 else None
    said = ctx.allGather(f"{mine} {store.port}" if store is not None else "")[0]
    host, port = said.rsplit(" ", 1)
    if store is None:
        store = dist.TCPStore(host, int(port), world, False)
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group(_backend(on), store=store, rank=rank, world_size=world, **timeout)


def _host_of(address: str) -> str:
    """The host of an executor's `host:port` (`[v6]:port` too)."""
    return address.rsplit(":", 1)[0].strip("[]")


class _ToDriver:
    """Rank 0's end of the channel."""

    def __init__(self, plan: StagePlan, start: int) -> None:
        self.sock = socket.create_connection(plan.channel, timeout=60)
        self.sock.settimeout(None)  # an ack waits as long as the driver takes to record a row
        self.lines = self.sock.makefile("rb")
        self._send({"token": plan.token, "start": start})

    def _send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def row(self, row: dict[str, Any], ack: bool) -> None:
        self._send({"row": row, "ack": ack})
        if ack and self.lines.readline().strip() != b"ok":
            raise ConnectionError("the driver went away before recording a round")

    def say(self, **message: Any) -> None:
        self._send(message)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class _Round:
    """What every rank learns of a round from the others."""

    report: WorkerReport | None
    fault: TaskFault | None


class _Rank:
    def __init__(
        self, plan: StagePlan, ctx: BarrierTaskContext, rows: tuple[list, list] | None
    ) -> None:
        self.plan = plan
        self.ctx = ctx
        #: (train, eval) record batches of a DataFrame run's partition; None: the source reads
        self.rows, self.eval_rows = rows if rows is not None else (None, None)
        self.rank = ctx.partitionId()
        self.world = len(ctx.getTaskInfos())
        self.cfg = plan.base.cfg

    def run(self) -> None:
        cfg, plan = self.cfg, self.plan
        on = device.task_device(cfg.device)
        threads = _rank_threads(plan, self.ctx)
        with progress.reporting(plan.beacon, self.rank):
            with progress.waiting():
                _process_group(self.ctx, on, plan.collective_timeout_s)
            self._run(on, threads)

    def _run(self, on: torch.device, threads: int) -> None:
        """The rounds, over the process group made; rank 0 with its channel to the driver."""
        plan = self.plan
        channel = _ToDriver(plan, plan.base.round) if self.rank == 0 else None
        try:
            self._rounds(on, threads, channel)
            if channel is not None:
                channel.say(done=True)
        finally:
            if channel is not None:
                channel.close()
            dist.destroy_process_group()

    def _rounds(self, on: torch.device, threads: int, channel: _ToDriver | None) -> None:
        cfg, plan, base = self.cfg, self.plan, self.plan.base
        theta0, momentum = plan.weights.value
        layout = base.layout
        integers = base.integers
        store = open_store(base.run_dir, cfg.endpoint_url)
        live = LiveInner()
        syncs = self._syncs(
            on, array_of(theta0), None if momentum is None else array_of(momentum), live
        )
        local_dir = SparkFiles.getRootDirectory()
        attempt = plan.restart + self.ctx.attemptNumber()
        chooser = tau_choice.chooser_of(cfg, plan.tau_state) if self.rank == 0 else None
        tau, steps, train_size = base.tau, base.step, base.source.train_size
        t_start = time.perf_counter()
        try:
            for r in range(base.round, cfg.rounds):
                done = r + 1
                due = checkpoint.published(cfg, done, plan.evaluates)
                stage_dir, fault = self._begin(store, done) if due else (None, None)
                task = replace(
                    base, round=r, integers=integers, checkpoint_dir=stage_dir, tau=tau, step=steps
                )
                t0 = time.perf_counter()
                contrib = None
                if fault is None:
                    contrib, fault = self._train(
                        task, syncs.start, attempt, threads, local_dir, live
                    )
                everyone: list[Any] = [None] * self.world
                report = contrib.reports[0] if contrib is not None else None
                with progress.waiting():
                    dist.all_gather_object(everyone, _Round(report, fault))
                if self._stopped(everyone, done, channel):
                    return
                assert contrib is not None
                syncs.set_outer_lr(schedule.outer_lr(cfg, train_size, steps, r, task.tau))
                with progress.waiting():
                    exchange_s = syncs.end_round(r, contrib.delta_sum)
                    integers = _from_rank0(contrib.integers, layout)
                # a rank that could not write its part of the checkpoint ends the run (said)
                if stage_dir is not None and not self._kept(syncs, stage_dir, done, channel):
                    return
                # after the last round, what is evaluated and kept as the model holds every
                # worker's progress; the checkpoint keeps the run's own state (a longer run's)
                final = syncs.final_weights() if done == cfg.rounds else None
                theta = syncs.theta if final is None else final
                round_s = time.perf_counter() - t0
                # a stage's first round starts its ranks' process group and Python workers
                row = round_row(done, [e.report for e in everyone], round_s, 0.0, r == base.round)
                row["seconds"]["exchange"] = exchange_s
                row.update(schedule.round_fields(cfg, train_size, steps, r, task.tau))
                steps += task.tau
                if cfg.tau == "auto":  # rank 0 chooses from its own row; every rank runs it
                    box = [tau_choice.after_round(chooser, task.tau, row)]
                    with progress.waiting():
                        dist.broadcast_object_list(box, src=0)
                    tau = box[0]
                if plan.evaluates and checkpoint.due(cfg.eval_every, done, cfg.rounds):
                    eval_task = replace(task, integers=integers, checkpoint_dir=None)
                    row.update(eval_row(self._evaluate(eval_task, theta, threads)))
                # every rank has the evaluation (all-reduced): all end here together
                marker = checkpoint.target_marker(cfg, row, done)
                stop = EARLY in marker  # the target reached before the last round: all end
                if stop and isinstance(syncs, Synchronizer):  # its weights lack what is unsent
                    final = syncs.theta.copy()  # the model kept: the one that reached it
                if channel is None:
                    if stop:
                        return
                    continue
                row.update(marker)
                row["elapsed_s"] = plan.elapsed_s + time.perf_counter() - t_start
                with progress.waiting():  # the driver's acknowledgement; the store's own deadlines
                    channel.row(row, ack=due)
                    if due:
                        try:
                            checkpoint.write(
                                store, done, layout, syncs.theta, integers, syncs.momentum_buffer,
                                row["elapsed_s"], cfg.to_yaml(),
                                final=None if final is syncs.theta else final,
                                tau_state=None if chooser is None else chooser.state(),
                                steps=steps,
                            )  # fmt: skip
                        except Exception as exc:
                            if not is_permanent(exc):
                                raise  # the stage fails and runs again from the last checkpoint
                            channel.say(**TaskFault.of(0, exc).said())  # a full disk: no restart
                            return
                if stop:
                    return
        finally:  # under an exception, a peer the exchange in flight waits on may be gone
            syncs.close(failed=sys.exc_info()[0] is not None)

    def _syncs(
        self, on: torch.device, theta: np.ndarray, momentum: np.ndarray | None, live: LiveInner
    ) -> _Blocking | Synchronizer:
        """How this stage's ranks sync: in fragments or behind compute (`sync`), else the
        blocking round, which averages the model's own buffer where it can (`live`)."""
        cfg, base = self.cfg, self.plan.base
        world = self.world
        if cfg.fragments == 1 and not cfg.overlap:
            outer = outer_at(cfg, base.layout, theta, momentum)
            return _Blocking(
                outer, cfg, live, lambda buf: exchange_mean(buf, world, cfg.compress, on)
            )
        timeout = self.plan.collective_timeout_s
        group = dist.new_group(  # the exchange thread's own collectives, as patient as the rest
            backend=_backend(on), **({"timeout": timedelta(seconds=timeout)} if timeout else {})
        )
        state = None
        if base.round > 0:
            state = checkpoint.read_rank(
                base.run_dir, base.round, self.rank, _sync_tag(cfg), endpoint_url=cfg.endpoint_url
            )
        found: list[Any] = [None] * world
        with progress.waiting():
            dist.all_gather_object(found, state is not None)
        if any(found) and not all(found):  # every rank raises it: no restart heals it
            raise checkpoint.rank_state_missing(base.run_dir, base.round, found.index(False))
        return Synchronizer(
            base.layout, fragments_of(base.layout, cfg.fragments), theta,
            lr=cfg.outer_lr, momentum=cfg.outer_momentum, momentum_buffer=momentum,
            overlap=cfg.overlap, rank_state=state,
            exchange=lambda buf: exchange_mean(buf, world, cfg.compress, on, group),
        )  # fmt: skip

    def _kept(
        self, syncs: _Blocking | Synchronizer, stage_dir: str, done: int, channel: _ToDriver | None
    ) -> bool:
        """Whether every rank wrote its own part of the checkpoint (`sync.RankState`, where the
        ranks hold one): rank 0 publishes the checkpoint only after this. A rank's permanent
        fault (a full disk) ends the run, as in `_begin`."""
        state = syncs.rank_state()
        if state is None:
            return True
        fault = None
        try:
            checkpoint.write_rank(
                stage_dir, self.rank, state, _sync_tag(self.cfg), endpoint_url=self.cfg.endpoint_url
            )
        except Exception as exc:
            if not is_permanent(exc):
                raise
            fault = TaskFault.of(self.rank, exc)
        everyone: list[Any] = [None] * self.world
        with progress.waiting():
            dist.all_gather_object(everyone, _Round(None, fault))
        return not self._stopped(everyone, done, channel)

    def _begin(self, store, done: int) -> tuple[str | None, TaskFault | None]:
        """(the checkpoint dir being assembled, None), or (None, this rank's permanent fault:
        a full or read-only run dir, which every rank then hears of instead of a restart)."""
        try:
            return checkpoint.begin(store, done), None
        except Exception as exc:
            if not is_permanent(exc):
                raise
            return None, TaskFault.of(self.rank, exc)

    def _train(self, task, theta, attempt, threads, local_dir, live):
        """(this rank's contribution, None) or (None, its permanent fault: `is_permanent`, such
        as its inner state refused by a full disk). The fault drill kills the rank's process:
        under this transport it stands for a dead rank."""
        try:
            contrib = train_partition(
                task, theta, self.rank, attempt=attempt, threads=threads,
                local_dir=local_dir, rows=self.rows, live=live,
            )  # fmt: skip
            return contrib, None
        except InjectedFailure:
            os._exit(17)
        except Exception as exc:
            if not is_permanent(exc):
                raise
            return None, TaskFault.of(self.rank, exc)

    def _stopped(self, everyone: list, done: int, channel: _ToDriver | None) -> bool:
        """Whether a rank's fault or divergence ends the run here (every rank sees the same)."""
        faults = [e.fault for e in everyone if e.fault is not None]
        diverged = [e.report for e in everyone if e.report is not None and e.report.diverged]
        if not faults and not diverged:
            return False
        if channel is not None:
            if faults:
                channel.say(**faults[0].said())
            else:
                bad = diverged[0]
                channel.say(diverged={"done": done, "worker": bad.partition, "why": bad.diverged})
        return True

    def _evaluate(self, task: RoundTask, theta: np.ndarray, threads: int) -> EvalResult:
        ev = evaluate_partition(task, theta, self.rank, threads=threads, rows=self.eval_rows)
        sums = torch.tensor(
            [ev.loss_sum, ev.correct, ev.correct5, ev.count, ev.skipped], dtype=torch.float64
        )
        with progress.waiting():
            dist.all_reduce(sums)
        loss, correct, correct5, count, skipped = sums.tolist()
        return EvalResult(loss, int(correct), int(correct5), int(count), int(skipped))


class _Blocking:
    """The blocking round: every rank starts from the global weights, and the mean update is
    stepped as soon as it has crossed. Under plain averaging the ranks average the model's own
    buffer (`LiveInner.average_in_place`): the weights are the mean, with no update written."""

    def __init__(
        self, outer: OuterOptimizer, cfg: TrainConfig, live: LiveInner, exchange: Exchange
    ) -> None:
        self._outer, self._exchange = outer, exchange
        live.average_in_place = cfg.outer == "average" and cfg.compress == "none"
        self.live = live
        self.theta = outer.theta.numpy()

    @property
    def start(self) -> np.ndarray:
        return self.theta

    @property
    def momentum_buffer(self) -> np.ndarray | None:
        return self._outer.momentum_buffer

    def end_round(self, rnd: int, delta: np.ndarray | None) -> float:
        """The mean of the ranks' updates stepped into the global weights; returns the seconds
        the exchange took."""
        t0 = time.perf_counter()
        if self.live.weights is not None:  # plain averaging: the weights, in the model's buffer
            self.theta = self._exchange(self.live.weights).numpy()
        else:
            assert delta is not None
            self.theta = self._outer.step(self._exchange(torch.from_numpy(delta)).numpy())
        return time.perf_counter() - t0

    def set_outer_lr(self, lr: float) -> None:
        """The rate of the outer steps to come (a schedule's)."""
        self._outer.lr = lr

    def final_weights(self) -> np.ndarray:
        """The global weights: nothing of any worker's is left unsent."""
        return self.theta

    def rank_state(self) -> None:
        """Nothing of a rank's own outlives the round: every rank starts from the global weights."""
        return None

    def close(self, *, failed: bool = False) -> None:
        pass


def _sync_tag(cfg: TrainConfig) -> str:
    """What a rank's checkpointed sync state was made under: kept only for the same settings
    (a resume that changed one with allow_change starts every worker from the global weights)."""
    return f"fragments={cfg.fragments} overlap={cfg.overlap} workers={cfg.workers}"


def _from_rank0(integers: dict[str, np.ndarray] | None, layout: StateLayout) -> dict:
    """Rank 0's integer buffers (num_batches_tracked), on every rank: worker 0's value."""
    if all(e.offset >= 0 for e in layout.entries):
        return {}
    box = [integers]
    dist.broadcast_object_list(box, src=0)
    return box[0]
