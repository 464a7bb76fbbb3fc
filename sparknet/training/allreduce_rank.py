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
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pyspark import BarrierTaskContext, SparkFiles

from sparknet.data.frames import rank_rows
from sparknet.data.store import open_store
from sparknet.errors import is_permanent
from sparknet.training import checkpoint, device, netbind, progress
from sparknet.training.outer import OuterOptimizer
from sparknet.training.report import eval_row, round_row
from sparknet.training.state import StateLayout
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

#: what the update travels as under `compress`
_WIRE = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        outer = OuterOptimizer(
            array_of(theta0), cfg.outer_lr, cfg.outer_momentum, layout.buffer_mask()
        )
        if momentum is not None:
            outer.load_momentum_buffer(array_of(momentum))
        theta, integers = outer.theta.numpy(), base.integers
        store = open_store(base.run_dir, cfg.endpoint_url)
        live = LiveInner(average_in_place=cfg.outer == "average" and cfg.compress == "none")
        local_dir = SparkFiles.getRootDirectory()
        attempt = plan.restart + self.ctx.attemptNumber()
        t_start = time.perf_counter()
        for r in range(base.round, cfg.rounds):
            done = r + 1
            due = checkpoint.due(cfg.checkpoint_every, done, cfg.rounds)
            stage_dir, fault = self._begin(store, done) if due else (None, None)
            task = replace(base, round=r, integers=integers, checkpoint_dir=stage_dir)
            t0 = time.perf_counter()
            contrib = None
            if fault is None:
                contrib, fault = self._train(task, theta, attempt, threads, local_dir, live)
            t_exchange = time.perf_counter()
            everyone: list[Any] = [None] * self.world
            report = contrib.reports[0] if contrib is not None else None
            with progress.waiting():
                dist.all_gather_object(everyone, _Round(report, fault))
            if self._stopped(everyone, done, channel):
                return
            assert contrib is not None
            if live.weights is not None:  # plain averaging: the weights, in the model's buffer
                summed = live.weights
            else:
                assert contrib.delta_sum is not None
                summed = torch.from_numpy(contrib.delta_sum)
            with progress.waiting():
                mean = _mean(summed, self.world, cfg.compress, on).numpy()
                integers = _from_rank0(contrib.integers, layout)
            exchange_s = time.perf_counter() - t_exchange
            theta = mean if live.weights is not None else outer.step(mean)
            row = round_row(done, [e.report for e in everyone], time.perf_counter() - t0, 0.0)
            row["seconds"]["exchange"] = exchange_s
            if plan.evaluates and checkpoint.due(cfg.eval_every, done, cfg.rounds):
                eval_task = replace(task, integers=integers, checkpoint_dir=None)
                row.update(eval_row(self._evaluate(eval_task, theta, threads)))
            if channel is None:
                continue
            row["elapsed_s"] = plan.elapsed_s + time.perf_counter() - t_start
            with progress.waiting():  # the driver's acknowledgement; the store's own deadlines
                channel.row(row, ack=due)
                if due:
                    try:
                        checkpoint.write(
                            store, done, layout, theta, integers, outer.momentum_buffer,
                            row["elapsed_s"], cfg.to_yaml(),
                        )  # fmt: skip
                    except Exception as exc:
                        if not is_permanent(exc):
                            raise  # the stage fails and runs again from the last checkpoint
                        channel.say(**TaskFault.of(0, exc).said())  # a full disk: no restart
                        return

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


#: a host buffer is all-reduced in up to this many pieces, each divided while gloo sums the
#: next, of at least `_PIECE_MIN` floats (below that a piece's fixed cost outweighs the overlap)
_PIECES, _PIECE_MIN = 4, 4 << 20


def _mean(flat: torch.Tensor, world: int, compress: str, on: torch.device) -> torch.Tensor:
    """`flat` (on the host) <- its mean over the ranks, in place; on the wire as `compress`
    says. A host buffer goes in pieces, each all-reduced on gloo's own threads, so dividing one
    overlaps summing the next (at 100 MB the division alone is a pass of ~4 ms)."""
    wire = _WIRE[compress]
    if wire is None and on.type != "cuda":
        n = max(1, min(_PIECES, flat.numel() // _PIECE_MIN))
        pieces = [(piece, dist.all_reduce(piece, async_op=True)) for piece in flat.chunk(n)]
        for piece, work in pieces:
            work.wait()
            piece.div_(world)
        return flat
    buf = flat.to(device=on, dtype=wire or flat.dtype)
    dist.all_reduce(buf)
    return flat.copy_(buf.to(device="cpu", dtype=flat.dtype)).div_(world)


def _from_rank0(integers: dict[str, np.ndarray] | None, layout: StateLayout) -> dict:
    """Rank 0's integer buffers (num_batches_tracked), on every rank: worker 0's value."""
    if all(e.offset >= 0 for e in layout.entries):
        return {}
    box = [integers]
    dist.broadcast_object_list(box, src=0)
    return box[0]
