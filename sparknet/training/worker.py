"""What one Spark task does in a round: tau local steps from the global weights, then its update.

Pure PyTorch: nothing here knows about Spark, so tests can run a worker in-process. The transport
calls `train_partition` / `evaluate_partition` inside tasks and reduces what they return.
"""

from __future__ import annotations

import os
import time
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
from sparknet.training import checkpoint
from sparknet.training.outer import pseudo_gradient
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
    #: where this round's checkpoint is being assembled, when the round ends with one
    checkpoint_dir: str | None = None


@dataclass
class WorkerReport:
    partition: int
    loss: float
    samples: int
    load_s: float
    compute_s: float
    inner_state_miss: bool = False
    #: samples that could not be read or decoded (a corrupt JPEG, a truncated tar member)
    skipped: int = 0
    #: what went non-finite, e.g. "loss nan at step 3"; the round's update is then discarded
    diverged: str | None = None


@dataclass
class Contribution:
    """A sum of worker updates over a contiguous range of partitions; `combine` is ordered."""

    first_partition: int
    delta_sum: np.ndarray | None  # None once any worker hit a non-finite loss
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

    @staticmethod
    def combine(a: EvalResult, b: EvalResult) -> EvalResult:
        return EvalResult(
            a.loss_sum + b.loss_sum,
            a.correct + b.correct,
            a.correct5 + b.correct5,
            a.count + b.count,
            a.skipped + b.skipped,
        )


# ---- executor-local state -------------------------------------------------------------------

_MODELS: dict[tuple, nn.Module] = {}


def _model_for(task: RoundTask) -> nn.Module:
    """One model object per Python worker process and architecture; weights are loaded per task."""
    key = (task.cfg.model, task.num_classes, task.input_shape)
    if key not in _MODELS:
        _MODELS[key] = build_model(task.cfg.model, task.input_shape, task.num_classes)
    return _MODELS[key]


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
        return torch.load(path, weights_only=True) if path.is_file() else None

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


def task_seed(seed: int, partition: int, rnd: int) -> int:
    """The torch seed of one task (dropout, augmentation): a pure function, like the data order."""
    return derived_seed(seed, partition, rnd)


class InjectedFailure(RuntimeError):
    """Raised by the `fail_once` fault drill."""


def _restore_inner_state(task: RoundTask, store: InnerStateStore, partition: int) -> dict | None:
    """This worker's optimizer state after the previous round, or None (a miss)."""
    state = store.load(partition, task.round - 1)
    if state is None:  # a new executor, or a resumed run: try the checkpoint of this round
        state = checkpoint.read_inner(task.run_dir, task.round, partition)
    return state


def _diverged(partition: int, what: str, load_s: float, miss: bool) -> Contribution:
    report = WorkerReport(partition, float("nan"), 0, load_s, 0.0, miss, diverged=what)
    return Contribution(partition, None, 1, None, [report])


def train_partition(
    task: RoundTask,
    theta: np.ndarray,
    partition: int,
    *,
    attempt: int = 0,
    threads: int = 1,
    local_dir: str | os.PathLike[str] = ".",
    rows: list | None = None,
) -> Contribution:
    """Run tau inner steps of `partition` from `theta` and return its pseudo-gradient."""
    cfg = task.cfg
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = _model_for(task)
    model.load_state_dict(task.layout.unflatten(theta, task.integers))
    model.train()
    optimizer = make_inner_optimizer(cfg, model.parameters())
    store = InnerStateStore(local_dir, task.run_id)
    miss = False
    if cfg.inner_state == "keep" and task.round > 0:
        state = _restore_inner_state(task, store, partition)
        miss = state is None or not load_inner_state(optimizer, state)
    t1 = time.perf_counter()

    torch.manual_seed(task_seed(cfg.seed, partition, task.round))
    inp = TaskInput(partition, cfg.workers, cfg.seed, task.run_id, threads, rows)
    batches = task.source.train_batches(inp, task.round, cfg.tau, cfg.batch_size)
    losses: list[torch.Tensor] = []
    samples = skipped = 0
    for step, batch in enumerate(batches):
        skipped += batch.skipped
        if len(batch.y) == 0:
            continue  # every sample of this step was unreadable: nothing to learn from
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch.x), batch.y)
        if not torch.isfinite(loss):
            return _diverged(partition, f"loss {float(loss)} at step {step + 1}", t1 - t0, miss)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        samples += len(batch.y)
        if cfg.fail_once_at == (task.round, partition) and attempt == 0:
            raise InjectedFailure(
                f"fail_once drill: partition {partition}, round {task.round}, attempt 0"
            )
    t2 = time.perf_counter()
    if samples == 0:
        raise SparknetError(
            f"worker {partition} could not read a single sample in round {task.round + 1} "
            f"({skipped} skipped as corrupt): check the data with `sparknet data verify`"
        )

    state = model.state_dict()
    delta = pseudo_gradient(theta, task.layout.flatten(state))
    if not np.isfinite(delta).all():
        return _diverged(partition, f"weights non-finite after step {cfg.tau}", t1 - t0, miss)
    if cfg.inner_state == "keep":
        opt_state = optimizer.state_dict()
        store.save(partition, task.round, opt_state)
        if task.checkpoint_dir is not None:
            checkpoint.write_inner(task.checkpoint_dir, partition, opt_state)
    loss_mean = float(torch.stack(losses).mean()) if losses else float("nan")
    report = WorkerReport(partition, loss_mean, samples, t1 - t0, t2 - t1, miss, skipped)
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
    """Loss, top-1 and top-5 of the global weights on this partition's share of the test set."""
    cfg = task.cfg
    torch.set_num_threads(threads)
    model = _model_for(task)
    model.load_state_dict(task.layout.unflatten(theta, task.integers))
    model.eval()
    result = EvalResult()
    inp = TaskInput(partition, cfg.workers, cfg.seed, task.run_id, threads, rows)
    for batch in task.source.eval_batches(inp):
        result.skipped += batch.skipped
        if len(batch.y) == 0:
            continue
        logits = model(batch.x)
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        result.loss_sum += float(F.cross_entropy(logits, batch.y, reduction="sum"))
        result.correct += int((top[:, 0] == batch.y).sum())
        result.correct5 += int((top == batch.y[:, None]).any(1).sum())
        result.count += len(batch.y)
    return result
