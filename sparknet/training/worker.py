"""What one Spark task does in a round: tau local steps from the global weights, then its update.

Pure PyTorch apart from asking `device` for the task's GPU and counting its steps in `progress`
(nothing outside a reporting task), so tests can run a worker in-process.
The transport calls `train_partition` / `evaluate_partition` inside tasks and reduces what they
return. On a GPU the model, the optimizer state and the batches live on the device; the flat
weights cross host<->device once per round each way.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sparknet.config import TrainConfig
from sparknet.data.loader import derived_seed
from sparknet.data.sources import Source, TaskInput
from sparknet.errors import SparknetError
from sparknet.models import build_model
from sparknet.training import checkpoint, device, progress, schedule
from sparknet.training.state import StateLayout


@dataclass(frozen=True)
class RoundTask:
    """Everything a worker needs besides the weights; small, shipped inside every task."""

    cfg: TrainConfig
    source: Source
    run_id: str
    round: int
    layout: StateLayout
    integers: dict[str, np.ndarray]
    num_classes: int
    input_shape: tuple[int, ...]
    run_dir: str
    #: this round's inner steps: the setting, or under tau auto the round's choice
    tau: int
    #: where this round's checkpoint is being assembled, when the round ends with one
    checkpoint_dir: str | None = None
    #: an evaluation also counts (label, prediction) pairs (`sparknet evaluate`)
    confusion: bool = False
    #: the inner steps the run took before this round (the global step its first step is at)
    step: int = 0


@dataclass
class WorkerReport:
    partition: int
    loss: float
    samples: int
    #: the weights, the inner optimizer and the data's first batch: the round's start-up
    load_s: float
    #: the tau steps alone
    compute_s: float
    inner_state_miss: bool = False
    #: samples that could not be read or decoded (a corrupt JPEG, a truncated tar member)
    skipped: int = 0
    #: what went non-finite, e.g. "loss nan at step 3"; the round's update is then discarded
    diverged: str | None = None
    #: fp16 steps the GradScaler skipped (their scaled gradients overflowed): nothing learnt
    skipped_steps: int = 0


@dataclass
class Contribution:
    """A sum of worker updates over a contiguous range of partitions; `combine` is ordered."""

    first_partition: int
    #: None once any worker hit a non-finite loss, or where the weights are averaged in place
    #: (`LiveInner.average_in_place`)
    delta_sum: np.ndarray | None
    workers: int
    integers: dict[str, np.ndarray] | None  # from the lowest partition (worker 0 overall)
    reports: list[WorkerReport] = field(default_factory=list)

    @staticmethod
    def combine(a: Contribution, b: Contribution) -> Contribution:
        """Sum in partition order, so float rounding (so the weights) never depends on timing."""
        if b.first_partition < a.first_partition:
            a, b = b, a
        if a.delta_sum is None or b.delta_sum is None:
            total = None
        else:
            total = a.delta_sum
            total += b.delta_sum  # in place: a is a private copy that nobody else reads
        return Contribution(
            a.first_partition, total, a.workers + b.workers, a.integers, a.reports + b.reports
        )


@dataclass
class EvalResult:
    loss_sum: float = 0.0
    correct: int = 0
    correct5: int = 0  # the label is among the 5 highest logits
    count: int = 0
    skipped: int = 0
    #: [label, top-1 prediction] counts, where the task asked for them (`RoundTask.confusion`)
    confusion: np.ndarray | None = None

    @staticmethod
    def combine(a: EvalResult, b: EvalResult) -> EvalResult:
        pairs = b.confusion if a.confusion is None else a.confusion
        if a.confusion is not None and b.confusion is not None:
            pairs = a.confusion + b.confusion
        return EvalResult(
            a.loss_sum + b.loss_sum,
            a.correct + b.correct,
            a.correct5 + b.correct5,
            a.count + b.count,
            a.skipped + b.skipped,
            pairs,
        )


# ---- executor-local state -------------------------------------------------------------------

#: the model of the architecture this Python worker trained last: a reused worker serving runs of
#: several architectures keeps only one on its device
_MODELS: dict[tuple, nn.Module] = {}


def _model_for(task: RoundTask, on: torch.device) -> nn.Module:
    """One model object per Python worker process, architecture and device; weights are loaded
    per task. Conv nets on a GPU are kept channels-last. Another architecture's model is dropped
    first, and on CUDA its cached memory is handed back."""
    key = (task.cfg.model, task.num_classes, task.input_shape, str(on))
    if key not in _MODELS:
        _drop_models()
        model = build_model(task.cfg.model, task.input_shape, task.num_classes).to(on)
        if device.uses_channels_last(on, model):
            model = model.to(memory_format=torch.channels_last)
        _MODELS[key] = model
    return _MODELS[key]


def _drop_models() -> None:
    """Forget every kept model; empty the CUDA cache when one of them lived on a GPU."""
    on_cuda = any(key[-1].startswith("cuda") for key in _MODELS)
    _MODELS.clear()
    if on_cuda:
        torch.cuda.empty_cache()


def _load_weights(model: nn.Module, task: RoundTask, theta: np.ndarray, on: torch.device) -> None:
    """The global weights into `model`: one host->device copy of the flat buffer."""
    model.load_state_dict(task.layout.unflatten(theta, task.integers, device=on))


def _bound_weights(
    model: nn.Module, task: RoundTask, theta: np.ndarray, weights: torch.Tensor | None
) -> torch.Tensor | None:
    """The flat buffer `model` is bound to (bound now, the stage's first round), holding
    `theta` and the task's integer buffers; None where the model cannot be bound. From the
    second round on `theta` is that buffer itself, averaged in place: nothing is copied."""
    if weights is None:
        weights = task.layout.bind(model)
        if weights is None:
            return None
    else:  # an evaluation's forward() may have reassigned a buffer: the buffer holds theta
        task.layout.bind(model, weights, take=False)
    if theta.ctypes.data != weights.data_ptr():
        weights.copy_(torch.from_numpy(theta))
    state = model.state_dict()
    for e in task.layout.entries:
        if e.offset < 0:
            state[e.name].copy_(torch.from_numpy(np.asarray(task.integers[e.name])).view(e.shape))
    return weights


class InnerStateStore:
    """Each worker's inner optimizer state between rounds, on the executor's local disk.

    Keyed by (run, partition, round): a retried task of round r reads round r-1's state, which the
    failed attempt never overwrote. Files live under the executor's Spark work dir, which Spark
    removes with the executor; only the two newest rounds per partition are kept.
    """

    def __init__(self, root: str | os.PathLike[str], run_id: str) -> None:
        self.dir = Path(root) / "sparknet-inner" / run_id

    def _path(self, partition: int, rnd: int) -> Path:
        return self.dir / f"p{partition:05d}-r{rnd:06d}.pt"

    def load(self, partition: int, rnd: int) -> dict | None:
        path = self._path(partition, rnd)
        return torch.load(path, weights_only=True, map_location="cpu") if path.is_file() else None

    def save(self, partition: int, rnd: int, state: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        save_atomically(state, self._path(partition, rnd))
        self._path(partition, rnd - 2).unlink(missing_ok=True)


def save_atomically(obj: object, path: Path) -> None:
    """torch.save to a temp name, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def make_inner_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def load_inner_state(optimizer: torch.optim.Optimizer, state: dict) -> bool:
    """Load a saved inner state's per-parameter part (momentum buffers, Adam moments) but keep
    `optimizer`'s own hyperparameters: a resume with `--allow-change --lr X` trains at X from its
    first round (a plain `load_state_dict` would bring the stored lr back). A state written by
    another optimizer (sgd -> adamw) cannot be used: nothing is loaded and False is returned."""
    saved = state.get("param_groups") or []
    groups = optimizer.param_groups
    if len(saved) != len(groups) or any(
        set(s) != set(g) for s, g in zip(saved, groups, strict=True)
    ):
        return False
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    optimizer.load_state_dict(state)
    for group, own in zip(optimizer.param_groups, hyper, strict=True):
        group.update(own)
    return True


def _to_host(obj):
    """`obj` with every tensor in it on the CPU: inner states are stored device-free, so any
    executor (or a CPU-only resume) can read them."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def pack_inner_state(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> dict:
    """What a worker keeps between rounds: its optimizer state and, for fp16, its loss scale
    (a fresh scaler would start at 2**16 again and skip steps every round to find it)."""
    return {
        "optimizer": _to_host(optimizer.state_dict()),
        "scaler": scaler.state_dict() if scaler is not None else {},
    }


def unpack_inner_state(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, state: dict
) -> bool:
    """Load `pack_inner_state`'s dict, or a plain optimizer state_dict (checkpoints written before
    the loss scale was kept). False when the optimizer state cannot be used (a miss). A state
    without a loss scale (older, or written at another precision) leaves the scaler fresh."""
    packed = "optimizer" in state
    if not load_inner_state(optimizer, state["optimizer"] if packed else state):
        return False
    scale = state.get("scaler") if packed else None
    if scaler is not None and scale:
        scaler.load_state_dict(scale)
    return True


def _inner_to_keep(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> dict | None:
    """What this worker keeps for its next round (locally and in a checkpoint): the inner state
    under `keep`; under `reset` still the fp16 loss scale. It is not optimizer state, and a
    scaler made fresh at 2**16 every round could skip every step of a round and learn nothing."""
    if cfg.inner_state == "keep":
        return pack_inner_state(optimizer, scaler)
    if scaler is not None:
        return {"scaler": scaler.state_dict()}
    return None


def task_seed(seed: int, partition: int, rnd: int) -> int:
    """The torch seed of one task (dropout, augmentation): a pure function, like the data order."""
    return derived_seed(seed, partition, rnd)


class InjectedFailure(RuntimeError):
    """Raised by the `fail_once` fault drill."""


def _restore_inner_state(task: RoundTask, store: InnerStateStore, partition: int) -> dict | None:
    """This worker's optimizer state after the previous round, or None (a miss)."""
    state = store.load(partition, task.round - 1)
    if state is None:  # a new executor, or a resumed run: try the checkpoint of this round
        state = checkpoint.read_inner(
            task.run_dir, task.round, partition, endpoint_url=task.cfg.endpoint_url
        )
    return state


def _diverged(partition: int, what: str, load_s: float, miss: bool) -> Contribution:
    report = WorkerReport(partition, float("nan"), 0, load_s, 0.0, miss, diverged=what)
    return Contribution(partition, None, 1, None, [report])


def _first_nonfinite(losses: list[torch.Tensor], steps: list[int]) -> str | None:
    """'loss nan at step 3' for the first non-finite loss, else None. Checked once after the
    steps, not per step: on a GPU a per-step check would make the host wait for every step."""
    if not losses:
        return None
    stacked = torch.stack(losses)
    bad = (~torch.isfinite(stacked)).nonzero()
    if len(bad) == 0:
        return None
    i = int(bad[0, 0])
    return f"loss {float(stacked[i])} at step {steps[i]}"


@dataclass
class _Steps:
    """What a worker's tau steps did."""

    losses: list[torch.Tensor] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the 1-based step number of each loss
    samples: int = 0
    skipped: int = 0  # unreadable samples
    skipped_steps: int = 0  # steps the fp16 GradScaler skipped


def _scaled_step(
    loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> bool:
    """One fp16 step through the scaler; False when it was skipped (overflowed gradients).
    The scale drops exactly on a skipped step. `scaler.step` already waits for the device to
    check for infs, so reading the scale twice costs no extra pipeline stall."""
    scaler.scale(loss).backward()
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= before


def _started(batches: Iterator) -> Iterator:
    """`batches` with its first batch already read: what a round's data costs before its first
    step (a shard stream opened, loader processes started, a partition's rows turned into
    arrays) is a round's fixed cost, not a step's. It goes into the load seconds, so that the
    compute seconds are tau steps, which tau auto divides by tau (`tau_choice`): counted as
    compute, it made a step look cheaper the larger tau was, and tau grew on its own. The
    first batch's own read goes with it, one step's read in tau: C a little low where batches
    are read in turn, right where a loader prefetches them."""
    batches = iter(batches)
    first = next(batches, None)
    return batches if first is None else itertools.chain((first,), batches)


def _inner_steps(
    task: RoundTask,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    batches,
    partition: int,
    attempt: int,
    on: torch.device,
) -> _Steps:
    """tau steps, each at the lr the schedule gives its global step."""
    cfg = task.cfg
    channels_last = device.uses_channels_last(on, model)
    done = _Steps()
    losses, steps = done.losses, done.steps
    lrs = schedule.round_lrs(cfg, task.source.train_size, task.step, task.round, task.tau)
    for step, batch in enumerate(batches):
        done.skipped += batch.skipped
        if len(batch.y) == 0:
            continue  # every sample of this step was unreadable: nothing to learn from
        x = device.to_device(batch.x, on, channels_last)
        y = device.to_device(batch.y, on)
        optimizer.zero_grad(set_to_none=True)
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        with device.autocast(on, cfg.precision):
            loss = F.cross_entropy(model(x), y, label_smoothing=cfg.label_smoothing)
        if scaler is None:
            loss.backward()
            optimizer.step()
        elif not _scaled_step(loss, optimizer, scaler):
            done.skipped_steps += 1
        losses.append(loss.detach())
        steps.append(step + 1)
        done.samples += len(batch.y)
        progress.step()
        if cfg.fail_once_at == (task.round, partition) and attempt == 0:
            raise InjectedFailure(
                f"fail_once drill: partition {partition}, round {task.round}, attempt 0"
            )
    return done


@dataclass
class LiveInner:
    """A worker's inner optimizer and loss scaler held in memory from one round to the next:
    the allreduce transport's tasks live for the whole stage, so nothing is written to the
    executor's disk between rounds and nothing can be missed. Empty before the stage's first
    round, which restores from the checkpoint it starts at."""

    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None
    #: the update's buffer, written again every round: a fresh 100 MB array costs its page
    #: faults each time (the transport is done with the previous round's by then)
    delta: np.ndarray | None = None
    #: plain averaging: the ranks average the weights themselves rather than their updates, in
    #: the flat buffer the model is bound to (`StateLayout.bind`), which `weights` then holds;
    #: it stays None where the model cannot be bound (on a GPU), and the update travels instead
    average_in_place: bool = False
    weights: torch.Tensor | None = None


def train_partition(
    task: RoundTask,
    theta: np.ndarray,
    partition: int,
    *,
    attempt: int = 0,
    threads: int = 1,
    local_dir: str | os.PathLike[str] = ".",
    rows: list | None = None,
    live: LiveInner | None = None,
) -> Contribution:
    """Run tau inner steps of `partition` from `theta` and return its pseudo-gradient. With
    `live`, the inner state comes from and goes back to it instead of the executor's disk."""
    cfg = task.cfg
    torch.set_num_threads(threads)
    on = device.task_device(cfg.device)
    device.check_precision(on, cfg.precision)
    with device.kernel_settings(on, cfg.deterministic):
        return _train(task, theta, partition, attempt, threads, local_dir, rows, on, live)


def _inner_for_round(
    task: RoundTask,
    model: nn.Module,
    partition: int,
    store: InnerStateStore,
    on: torch.device,
    live: LiveInner | None,
) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler | None, bool]:
    """(optimizer, loss scaler, missed) for this round: the ones held in `live`, else fresh ones
    loaded with the state the previous round left (this executor's disk, else the checkpoint)."""
    cfg = task.cfg
    if live is not None and live.optimizer is not None:
        optimizer = live.optimizer
        if cfg.inner_state == "reset":  # the loss scale is kept; the optimizer starts fresh
            optimizer = make_inner_optimizer(cfg, model.parameters())
        return optimizer, live.scaler, False
    optimizer = make_inner_optimizer(cfg, model.parameters())
    scaler = device.make_scaler(on, cfg.precision)
    miss = False
    if task.round > 0 and (cfg.inner_state == "keep" or scaler is not None):
        state = _restore_inner_state(task, store, partition)
        if cfg.inner_state == "keep":
            miss = state is None or not unpack_inner_state(optimizer, scaler, state)
        elif state is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])  # reset: only the loss scale is kept
    return optimizer, scaler, miss


def _train(
    task: RoundTask,
    theta: np.ndarray,
    partition: int,
    attempt: int,
    threads: int,
    local_dir: str | os.PathLike[str],
    rows: list | None,
    on: torch.device,
    live: LiveInner | None = None,
) -> Contribution:
    cfg = task.cfg
    progress.begin_round(task.round + 1)
    t0 = time.perf_counter()
    model = _model_for(task, on)
    if live is not None and live.average_in_place:
        live.weights = _bound_weights(model, task, theta, live.weights)
    if live is None or live.weights is None:
        _load_weights(model, task, theta, on)  # in place: a held optimizer's parameters stay
    model.train()
    store = InnerStateStore(local_dir, task.run_id)
    optimizer, scaler, miss = _inner_for_round(task, model, partition, store, on, live)

    torch.manual_seed(task_seed(cfg.seed, partition, task.round))
    inp = TaskInput(partition, cfg.workers, cfg.seed, task.run_id, threads, rows)
    batches = _started(task.source.train_batches(inp, task.step, task.tau, cfg.batch_size))
    t1 = time.perf_counter()
    done = _inner_steps(task, model, optimizer, scaler, batches, partition, attempt, on)
    bad = _first_nonfinite(done.losses, done.steps)  # waits for the device's queued steps
    t2 = time.perf_counter()
    if bad is not None:
        return _diverged(partition, bad, t1 - t0, miss)
    if done.samples == 0:
        raise SparknetError(
            f"worker {partition} could not read a single sample in round {task.round + 1} "
            f"({done.skipped} skipped as corrupt): check the data with `sparknet data verify`"
        )

    state = model.state_dict()
    if live is not None and live.weights is not None:
        delta = None  # the weights themselves are averaged
        task.layout.bind(model, live.weights)  # a buffer forward() reassigned comes back in
        low, high = torch.aminmax(live.weights)  # one pass, no array of flags; NaN propagates
        finite = bool(low.isfinite() and high.isfinite())
    else:
        if live is not None and live.delta is None:
            live.delta = np.empty(task.layout.size, dtype=np.float32)
        delta = task.layout.pseudo_gradient(theta, state, out=live.delta if live else None)
        finite = bool(np.isfinite(delta).all())
    if not finite:
        return _diverged(partition, f"weights non-finite after step {task.tau}", t1 - t0, miss)
    if live is not None:
        live.optimizer, live.scaler = optimizer, scaler
    if live is None or task.checkpoint_dir is not None:
        inner = _inner_to_keep(cfg, optimizer, scaler)
        if inner is not None:
            if live is None:
                store.save(partition, task.round, inner)
            if task.checkpoint_dir is not None:
                checkpoint.write_inner(
                    task.checkpoint_dir, partition, inner, endpoint_url=task.cfg.endpoint_url
                )
    loss_mean = float(torch.stack(done.losses).mean())
    report = WorkerReport(
        partition, loss_mean, done.samples, t1 - t0, t2 - t1, miss, done.skipped,
        skipped_steps=done.skipped_steps,
    )  # fmt: skip
    integers = task.layout.integers(state) if partition == 0 else None
    return Contribution(partition, delta, 1, integers, [report])


@torch.no_grad()
def evaluate_partition(
    task: RoundTask,
    theta: np.ndarray,
    partition: int,
    *,
    threads: int = 1,
    rows: list | None = None,
) -> EvalResult:
    """Loss, top-1 and top-5 of the global weights on this partition's share of the test set,
    computed on the task's device at the run's precision."""
    cfg = task.cfg
    torch.set_num_threads(threads)
    on = device.task_device(cfg.device)
    device.check_precision(on, cfg.precision)
    with device.kernel_settings(on, cfg.deterministic):
        model = _model_for(task, on)
        channels_last = device.uses_channels_last(on, model)
        _load_weights(model, task, theta, on)
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=on)
        correct = torch.zeros((), dtype=torch.int64, device=on)
        correct5 = torch.zeros((), dtype=torch.int64, device=on)
        count = skipped = 0
        classes = task.num_classes
        pairs = torch.zeros(
            classes * classes if task.confusion else 0, dtype=torch.int64, device=on
        )
        inp = TaskInput(partition, cfg.workers, cfg.seed, task.run_id, threads, rows)
        for batch in task.source.eval_batches(inp):
            skipped += batch.skipped
            if len(batch.y) == 0:
                continue
            x = device.to_device(batch.x, on, channels_last)
            y = device.to_device(batch.y, on)
            with device.autocast(on, cfg.precision):
                logits = model(x)
            top = logits.topk(min(5, logits.shape[1]), dim=1).indices
            loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").double()
            correct += (top[:, 0] == y).sum()
            correct5 += (top == y[:, None]).any(1).sum()
            count += len(batch.y)
            if task.confusion:
                pairs += torch.bincount(y * classes + top[:, 0], minlength=classes * classes)
            progress.step()
    confusion = pairs.view(classes, classes).cpu().numpy() if task.confusion else None
    return EvalResult(float(loss_sum), int(correct), int(correct5), count, skipped, confusion)
