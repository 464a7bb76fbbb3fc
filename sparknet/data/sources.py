"""What a partition trains on, and the order it sees it in.

A data source is a pair of map-style torch Datasets of `(tensor, int label)`. Every worker loads
the source itself (it is cached per Python process) and takes its own shard by index, so nothing but
weights crosses the network. The order of samples is a pure function of
(seed, partition, round, step): a retried Spark task sees exactly the batches of the failed one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from sparknet.errors import SparknetError
from sparknet.imports import is_reference, load_callable

BUILTIN_DATA = ("digits",)


@dataclass(frozen=True)
class DataSplit:
    train: Dataset
    test: Dataset
    num_classes: int | None
    input_shape: tuple[int, ...]


def digits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled 8x8 digits (1797 images, no download), fixed 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return (
        TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr)),
        TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te)),
    )


def _num_classes(ds: Dataset) -> int | None:
    """Infer the class count where the dataset says it; otherwise the user passes --num-classes."""
    if hasattr(ds, "classes"):
        return len(ds.classes)
    if isinstance(ds, TensorDataset):
        return int(ds.tensors[1].max()) + 1
    targets = getattr(ds, "targets", None)
    if targets is not None:
        return int(torch.as_tensor(targets).max()) + 1
    return None


@functools.lru_cache(maxsize=4)
def load_data(spec: str) -> DataSplit:
    """The train/test datasets named by `spec`; cached so each Spark Python worker loads it once."""
    if spec == "digits":
        train, test = digits()
    elif is_reference(spec):
        factory = load_callable(spec, "data")
        try:
            pair = factory()
        except Exception as exc:
            raise SparknetError(
                f"data factory {spec!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise SparknetError(
                f"data factory {spec!r} must return (train_dataset, test_dataset), "
                f"got {type(pair).__name__}"
            )
        train, test = pair
    else:
        raise SparknetError(
            f"unknown dataset {spec!r}: use one of {', '.join(BUILTIN_DATA)} or "
            "package.module:factory returning (train_dataset, test_dataset)"
        )
    for name, ds in (("train", train), ("test", test)):
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
            raise SparknetError(f"data {spec!r}: the {name} set is not a map-style torch Dataset")
        if len(ds) == 0:
            raise SparknetError(f"data {spec!r}: the {name} set is empty")
    x, y = train[0]
    if not isinstance(x, torch.Tensor):
        raise SparknetError(f"data {spec!r}: samples must be (tensor, int label), got {type(x)}")
    if isinstance(y, torch.Tensor) and y.numel() != 1:
        raise SparknetError(f"data {spec!r}: labels must be single class indices")
    return DataSplit(train, test, _num_classes(train), tuple(x.shape))


def shard(n_samples: int, workers: int, partition: int, seed: int) -> np.ndarray:
    """Indices of the training samples of `partition`: disjoint, sizes differ by at most 1."""
    perm = np.random.default_rng([seed, 0x5EED]).permutation(n_samples)
    return np.array_split(perm, workers)[partition]


@functools.lru_cache(maxsize=8)
def _epoch_order(seed: int, partition: int, shard_size: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, partition, epoch]).permutation(shard_size)


def batch_positions(
    seed: int, partition: int, shard_size: int, global_step: int, batch_size: int
) -> np.ndarray:
    """Positions within the shard of batch number `global_step` (= round * tau + step).

    The partition reads an endless stream of epochs, each a fresh seeded permutation of its shard;
    batch g is stream[g*b : (g+1)*b]. A pure function: no state, no iterator to restore on resume.
    """
    stream = np.arange(global_step * batch_size, (global_step + 1) * batch_size)
    epochs, offsets = np.divmod(stream, shard_size)
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _epoch_order(seed, partition, shard_size, int(epoch))[offsets[sel]]
    return out


def batch_indices(
    *, seed: int, n_samples: int, workers: int, partition: int, global_step: int, batch_size: int
) -> np.ndarray:
    """Dataset indices of one worker's batch: `shard` composed with `batch_positions`."""
    part = shard(n_samples, workers, partition, seed)
    return part[batch_positions(seed, partition, len(part), global_step, batch_size)]


def make_batch(dataset: Dataset, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the samples at `indices` into (inputs, int64 labels)."""
    if isinstance(dataset, TensorDataset):
        idx = torch.from_numpy(np.asarray(indices))
        x, y = dataset.tensors[0][idx], dataset.tensors[1][idx]
    else:
        x, y = default_collate([dataset[int(i)] for i in indices])
    return x, torch.as_tensor(y, dtype=torch.int64)
