"""Models, datasets and reference loops the tests use; importable by Spark's Python workers."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from sparknet.config import TrainConfig, load_train_config
from sparknet.data.sources import batch_indices, digits
from sparknet.errors import PermanentTaskError, SparknetError
from sparknet.models import build_model

IDENTICAL_LABEL = 3


def cli_config(args: Sequence[str], **overrides) -> TrainConfig:
    """The config `sparknet train` makes of `args` (``--flag value`` pairs, no settings file
    or environment), `overrides` on top: a run in the test process the same as a CLI run."""
    pairs = zip(args[::2], args[1::2], strict=True)
    flags = {flag.removeprefix("--").replace("-", "_"): value for flag, value in pairs}
    return load_train_config(flags={**flags, **overrides}, environ={})


def identical_samples() -> tuple[TensorDataset, TensorDataset]:
    """64 copies of one digit image: every worker computes exactly the same gradients."""
    train, _ = digits()
    x, y = train.tensors[0][:1], torch.tensor([IDENTICAL_LABEL])
    return (
        TensorDataset(x.repeat(64, 1, 1, 1), y.repeat(64)),
        TensorDataset(x.repeat(8, 1, 1, 1), y.repeat(8)),
    )


def initial_model(cfg: TrainConfig, num_classes: int = 10) -> torch.nn.Module:
    """The model exactly as the driver initialises it."""
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model, (1, 8, 8), num_classes)


def load_run_model(run_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_file(Path(run_dir) / "model.safetensors")


def weights_hash(run_dir: str | Path) -> str:
    """A run's final weights as one hash of every tensor (name, dtype, shape and bytes): equal
    for the same bits, whatever order or metadata the file was written with."""
    digest = hashlib.sha256()
    for name, tensor in sorted(load_run_model(run_dir).items()):
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def sgd_step(model, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def worker_batch(cfg: TrainConfig, dataset: TensorDataset, partition: int, global_step: int):
    idx = torch.from_numpy(
        batch_indices(
            seed=cfg.seed,
            n_samples=len(dataset),
            workers=cfg.workers,
            partition=partition,
            global_step=global_step,
            batch_size=cfg.batch_size,
        )
    )
    return dataset.tensors[0][idx], dataset.tensors[1][idx]


def double_batch_reference(cfg: TrainConfig, steps: int, lr: float) -> dict[str, torch.Tensor]:
    """Plain SGD (no momentum) for `steps` steps, each on workers 0 and 1's batches together:
    what K=2 with gradients averaged every step (tau=1, or DDP) must equal."""
    train_set, _ = digits()
    model = initial_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x0, y0 = worker_batch(cfg, train_set, 0, step)
        x1, y1 = worker_batch(cfg, train_set, 1, step)
        sgd_step(model, opt, torch.cat([x0, x1]), torch.cat([y0, y1]))
    return model.state_dict()


def assert_state_close(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if want[k].is_floating_point():
            torch.testing.assert_close(got[k], want[k].detach(), rtol=rtol, atol=atol, msg=k)
        else:
            assert torch.equal(got[k], want[k]), k


def assert_state_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs"


def mean_state(states: list[dict]) -> dict:
    out = {}
    for k, v in states[0].items():
        out[k] = torch.stack([s[k] for s in states]).mean(0) if v.is_floating_point() else v
    return out


def random_images(n: int = 200, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


POISON = {"seed": 0, "workers": 2, "batch_size": 16, "tau": 2, "round": 3, "partition": 1}


def poisoned_index() -> int:
    """A training sample that worker 1 first meets at the first step of round 3 (1-based)."""
    p = POISON
    train, _ = digits()
    idx = batch_indices(
        seed=p["seed"],
        n_samples=len(train),
        workers=p["workers"],
        partition=p["partition"],
        global_step=(p["round"] - 1) * p["tau"],
        batch_size=p["batch_size"],
    )
    return int(idx[0])


def poisoned_digits() -> tuple[TensorDataset, TensorDataset]:
    """The digits with one NaN image: training must stop when a worker first meets it."""
    train, test = digits()
    x = train.tensors[0].clone()
    x[poisoned_index()] = float("nan")
    return TensorDataset(x, train.tensors[1]), test


class _UnreadableAfterFirst(torch.utils.data.Dataset):
    """A dataset whose every sample but the first (the driver's dry run) cannot heal."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i != 0:
            raise PermanentTaskError(f"sample {i} differs from the manifest")
        return self.inner[i]


def unhealable_digits() -> tuple[torch.utils.data.Dataset, TensorDataset]:
    """The digits, but a worker's first batch raises PermanentTaskError (as a changed shard)."""
    train, test = digits()
    return _UnreadableAfterFirst(train), test


def failed_tasks(sc, group: str) -> int:
    """Task attempts that failed in the jobs of Spark job group `group`."""
    tracker = sc.statusTracker()
    return sum(
        tracker.getStageInfo(stage).numFailedTasks
        for job in tracker.getJobIdsForGroup(group)
        for stage in tracker.getJobInfo(job).stageIds
        if tracker.getStageInfo(stage) is not None
    )


class _RefusedAfterFirst(_UnreadableAfterFirst):
    """As `_UnreadableAfterFirst`, with sparknet's own error (what S3 refusing, a missing
    credential or a bad setting raise inside a task)."""

    def __getitem__(self, i: int):
        if i != 0:
            raise SparknetError(f"sample {i}: access denied")
        return self.inner[i]


def refused_digits() -> tuple[torch.utils.data.Dataset, TensorDataset]:
    """The digits, but a worker's first batch raises SparknetError."""
    train, test = digits()
    return _RefusedAfterFirst(train), test


class _EmaNet(torch.nn.Module):
    """A linear classifier on inputs centred by their running mean, a float buffer that
    forward() reassigns (a new tensor each step) rather than updates in place."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, num_classes)
        self.register_buffer("center", torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if self.training:
            self.center = 0.9 * self.center + 0.1 * x.mean(0).detach()
        return self.lin(x - self.center)


def ema_net(num_classes: int = 10) -> torch.nn.Module:
    return _EmaNet(num_classes)
