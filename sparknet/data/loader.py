"""Encoded images to training tensors inside a Spark task: a DataLoader with worker processes.

The task's main thread decides which samples make up each step (a pure function of seed,
partition, round and step); the loader's worker processes only decode and transform them. The
batch sampler hands over the samples themselves, encoded bytes and label, so workers need no
access to the data store, and the batches come back in step order whatever the worker timing.
Every sample carries its own seed for augmentation: the same sample at the same step gets the
same crop on any executor, with any number of loader workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

# `# lazy: PIL`: a tensor dataset's tasks import this module and never decode an image

#: (encoded bytes, label, augmentation seed), or None for a sample that could not be read
Item = tuple[bytes, int, int] | None


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    #: samples of this step that could not be read or decoded (counted, never fatal)
    skipped: int = 0


def derived_seed(*keys: int) -> int:
    """A torch seed that is a pure function of `keys`, e.g. (seed, partition, step, sample)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


class DecodeDataset(Dataset):
    """Maps an item handed over by the batch sampler to (tensor, label), or None if corrupt."""

    def __init__(self, decode: Callable[[bytes], torch.Tensor]) -> None:
        self.decode = decode

    def __len__(self) -> int:  # items arrive from the sampler; there is no index space
        return 0

    def __getitem__(self, item: Item):
        if item is None:
            return None
        data, label, seed = item
        # only the CPU generator the augmentation draws from: `torch.manual_seed` also queues
        # CUDA/XPU/MTIA seeding with a captured stack trace, ~0.4 ms per call
        torch.default_generator.manual_seed(seed)
        try:
            return self.decode(data), label
        except Exception:  # corrupt or truncated encoding: skipped and counted by the collate
            return None


def collate_skipping(samples: list) -> Batch:
    good = [s for s in samples if s is not None]
    skipped = len(samples) - len(good)
    if not good:
        return Batch(torch.empty(0), torch.empty(0, dtype=torch.int64), skipped)
    x = torch.stack([s[0] for s in good])
    y = torch.tensor([s[1] for s in good], dtype=torch.int64)
    return Batch(x, y, skipped)


#: the most decoding processes the default gives one task
MAX_DEFAULT_WORKERS = 8


def default_loader_workers(cores: int) -> int:
    """Decoding processes for a task with `cores` CPUs when `loader_workers` is not set.

    A worker process pays for itself only with a core of its own: the task's main thread trains
    (torch uses its cores) and feeds the workers. Measured on a 2-core machine with one core per
    task, 2 workers decoded 110 samples/s against 160 in the task's own thread; so none up to 2
    cores, and one per core beyond the first above that (GPU nodes, where decoding is the
    bottleneck), capped at MAX_DEFAULT_WORKERS.
    """
    return 0 if cores <= 2 else min(cores - 1, MAX_DEFAULT_WORKERS)


def decoded_batches(
    steps: Iterable[list[Item]],
    decode: Callable[[bytes], torch.Tensor],
    *,
    workers: int | None,
    cores: int = 1,
) -> Iterator[Batch]:
    """Decode each step's items with `decode` (e.g. `TrainDecoder`) in `workers` processes (0: in
    this thread; None: the default for a task of `cores` CPUs); batches in order, as normalized
    float32."""
    from sparknet.data.decode import normalize  # lazy: PIL

    if workers is None:
        workers = default_loader_workers(cores)

    loader = DataLoader(
        DecodeDataset(decode),
        batch_sampler=steps,
        collate_fn=collate_skipping,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
        multiprocessing_context="fork" if workers else None,
    )
    for batch in loader:  # uint8 across the worker queues; float once, for the whole batch
        if len(batch.y):
            batch.x = normalize(batch.x)
        yield batch
