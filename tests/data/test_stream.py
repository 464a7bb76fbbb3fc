"""Which shard samples a partition reads when: pure, disjoint per epoch, robust to bad members."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from sparknet.data.manifest import ShardInfo
from sparknet.data.stream import epoch_shards, locate, read_positions, read_shard, tar_files
from sparknet.errors import SparknetError, as_keyword

COUNTS = [5, 3, 4, 6, 2, 5, 4]


def _shard_bytes(keys: list[str], labels: list[int]) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for key, label in zip(keys, labels, strict=True):
            sink.write({"__key__": key, "jpg": key.encode() * 10, "cls": str(label)})
    return buf.getvalue()


def _info(name: str, data: bytes, samples: int) -> ShardInfo:
    return ShardInfo(
        name=name, samples=samples, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
    )


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[list[ShardInfo], dict[str, bytes]]:
    shards, blobs = [], {}
    for i, n in enumerate(COUNTS):
        name = f"train-{i:06d}.tar"
        keys = [f"s{i}_{j}" for j in range(n)]
        blobs[name] = _shard_bytes(keys, [i] * n)
        shards.append(_info(name, blobs[name], n))
    return shards, blobs


def _opener(blobs: dict[str, bytes]):
    return lambda info: io.BytesIO(blobs[info.name])


def test_each_epoch_deals_every_shard_to_exactly_one_partition():
    for epoch in range(4):
        dealt = [
            epoch_shards(COUNTS, seed=3, epoch=epoch, workers=3, partition=k) for k in range(3)
        ]
        flat = sorted(i for part in dealt for i in part)
        assert flat == list(range(len(COUNTS)))
    orders = {epoch_shards(COUNTS, seed=3, epoch=e, workers=3, partition=0) for e in range(6)}
    assert len(orders) > 1, "epochs must reshuffle the shards"


def test_fewer_shards_than_workers_names_the_fix():
    with pytest.raises(SparknetError, match="fewer than its 9 Spark tasks") as exc:
        epoch_shards(COUNTS, seed=0, epoch=0, workers=9, partition=0)
    assert "smaller --shard-mb or --shards 9" in str(exc.value)  # the flags `data shard` has
    assert "--shards 9" in exc.value.worded(as_keyword)  # from `sparknet.fit` too: no shards=


def test_locate_walks_shards_then_epochs():
    order = epoch_shards(COUNTS, seed=1, epoch=0, workers=2, partition=1)
    first = COUNTS[order[0]]
    assert locate(COUNTS, seed=1, workers=2, partition=1, position=0).shard == 0
    loc = locate(COUNTS, seed=1, workers=2, partition=1, position=first)
    assert (loc.epoch, loc.shard, loc.sample) == (0, 1, 0)
    epoch_size = sum(COUNTS[i] for i in order)
    loc = locate(COUNTS, seed=1, workers=2, partition=1, position=epoch_size + 1)
    assert loc.epoch == 1 and loc.sample + 0 >= 0


def test_reading_from_any_position_equals_the_stream_from_the_start(dataset):
    shards, blobs = dataset
    args = dict(seed=5, workers=2, partition=0)
    stream = read_positions(shards, _opener(blobs), start=0, **args)
    whole = [next(stream).key for _ in range(60)]
    for start in (0, 1, 7, 13, 29, 41):
        tail = read_positions(shards, _opener(blobs), start=start, **args)
        assert [next(tail).key for _ in range(60 - start)] == whole[start:]


def test_one_epoch_of_all_partitions_reads_every_sample_once(dataset):
    shards, blobs = dataset
    seen = []
    for k in range(3):
        order = epoch_shards(COUNTS, seed=2, epoch=0, workers=3, partition=k)
        n = sum(COUNTS[i] for i in order)
        it = read_positions(shards, _opener(blobs), seed=2, workers=3, partition=k, start=0)
        seen += [next(it).key for _ in range(n)]
    assert sorted(seen) == sorted(f"s{i}_{j}" for i, n in enumerate(COUNTS) for j in range(n))


def test_truncated_shard_yields_none_for_every_position_it_owed(dataset):
    shards, blobs = dataset
    info, data = shards[3], blobs[shards[3].name]
    cut = data[: len(data) // 2]  # mid-way through a member
    items = list(read_shard(io.BytesIO(cut), info))
    assert len(items) == info.samples
    good = [s for s in items if s is not None]
    assert 0 < len(good) < info.samples
    assert items[len(good) :] == [None] * (info.samples - len(good))
    assert [s.label for s in good] == [3] * len(good)


def test_sample_without_label_is_a_none_in_its_place():
    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        sink.write({"__key__": "a", "jpg": b"x", "cls": "1"})
        sink.write({"__key__": "b", "jpg": b"y"})
        sink.write({"__key__": "c", "jpg": b"z", "cls": "not-a-number"})
        sink.write({"__key__": "d", "jpg": b"w", "cls": "2"})
    data = buf.getvalue()
    items = list(read_shard(io.BytesIO(data), _info("train-000000.tar", data, 4)))
    assert [None if s is None else s.key for s in items] == ["a", None, None, "d"]


def test_batches_are_a_pure_function_of_round_whatever_was_read_before(tmp_path, dataset):
    """Round 1 read on after round 0 (a kept cursor) equals round 1 read fresh (a retry)."""
    from sparknet.data.sources import ShardSource, TaskInput
    from sparknet.data.store import LocalStore

    shards, blobs = dataset
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    from sparknet.data.manifest import ClassInfo, Manifest

    manifest = Manifest(
        classes=[ClassInfo(index=i, wnid=f"n{i:08d}") for i in range(len(COUNTS))],
        splits={"train": shards},
    )
    source = ShardSource(LocalStore(tmp_path), manifest, 8, 0, None, 0)
    seen: list = []

    def fake_decoded(steps, decode, *, workers, cores):
        for items in steps:
            seen.append([None if i is None else (i[0], i[2]) for i in items])
            yield None

    import sparknet.data.loader as loader

    original = loader.decoded_batches
    loader.decoded_batches = fake_decoded  # only the decode is stubbed: the order is under test
    try:
        inp = TaskInput(partition=1, workers=2, seed=4, run_id="a")
        list(source.train_batches(inp, 0, 3, 4))  # steps 0-2
        list(source.train_batches(inp, 3, 3, 4))  # steps 3-5
        continued = seen[3:]
        seen.clear()
        fresh = TaskInput(partition=1, workers=2, seed=4, run_id="b")
        list(source.train_batches(fresh, 3, 3, 4))
    finally:
        loader.decoded_batches = original
    assert seen == continued
    assert len({s for step in seen for s in step}) == 12
    np.testing.assert_equal(len(seen), 3)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_files_reads_what_tarfile_wrote(fmt):
    long = "k" * (40 if fmt == tarfile.USTAR_FORMAT else 150)
    members = {f"{long}{i}.jpg": bytes([i]) * (700 * i + 3) for i in range(4)}
    members["dir/x.cls"] = b"7"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        folder = tarfile.TarInfo("dir")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)  # a non-file entry is passed over
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1.5  # a float mtime makes PAX write an extended header per member
            tar.addfile(info, io.BytesIO(data))
    got = {f["fname"]: f["data"] for f in tar_files(io.BytesIO(buf.getvalue()), "u")}
    assert got == members


def test_tar_files_raises_on_a_cut_member():
    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        sink.write({"__key__": "a", "jpg": b"x" * 5000, "cls": "1"})
    with pytest.raises(tarfile.ReadError):
        list(tar_files(io.BytesIO(buf.getvalue()[:3000]), "u"))
