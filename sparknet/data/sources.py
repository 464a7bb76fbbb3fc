"""What a partition trains on, and the order it sees it in.

A `Source` is small and picklable: it travels inside every task, and each worker reads its own
part of the data where it lies, so nothing but weights crosses between driver and workers.
- `TensorSource`: a built-in dataset or a user's `module:factory` of map-style torch Datasets,
  loaded once per Python worker process; partition k takes its own seeded slice by index.
- `ShardSource`: WebDataset shards with a manifest, on S3 or a local dir, streamed (`stream.py`)
  through an optional executor-local disk cache and decoded by a DataLoader (`loader.py`).
- `FrameSource`: a Spark DataFrame whose rows reach the task as Arrow batches (`frames.py`).
In every case the samples a step trains on are a pure function of (seed, partition, round, step):
a retried Spark task sees exactly the batches of the failed one.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from sparknet.data import loader
from sparknet.data.cache import ShardCache
from sparknet.data.integrity import check_present, open_verified
from sparknet.data.manifest import Manifest, ShardInfo
from sparknet.data.store import S3Store, Store, load_manifest, open_store
from sparknet.data.stream import (
    RawSample,
    epoch_shards,
    keep_cursor,
    prefetch,
    read_positions,
    read_shard,
    take_cursor,
)
from sparknet.errors import SettingError, SparknetError, no_such_directory
from sparknet.imports import is_reference, load_callable

# `# lazy: PIL`: only a shard dataset's tasks decode images; a tensor dataset's never do

BUILTIN_DATA = ("digits",)


@dataclass(frozen=True)
class DataSplit:
    train: Dataset
    test: Dataset
    num_classes: int | None
    input_shape: tuple[int, ...]


#: scikit-learn's fixed digits split, `train_test_split(test_size=0.2, random_state=0,
#: stratify=y)`, as row numbers in train and test order: importing scikit-learn costs ~1.5 s of
#: CPU in the driver and in every Python worker, more than a small run trains
#: (tests/data/test_sources.py checks that scikit-learn still splits this way)
DIGITS_SPLIT = Path(__file__).with_name("digits_split.npz")


def digits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled 8x8 digits (1797 images, no download), fixed 80/20 split: the file
    `load_digits` reads, read the way it reads it, without importing scikit-learn."""
    data = np.loadtxt(_sklearn_file("datasets/data/digits.csv.gz"), delimiter=",")
    x = (data[:, :-1] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = data[:, -1].astype(np.int64)
    with np.load(DIGITS_SPLIT) as split:
        train, test = split["train"].astype(np.int64), split["test"].astype(np.int64)
    return (
        TensorDataset(torch.from_numpy(x[train]), torch.from_numpy(y[train])),
        TensorDataset(torch.from_numpy(x[test]), torch.from_numpy(y[test])),
    )


def _sklearn_file(name: str) -> Path:
    """A data file of the installed scikit-learn, found without importing it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SparknetError("the digits dataset comes with scikit-learn: pip install scikit-learn")
    return Path(spec.submodule_search_locations[0]) / name


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


# ---- sources: what a task reads ------------------------------------------------------------

#: samples per evaluation batch
EVAL_BATCH = 256


@dataclass(frozen=True)
class TaskInput:
    """Where a task stands: which partition of how many, and what Spark handed it."""

    partition: int
    workers: int
    seed: int
    run_id: str
    threads: int = 1
    #: the partition's rows as Arrow record batches (DataFrame sources only)
    rows: list | None = None


class Source(ABC):
    """What a partition trains and evaluates on; shipped inside every task, so keep it small."""

    num_classes: int | None
    input_shape: tuple[int, ...]
    train_size: int

    @property
    def input_kind(self) -> str:
        """What an input is before the model takes it: `tensor` (a Dataset's sample, as it
        is), `features` (a numeric array) or `image` (encoded, decoded and transformed)."""
        return "tensor"

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def example(self) -> torch.Tensor:
        """One input, for the driver's dry run of the model."""

    @abstractmethod
    def train_batches(self, inp: TaskInput, first_step: int, tau: int, batch_size: int) -> Iterator:
        """The tau batches for `inp.partition` of the round whose first step is the run's
        `first_step`-th (its global step: under tau auto, or a tau changed on resume, rounds
        differ in length, and the data goes on where the last step left it), as
        `loader.Batch`es."""

    @abstractmethod
    def eval_batches(self, inp: TaskInput) -> Iterator:
        """This partition's share of the evaluation set, as `loader.Batch`es."""

    def check_workers(self, workers: int) -> None:
        if workers > self.train_size:
            raise SettingError(
                "{value} Spark tasks are more than the {size} training samples of {data}; run "
                "at most {size} ({@workers_setting})",
                setting="workers",
                value=workers,
                size=self.train_size,
                data=self.describe(),
            )


@dataclass(frozen=True)
class TensorSource(Source):
    """A built-in dataset or a `module:factory`: map-style Datasets every worker loads itself."""

    spec: str
    num_classes: int | None
    input_shape: tuple[int, ...]
    train_size: int

    @classmethod
    def load(cls, spec: str) -> TensorSource:
        split = load_data(spec)
        return cls(spec, split.num_classes, split.input_shape, len(split.train))

    def describe(self) -> str:
        return repr(self.spec)

    def example(self) -> torch.Tensor:
        return load_data(self.spec).train[0][0]

    def train_batches(self, inp: TaskInput, first_step: int, tau: int, batch_size: int) -> Iterator:
        train = load_data(self.spec).train
        part = shard(len(train), inp.workers, inp.partition, inp.seed)
        for step in range(tau):
            g = first_step + step
            positions = batch_positions(inp.seed, inp.partition, len(part), g, batch_size)
            yield loader.Batch(*make_batch(train, part[positions]))

    def eval_batches(self, inp: TaskInput) -> Iterator:
        test = load_data(self.spec).test
        indices = np.arange(inp.partition, len(test), inp.workers)
        for start in range(0, len(indices), EVAL_BATCH):
            yield loader.Batch(*make_batch(test, indices[start : start + EVAL_BATCH]))


@dataclass(frozen=True)
class ShardSource(Source):
    """WebDataset shards with a manifest, streamed from S3 (or read from a local dir)."""

    store: Store
    manifest: Manifest
    image_size: int
    #: None: chosen from the task's cores (`loader.default_loader_workers`)
    loader_workers: int | None
    cache_dir: str | None
    cache_bytes: int
    #: the split evaluations read (`sparknet evaluate --split` may name another)
    eval_split: str = "val"

    TRAIN = "train"
    EVAL = "val"

    @property
    def input_kind(self) -> str:
        return "image"

    @property
    def num_classes(self) -> int:  # type: ignore[override]
        return self.manifest.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return (3, self.image_size, self.image_size)

    @property
    def train_size(self) -> int:  # type: ignore[override]
        return self.manifest.samples(self.TRAIN)

    def describe(self) -> str:
        return self.store.uri

    def example(self) -> torch.Tensor:
        return torch.zeros(self.input_shape)

    def check_workers(self, workers: int) -> None:
        super().check_workers(workers)
        shards = self.manifest.shards(self.TRAIN)
        epoch_shards([s.samples for s in shards], seed=0, epoch=0, workers=workers, partition=0)

    def _open(self, info: ShardInfo):
        """The shard's bytes, checked against the manifest before any sample is read from them
        (`integrity.open_verified`); a remote shard goes through the executor's cache."""
        cache = None
        if self.cache_dir is not None and self.cache_bytes > 0:
            cache = ShardCache(Path(self.cache_dir).expanduser(), self.cache_bytes)
        return open_verified(self.store, info, cache)

    def samples(self, info: ShardInfo) -> Iterator[RawSample | None]:
        """One shard's samples in order, None for a bad one, its bytes checked against the
        manifest first (as every read of a shard is)."""
        with self._open(info) as stream:
            yield from read_shard(stream, info)

    def train_batches(self, inp: TaskInput, first_step: int, tau: int, batch_size: int) -> Iterator:
        from sparknet.data.decode import TrainDecoder  # lazy: PIL

        shards = self.manifest.shards(self.TRAIN)
        key = (inp.run_id, inp.partition)
        start = first_step * batch_size

        def open_items(position: int) -> Iterator:
            return read_positions(
                shards, self._open, seed=inp.seed, workers=inp.workers,
                partition=inp.partition, start=position,
            )  # fmt: skip

        cursor = take_cursor(key, start, open_items)

        def steps() -> Iterator[list]:
            for step in range(tau):
                g = first_step + step
                items = cursor.take(batch_size)
                yield [
                    None
                    if s is None
                    else (s.data, s.label, loader.derived_seed(inp.seed, inp.partition, g, i))
                    for i, s in enumerate(items)
                ]
            keep_cursor(key, cursor)  # the whole round was read: the next round continues here

        batches = loader.decoded_batches(
            prefetch(steps(), depth=2), TrainDecoder(self.image_size),
            workers=self.loader_workers, cores=inp.threads,
        )  # fmt: skip
        yield from batches

    def eval_batches(self, inp: TaskInput) -> Iterator:
        from sparknet.data.decode import EvalDecoder  # lazy: PIL

        if not _split_samples(self.manifest, self.eval_split):  # missing or empty: like no val
            return
        mine = self.manifest.shards(self.eval_split)[inp.partition :: inp.workers]

        def items() -> Iterator:
            for info in mine:
                for s in self.samples(info):
                    yield None if s is None else (s.data, s.label, 0)

        def steps() -> Iterator[list]:
            chunk: list = []
            for item in items():
                chunk.append(item)
                if len(chunk) == EVAL_BATCH:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk

        yield from loader.decoded_batches(
            prefetch(steps(), depth=2), EvalDecoder(self.image_size),
            workers=self.loader_workers, cores=inp.threads,
        )  # fmt: skip


#: the executor-local shard cache when `cache_dir` is not set (expanded on the executor)
DEFAULT_CACHE_DIR = "~/.cache/sparknet/shards"


def with_split(source: Source | None, data: str, split: str | None) -> Source | None:
    """`source` evaluating on `split` (`sparknet evaluate`, `predict`): a shard dataset's split
    (default val); a split asked of other data (None: a DataFrame) is refused in one line."""
    if not isinstance(source, ShardSource):
        if split is not None:
            raise SparknetError(
                "{@split} names a split of a shard dataset; {data} is not one", data=data
            )
        return source
    chosen = split or ShardSource.EVAL
    if chosen not in source.manifest.splits:
        raise SparknetError(
            "{data} has no split {split!r} (it has: {have}); pass {@split}",
            data=data, split=chosen, have=", ".join(sorted(source.manifest.splits)),
        )  # fmt: skip
    return replace(source, eval_split=chosen)


def check_frame_path(spec: str | None, endpoint_url: str | None = None) -> None:
    """A `parquet:PATH` whose PATH is not there (a local path, or an s3:// prefix without an
    object) is refused in one line now, before Spark starts; any other spec, and a path on a
    file system only Spark reaches (hdfs://, s3a://), is left to Spark."""
    if spec is None or not spec.startswith("parquet:"):
        return
    target = spec.removeprefix("parquet:")
    if target.startswith("s3://"):
        if S3Store(target, endpoint_url).is_empty():
            raise SparknetError(f"{spec}: no object at {target}; fix the path")
        return
    if "://" in target and not target.startswith("file://"):
        return
    local = Path(target.removeprefix("file://"))
    if not local.exists():
        raise SparknetError(f"{spec}: no such file or directory; fix the path")


def _looks_like_path(spec: str) -> bool:
    """Whether `spec` can only be a path (`./x`, `../x`, `/x`, `~/x`, `a/b`): a name of
    `datasets:`, `digits` or a module's factory has no slash."""
    return "/" in spec or spec.startswith((".", "~"))


def is_frame_spec(spec: str) -> bool:
    """`parquet:PATH` and `table:NAME` name DataFrames, which need the Spark session to resolve."""
    return spec.startswith(("parquet:", "table:"))


def _split_samples(manifest, split: str) -> int | None:
    """The samples of `split`, or None when the manifest has no such split."""
    shards = manifest.splits.get(split)
    return None if shards is None else sum(s.samples for s in shards)


def _check_splits(uri: str, manifest) -> None:
    """A train split without samples is refused (shards of an older sparknet could be empty); a
    missing or empty val split is a warning: training runs, but measures no accuracy."""
    if _split_samples(manifest, ShardSource.TRAIN) == 0:
        raise SparknetError(
            f"{uri} has no training samples (its {ShardSource.TRAIN!r} shards are empty): "
            "re-create it with `sparknet data shard`"
        )
    val = _split_samples(manifest, ShardSource.EVAL)
    if not val:
        what = "has no" if val is None else "has an empty"
        print(
            f"warning: {uri} {what} {ShardSource.EVAL!r} split: training runs without "
            "evaluation (put images in val/ and re-shard to measure accuracy)",
            file=sys.stderr,
        )


def shard_source(uri: str, cfg, endpoint_url: str | None = None) -> ShardSource:
    """A shard dataset, its manifest read now: a missing bucket or bad credentials fail here."""
    store = open_store(uri, endpoint_url or cfg.endpoint_url)
    manifest = load_manifest(store)
    check_present(store, manifest)  # a missing or replaced shard fails here, before Spark
    _check_splits(store.uri, manifest)
    cache_dir = str(cfg.cache_dir) if cfg.cache_dir is not None else DEFAULT_CACHE_DIR
    return ShardSource(
        store, manifest, cfg.image_size, cfg.loader_workers, cache_dir, int(cfg.cache_gb * 2**30)
    )


def resolve_source(cfg, datasets: dict | None = None) -> Source:
    """The source `cfg.data` names (anything but a DataFrame, see `is_frame_spec`)."""
    spec = cfg.data
    datasets = datasets or {}
    if spec in datasets:
        entry = datasets[spec]
        return shard_source(entry.uri, cfg, entry.endpoint_url)
    if spec.startswith(("s3://", "file://")):
        return shard_source(spec, cfg)
    if spec == "digits" or is_reference(spec):
        return TensorSource.load(spec)
    if Path(spec).is_dir():
        return shard_source(spec, cfg)
    if _looks_like_path(spec) and not Path(spec).exists():
        raise no_such_directory(spec)
    named = (
        f" or a dataset name from sparknet.yaml ({', '.join(sorted(datasets))})" if datasets else ""
    )
    raise SparknetError(
        f"unknown dataset {spec!r}: use digits, package.module:factory, s3://bucket/prefix, a "
        f"local dataset dir, parquet:PATH, table:NAME{named}"
    )
