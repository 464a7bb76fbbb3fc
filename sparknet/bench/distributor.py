"""The contenders sparknet's local SGD is measured against.

pyspark's `TorchDistributor` (plain DDP over gloo, one all-reduce of the gradients every step)
and one plain PyTorch process.

Both train exactly what a sparknet run trains: the same `build_model` under the same seed, the
same data (`load_data`), rank k of K on sparknet's shard k with sparknet's batch order
(`shard`, `batch_positions`), cross-entropy, `torch.optim.SGD(lr, momentum)` without weight
decay, evaluated on the whole test set. Rank 0 evaluates every `eval_every` steps (sooner where
those would take more than `eval_s` seconds) with the clock stopped (the ranks wait in a
barrier, then for its stop decision and the steps to the next evaluation), so `train_s` is
training alone. DDP keeps its defaults: rank 0's BatchNorm buffers are broadcast every step. Its
own runtime statistics, taken every step, say how long rank 0 waited on the all-reduces.

What TorchDistributor needs and costs (pyspark 4.3.0, torch 2.14.1, measured on this 2-core
machine while other jobs shared it: figures vary ~2x from run to run):
- `local_mode=False`: one barrier task per rank. With `use_gpu=False` no GPU setting is read
  (with GPUs `spark.task.resource.gpu.amount` must be >= 1 and divide `num_processes`), so it
  needs K task slots free at once and no dynamic allocation; short of slots Spark retries the
  barrier check (40 times, 15 s apart) before failing, so `run_distributor` refuses first.
  Executors need pandas and pyarrow (`mapInArrow`), must reach the driver's log-streaming port
  and each other on any port. Each task runs torchrun with a static rendezvous at rank 0's
  executor address as Spark advertises it (`getTaskInfos`), on a port rank 0 picked and let go;
  that store listens on every interface, unauthenticated. Gloo is bound here to the interface
  that routes to that address (`netbind`), not to what the hostname resolves to (often
  127.0.1.1 on Debian). `spark.ssl.enabled` makes it refuse unless
  `pytorch.spark.distributor.ignoreSsl` is set.
- `local_mode=True`: torchrun with K processes on the driver's machine, whatever the master;
  Spark runs nothing (only an active session is required).
- Start-up, call to first step (digits/mlp, K=2): local mode 6.5-8.5 s (torch imported by the
  agent, then by each rank); local_mode=False 15-21 s on local[2] and 16-35 s on the test's
  standalone cluster, the first run of a session the slowest: 6-12 s until torchrun starts in
  the tasks (a 1 s sleep for the log server, the barrier job, two ~1 s `allGather`s), then
  9-18 s (an agent per rank, each importing torch, then the rank). After the last step another
  ~2.5 s (local mode) to ~3 s (tasks) pass before the call returns (torchrun's exit barrier).
  Plain PyTorch: 0 s once the data is loaded in this process.
- Output: local mode prints torchrun's 4-line OMP_NUM_THREADS banner to stdout each run; with
  tasks the ranks' output is streamed to the driver's stdout (nothing unless something fails).
  Its logger writes "Started/Finished ... training" to stderr.
- Samples/s at batch 32, 1 thread a process: digits/mlp plain 45-54k, K=2 21-24k in local mode
  and 11-13k in tasks (a ~1-2 ms all-reduce a step against a ~0.7 ms step); imagenet-like/cnn
  plain 1.7-1.9k, K=2 2.8-3.0k in either mode.
- Both modes train bit-identical models, run after run (gloo on the CPU is deterministic here).
- Surprises: pyspark's torchrun wrapper drops torchrun's exit status, so a rank that dies after
  writing its result goes unnoticed (seen once: rank 0 aborted at exit); in local mode every
  rank writes the result to the same file, so every rank returns rank 0's.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparknet.data.sources import (
    EVAL_BATCH,  # samples per evaluation batch, as sparknet's
    batch_positions,
    load_data,
    make_batch,
    shard,
)
from sparknet.errors import SparknetError
from sparknet.models import build_model
from sparknet.training.netbind import bind_collectives, listen_address
from sparknet.training.worker import task_seed

# `# lazy: pyspark`: only the TorchDistributor path needs it; plain PyTorch and the ranks do not


@dataclass(frozen=True)
class PeerSpec:
    """One contender's run: what it trains, on how many processes, and when it stops."""

    data: str  # a load_data spec
    model: str
    workers: int  # K (1 for plain)
    batch_size: int  # per worker per step
    lr: float
    momentum: float
    threads: int  # torch threads per process
    seed: int
    target: float  # test accuracy that counts as reached
    max_steps: int  # give up after this many steps
    max_seconds: float  # or after this many seconds of training (checked when evaluating)
    eval_every: int  # steps between evaluations on the whole test set
    #: evaluate sooner where `eval_every` steps would take more than this many seconds of
    #: training (a step of seconds on a slow link), so that a time to the target is known to
    #: within it; the steps to the next evaluation come from the last ones' seconds per step
    eval_s: float = math.inf
    #: hand back rank 0's final weights (`PeerRun.state`), for tests that compare them
    keep_state: bool = False

    def __post_init__(self) -> None:
        for name in ("workers", "batch_size", "threads", "max_steps", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.max_seconds <= 0 or self.eval_s <= 0:
            raise ValueError(
                f"lr, max_seconds and eval_s must be positive: {self.lr}, {self.max_seconds}, "
                f"{self.eval_s}"
            )


@dataclass
class PeerRun:
    steps: int
    samples: int  # samples trained, all ranks together
    train_s: float  # seconds of training, evaluations excluded
    setup_s: float  # wall seconds from the call to the first step (step 0's evaluation excluded)
    curve: list[tuple[float, int, float]]  # (train_s, samples, test accuracy) per evaluation
    seconds_to_target: float | None  # train_s at the first evaluation >= target
    #: wall seconds of the whole call, as the caller waited (set by the caller's side)
    wall_s: float = 0.0
    state: dict | None = None  # rank 0's final state_dict, when `PeerSpec.keep_state`
    #: DDP: seconds of training rank 0 waited on the all-reduces (`_ddp_seconds`); None
    #: without a process group, or where DDP gave no statistics
    wait_s: float | None = None
    #: DDP: seconds the all-reduces were under way, first bucket's launch to last one's end
    busy_s: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_s if self.train_s > 0 else 0.0


def run_plain(spec: PeerSpec) -> PeerRun:
    """The K=1 reference: one process, this one, no Spark and no process group. Runs on
    `spec.threads` torch threads, and gives this process its thread count back afterwards."""
    if spec.workers != 1:
        raise ValueError(f"plain PyTorch is one process: workers must be 1, got {spec.workers}")
    threads = torch.get_num_threads()
    started = time.time()
    try:
        run = _train(spec, started, group=False, local=True)
    finally:
        torch.set_num_threads(threads)
    run.wall_s = time.time() - started
    return run


def run_distributor(spark, spec: PeerSpec, local_mode: bool) -> PeerRun:
    """`spec` as K DDP processes under `TorchDistributor` on `spark`'s executors (`local_mode`:
    on this machine instead). TorchDistributor takes the active session, which is `spark`
    (one SparkContext per process). The result is rank 0's."""
    from pyspark.ml.torch.distributor import TorchDistributor  # lazy: pyspark

    if not local_mode:
        _check_slots(spark.sparkContext, spec.workers)
    started = time.time()
    distributor = TorchDistributor(num_processes=spec.workers, local_mode=local_mode, use_gpu=False)
    run = distributor.run(_train, spec, started, True, local_mode)
    if not isinstance(run, PeerRun):
        raise SparknetError(f"TorchDistributor returned {type(run).__name__}, not a PeerRun")
    run.wall_s = time.time() - started
    return run


def _check_slots(sc, ranks: int) -> None:
    """Refuse what would make the barrier job wait (~10 min, then fail) rather than run: fewer
    task slots than ranks once the executors have registered, or dynamic allocation."""
    from sparknet.training.transport import (  # lazy: pyspark
        conf_int,
        dynamic_allocation,
        task_slots,
        wait_for_executors,
    )

    if dynamic_allocation(sc):
        raise SparknetError("TorchDistributor's barrier tasks need dynamic allocation off")
    cores = wait_for_executors(sc, ranks)
    slots = task_slots(cores, conf_int(sc, "spark.task.cpus", 1), 0)
    if slots < ranks:
        raise SparknetError(
            f"TorchDistributor runs its {ranks} ranks at once and the executors have {slots} "
            "task slot(s): fewer workers, or more executors"
        )


# ---- one rank ---------------------------------------------------------------------------------


def _train(spec: PeerSpec, started: float, group: bool, local: bool) -> PeerRun:
    """One rank's run (the whole run without a `group`). Module-level, so TorchDistributor
    pickles it by reference; the ranks import sparknet as installed (torchrun runs a script
    in a temporary dir, so the caller's working dir is not on their path)."""
    torch.set_num_threads(spec.threads)
    if not group:
        return _fit(spec, started, 0, 1)
    _bind_gloo(local)
    dist.init_process_group("gloo")
    try:
        if dist.get_world_size() != spec.workers:
            raise SparknetError(f"{dist.get_world_size()} ranks started for {spec.workers}")
        box = [_fit(spec, started, dist.get_rank(), spec.workers)]
        # in local mode every rank writes the result to the same file: all must write rank 0's
        dist.broadcast_object_list(box, 0)
        dist.barrier()  # no rank tears the group down while another still reads from it
        return box[0]
    finally:
        dist.destroy_process_group()


def _fit(spec: PeerSpec, started: float, rank: int, world: int) -> PeerRun:
    """Train rank `rank` of `world` (wrapped in DDP when `world` > 1) until rank 0 says stop;
    the run as rank 0 saw it."""
    group = world > 1
    split = load_data(spec.data)
    if split.num_classes is None:
        raise SparknetError(f"data {spec.data!r} does not say its number of classes")
    torch.manual_seed(spec.seed)  # sparknet's driver builds its model under the seed
    model = build_model(spec.model, split.input_shape, split.num_classes)
    net = torch.nn.parallel.DistributedDataParallel(model) if group else model
    if group:  # its runtime statistics of every step, not of every 100th after the 10th
        net._set_ddp_runtime_logging_sample_rate(1)
    opt = torch.optim.SGD(net.parameters(), lr=spec.lr, momentum=spec.momentum)
    part = shard(len(split.train), world, rank, spec.seed)
    torch.manual_seed(task_seed(spec.seed, rank, 0))  # as sparknet's worker k, round 0
    curve: list[tuple[float, int, float]] = []
    setup_s = time.time() - started
    step, train_s, reached = 0, 0.0, None
    due, last = 0, (0, 0.0)  # the next evaluation's step; the last one's step and train_s
    model.train()
    clock = time.perf_counter()
    while True:
        if step == due or step == spec.max_steps:
            if group:
                dist.barrier()  # the clock stops when the slowest rank is done
            train_s += time.perf_counter() - clock if step else 0.0  # 0 before any step
            told = torch.zeros(2)  # stop, and the steps to the next evaluation
            if rank == 0:
                acc = _accuracy(model, split.test)
                curve.append((train_s, step * world * spec.batch_size, acc))
                if acc >= spec.target:
                    reached = train_s
                done = reached is not None or step >= spec.max_steps
                told[0] = float(done or train_s >= spec.max_seconds)
                told[1] = _steps_to_next(spec, step - last[0], train_s - last[1])
            if group:
                dist.broadcast(told, 0)  # the others wait here while rank 0 evaluates
            clock = time.perf_counter()
            if told[0].item():
                break
            due, last = step + int(told[1].item()), (step, train_s)
        pos = batch_positions(spec.seed, rank, len(part), step, spec.batch_size)
        x, y = make_batch(split.train, part[pos])
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        step += 1
    state = {k: v.clone() for k, v in model.state_dict().items()} if spec.keep_state else None
    samples = step * world * spec.batch_size
    run = PeerRun(step, samples, train_s, setup_s, curve, reached, state=state)
    if group:
        run.wait_s, run.busy_s = _ddp_seconds(net, step)
    return run


def _steps_to_next(spec: PeerSpec, steps: int, seconds: float) -> int:
    """Steps to the next evaluation: `eval_every`, fewer where they would take more than
    `eval_s` seconds at the last steps' pace; after step 0 (no pace yet) one step, where an
    `eval_s` is set, to measure one."""
    if math.isinf(spec.eval_s):
        return spec.eval_every
    if steps == 0:
        return 1
    return max(1, min(spec.eval_every, int(spec.eval_s * steps / max(seconds, 1e-9))))


def _ddp_seconds(net, steps: int) -> tuple[float | None, float | None]:
    """(wait, busy) seconds of this rank's `steps` steps, from DDP's own runtime statistics
    (`_get_ddp_logging_data`: mean nanoseconds over the steps sampled, every step here): wait,
    per step the all-reduce's end less the end of the backward's compute, the all-reduce time
    the backward did not hide; busy, the all-reduces from the first bucket's launch to the last
    one's end. (None, None) where this torch gives no such figures (a private interface). A
    rank whose compute is slower makes the other wait in the all-reduce: counted here too."""
    try:
        data = net._get_ddp_logging_data()
        comm = float(data["avg_backward_comm_time"]) / 1e9
        hidden = float(data["avg_backward_compute_comm_overlap_time"]) / 1e9
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError):
        return None, None
    return max(comm - hidden, 0.0) * steps, comm * steps


def _accuracy(model, test) -> float:
    """Top-1 accuracy of `model` on the whole test set, in eval mode; back in train mode after."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(test), EVAL_BATCH):
            x, y = make_batch(test, np.arange(start, min(start + EVAL_BATCH, len(test))))
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(test)


def _bind_gloo(local: bool) -> None:
    """Gloo listens on loopback in local mode; on a cluster on this node's address that routes
    to rank 0 (MASTER_ADDR, set by torchrun to rank 0's executor address). Unset, gloo takes
    what the hostname resolves to, which other nodes may not reach."""
    bind_collectives("127.0.0.1" if local else _route_source(os.environ["MASTER_ADDR"]))


def _route_source(host: str) -> str:
    """This machine's address the kernel sends from to reach `host` (no packet is sent)."""
    address = listen_address(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((address, 9))
        return str(sock.getsockname()[0])
