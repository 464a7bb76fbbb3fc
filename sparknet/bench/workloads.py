"""Synthetic data for `sparknet bench throughput` and `precision`.

Importable by Spark's Python workers by reference.

A throughput figure needs real compute per step and no download: images of CIFAR's shape, drawn
from a fixed seed so every worker process (and the plain loop on the driver) builds the same
bits. Each class is a random prototype plus noise, so the loss goes down and the run looks like
training rather than arithmetic on noise. Keep this module free of Spark and of side effects at
import time: every Spark Python worker imports it (through the installed `sparknet` package, so
from any working directory).
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

INPUT_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
TRAIN_SAMPLES = 4096
TEST_SAMPLES = 512
SEED = 1234

#: what `TrainConfig.data` names to reach `synthetic_images` from a Spark worker
SYNTHETIC_IMAGES = "sparknet.bench.workloads:synthetic_images"


def _draw(gen: torch.Generator, prototypes: torch.Tensor, n: int) -> TensorDataset:
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=gen, dtype=torch.int64)
    noise = torch.randn((n, *INPUT_SHAPE), generator=gen, dtype=torch.float32)
    return TensorDataset(noise + 0.5 * prototypes[labels], labels)


def synthetic_images() -> tuple[TensorDataset, TensorDataset]:
    """(train, test): 3x32x32 float32 images, int64 labels in [0, 10), the same on every call."""
    gen = torch.Generator().manual_seed(SEED)
    prototypes = torch.randn((NUM_CLASSES, *INPUT_SHAPE), generator=gen)
    return _draw(gen, prototypes, TRAIN_SAMPLES), _draw(gen, prototypes, TEST_SAMPLES)
