"""Which shard samples a partition reads at which step, and reading them off a tar stream.

Each partition reads an endless stream of epochs. In epoch e the train shards are put in a seeded
order and dealt round-robin to the K partitions, so within an epoch the partitions' shards are
disjoint and together cover the dataset. Stream position p (batch g covers positions
[g*b, (g+1)*b)) maps to (epoch, shard, sample in shard) through the manifest's sample counts alone:
the samples a step trains on are a pure function of (seed, partition, round, step), as the
algorithm contract asks, and a retried task, a resumed run or a task on another executor reads the
same ones. Samples within a shard keep their written order; `sparknet data shard` shuffles the
whole dataset across shards, so every shard is already a fair sample in random order.

A sample that cannot be read (a truncated member, a missing `.cls`) still takes its position and
arrives as None, so counts stay pure and the caller counts it as skipped.
"""

from __future__ import annotations

import functools
import queue
import tarfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from webdataset.tariterators import group_by_keys

from sparknet.data.manifest import ShardInfo
from sparknet.errors import PermanentTaskError, SettingError


@dataclass(frozen=True)
class RawSample:
    key: str
    data: bytes
    label: int


@dataclass(frozen=True)
class Location:
    epoch: int
    shard: int  # position in the epoch's list of this partition's shards
    sample: int  # index of the sample within that shard


@functools.lru_cache(maxsize=64)
def _epoch_shards(counts: tuple[int, ...], seed: int, epoch: int, workers: int) -> tuple:
    order = np.random.default_rng([seed, 0x5A4D, epoch]).permutation(len(counts))
    return tuple(tuple(int(i) for i in order[k::workers]) for k in range(workers))


def epoch_shards(
    counts: Sequence[int], *, seed: int, epoch: int, workers: int, partition: int
) -> tuple[int, ...]:
    """Indices (into the manifest's shard list) that `partition` reads in `epoch`, in order."""
    if len(counts) < workers:
        raise SettingError(
            "the dataset has {shards} train shards, fewer than its {value} Spark tasks (each "
            "reads shards of its own): run fewer ({@workers_setting}) or re-shard with a "
            "smaller {@shard_mb} or {@shards} {value} (`sparknet data shard`)",
            setting="workers",
            value=workers,
            shards=len(counts),
        )
    return _epoch_shards(tuple(counts), seed, epoch, workers)[partition]


def locate(
    counts: Sequence[int], *, seed: int, workers: int, partition: int, position: int
) -> Location:
    """Where stream position `position` of `partition` lies (epoch, shard, sample)."""
    epoch = 0
    while True:
        shards = epoch_shards(counts, seed=seed, epoch=epoch, workers=workers, partition=partition)
        size = sum(counts[i] for i in shards)
        if size == 0:
            # the manifest cannot change under a run: no retry can heal this
            raise PermanentTaskError(
                f"partition {partition} got only empty shards in epoch {epoch}: re-create the "
                "dataset with `sparknet data shard` (it writes no empty shards)"
            )
        if position < size:
            for j, i in enumerate(shards):
                if position < counts[i]:
                    return Location(epoch, j, position)
                position -= counts[i]
        position -= size
        epoch += 1


_BLOCK = tarfile.BLOCKSIZE
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)


def _exact(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise tarfile.ReadError("unexpected end of data")
    return data


def _pax_records(data: bytes) -> dict[str, str]:
    """`<length> <key>=<value>\n` records of a PAX extended header."""
    out, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.index(b" ", pos)
        end = pos + int(data[pos:space])
        key, _, value = data[space + 1 : end - 1].partition(b"=")
        out[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def tar_files(stream: BinaryIO, url: str) -> Iterator[dict]:
    """The regular files of a tar stream, as webdataset's `group_by_keys` takes them.

    One read per header and one per member, where `tarfile`'s stream mode (and so webdataset's
    `tar_file_iterator`) copies through a 10 KiB record buffer: at ~110 KB per image that costs
    ~0.15 ms an image, a few percent of decoding it on one core. PAX and GNU long names are
    honoured; a truncated or corrupt archive raises `tarfile.ReadError`.
    """
    pending: dict[str, str] = {}
    while True:
        header = stream.read(_BLOCK)
        if not header.strip(b"\0"):
            if len(header) < _BLOCK and header:
                raise tarfile.ReadError("unexpected end of data")
            return  # the end-of-archive zero block (or a clean end of stream)
        if len(header) < _BLOCK:
            raise tarfile.ReadError("unexpected end of data")
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        size = int(pending.get("size", info.size))
        data = _exact(stream, size)
        _exact(stream, -size % _BLOCK)
        if info.type == tarfile.XHDTYPE:
            pending = _pax_records(data)
            continue
        if info.type == tarfile.GNUTYPE_LONGNAME:
            pending = {"path": data.rstrip(b"\0").decode("utf-8", "surrogateescape")}
            continue
        name, pending = pending.get("path", info.name), {}
        if info.type in _FILE_TYPES:
            yield {"fname": name, "data": data, "__url__": url}


def _parse(sample: dict) -> RawSample | None:
    try:
        return RawSample(sample["__key__"], bytes(sample["jpg"]), int(sample["cls"]))
    except (KeyError, ValueError):
        return None


def read_shard(stream: BinaryIO, info: ShardInfo, start: int = 0) -> Iterator[RawSample | None]:
    """Exactly `info.samples - start` items from a shard stream: samples, or None for bad ones.

    A broken tar (a truncated member, garbage) ends the shard early; the positions it still owed
    come out as None. Extra samples beyond the manifest's count are ignored.
    """
    files = tar_files(stream, info.name)
    produced = 0
    try:
        for sample in group_by_keys(files):
            if produced >= info.samples:
                break
            if produced >= start:
                yield _parse(sample)
            produced += 1
    except (tarfile.TarError, OSError, EOFError, ValueError):
        pass  # a broken tar ends the shard: the samples it owes come out as None below
    for _ in range(max(produced, start), info.samples):
        yield None


ShardOpener = Callable[[ShardInfo], BinaryIO]


def read_positions(
    shards: Sequence[ShardInfo],
    open_shard: ShardOpener,
    *,
    seed: int,
    workers: int,
    partition: int,
    start: int,
) -> Iterator[RawSample | None]:
    """The endless stream of `partition` from position `start`, one item per position."""
    counts = [s.samples for s in shards]
    loc = locate(counts, seed=seed, workers=workers, partition=partition, position=start)
    epoch, j, sample = loc.epoch, loc.shard, loc.sample
    while True:
        order = epoch_shards(counts, seed=seed, epoch=epoch, workers=workers, partition=partition)
        for i in order[j:]:
            info = shards[i]
            if info.samples == 0:
                continue
            with open_shard(info) as stream:
                yield from read_shard(stream, info, sample)
            sample = 0
        epoch, j = epoch + 1, 0


class Cursor:
    """A partition's open stream kept between rounds in one Python worker process.

    Round r+1 starts where round r ended, so the normal path reads every shard once, front to back.
    Any other start (a retry, a resume, a partition that moved) reopens at the right sample.
    """

    def __init__(self, items: Iterator[RawSample | None], position: int) -> None:
        self.items = items
        self.position = position

    def take(self, n: int) -> list[RawSample | None]:
        out = [next(self.items) for _ in range(n)]
        self.position += n
        return out

    def close(self) -> None:
        close = getattr(self.items, "close", None)
        if close is not None:
            close()


_CURSORS: dict[tuple, Cursor] = {}


def take_cursor(key: tuple, position: int, open_items: Callable[[int], Iterator]) -> Cursor:
    """The kept cursor for `key` if it stands at `position`, else a fresh one opened there.

    The cursor leaves the cache while a round uses it and comes back (`keep_cursor`) only when
    the round read all it asked for: an aborted round never leaves a cursor in an unknown place.
    """
    cur = _CURSORS.pop(key, None)
    if cur is not None and cur.position == position:
        return cur
    if cur is not None:
        cur.close()
    return Cursor(open_items(position), position)


def keep_cursor(key: tuple, cursor: Cursor) -> None:
    _CURSORS[key] = cursor


_DONE = object()


def prefetch(items: Iterator, depth: int) -> Iterator:
    """Run `items` in a background thread, up to `depth` ahead: network reads overlap compute.

    An exception in the producer is re-raised in the consumer at the point it happened.
    """
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((_DONE, None))
        except BaseException as exc:  # handed to the consumer
            q.put((_DONE, exc))

    thread = threading.Thread(target=produce, name="sparknet-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, exc = q.get()
            if exc is not None:
                raise exc
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
