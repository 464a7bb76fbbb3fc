"""Shard bytes are checked before training reads them (every path), and every shard is checked
to be there, with its size and sha256 metadata, before Spark starts. Real shards on local disk
and on moto's S3 server; the task code runs in this process (what a Spark task would run)."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import pytest

from sparknet.config import TrainConfig
from sparknet.data.integrity import forget_hashes
from sparknet.data.manifest import MANIFEST_NAME, Manifest, ShardInfo
from sparknet.data.shards import write_dataset
from sparknet.data.sources import ShardSource, TaskInput, shard_source
from sparknet.data.stream import epoch_shards
from sparknet.data.transfer import upload_dataset
from sparknet.errors import PermanentTaskError, SparknetError
from tests.imagenet_tree import make_tree


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    make_tree(root / "tree", classes=4, train_per_class=12, val_per_class=2, size=(48, 40))
    write_dataset(root / "tree", root / "ds", shard_bytes=60_000, seed=0, processes=1)
    return root / "ds"


def _manifest(ds: Path) -> Manifest:
    return Manifest.loads((ds / MANIFEST_NAME).read_text(), "m")


def _first_read(ds: Path) -> ShardInfo:
    """The shard that partition 0 of 1 reads first: corrupting it bites before any batch."""
    train = _manifest(ds).shards("train")
    return train[epoch_shards([s.samples for s in train], seed=0, epoch=0, workers=1,
                              partition=0)[0]]  # fmt: skip


def _flip(data: bytes) -> bytes:
    """The same number of bytes, one of them changed in the middle."""
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    return TrainConfig(image_size=32, loader_workers=0, cache_dir=tmp_path / "cache", **kw)


def _first_batch(source: ShardSource):
    inp = TaskInput(partition=0, workers=1, seed=0, run_id=uuid.uuid4().hex, threads=1)
    return next(iter(source.train_batches(inp, 0, tau=1, batch_size=4)))


def test_a_local_shard_changed_at_the_same_size_fails_before_any_sample(shards, tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    for p in shards.iterdir():
        (ds / p.name).write_bytes(p.read_bytes())
    forget_hashes()
    source = shard_source(str(ds), _cfg(tmp_path))
    assert len(_first_batch(source).y) == 4  # intact: trains
    victim = _first_read(ds)
    (ds / victim.name).write_bytes(_flip((ds / victim.name).read_bytes()))
    source = shard_source(str(ds), _cfg(tmp_path))  # same size: the pre-flight stat passes
    with pytest.raises(PermanentTaskError) as exc:
        _first_batch(source)
    text = str(exc.value)
    assert "\n" not in text and victim.name in text and "sha256" in text
    assert f"sparknet data verify {ds}" in text
    assert "re-create the dataset with `sparknet data shard`" in text and "upload" not in text


@pytest.fixture
def uploaded(shards, bucket, moto_endpoint) -> str:
    uri = f"s3://{bucket}/ds"
    upload_dataset(shards, uri, endpoint_url=moto_endpoint)
    return uri


def _replace(bucket: str, name: str, body: bytes, sha256: str) -> None:
    boto3.client("s3").put_object(
        Bucket=bucket, Key=f"ds/{name}", Body=body, Metadata={"sha256": sha256}
    )


@pytest.mark.parametrize("cache_gb", [0, 1], ids=["streamed", "cached"])
def test_an_s3_shard_whose_bytes_changed_fails_before_any_sample(
    shards, uploaded, bucket, tmp_path, cache_gb
):
    victim = _first_read(shards)
    # same size and the old sha256 metadata: only the bytes tell, so only the task can see it
    _replace(bucket, victim.name, _flip((shards / victim.name).read_bytes()), victim.sha256)
    source = shard_source(uploaded, _cfg(tmp_path, cache_gb=cache_gb))
    with pytest.raises(PermanentTaskError) as exc:
        _first_batch(source)
    assert f"{uploaded}/{victim.name}" in str(exc.value) and "sha256" in str(exc.value)
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))  # nothing cached


def test_an_intact_s3_shard_streams_without_a_cache(shards, uploaded, tmp_path):
    batch = _first_batch(shard_source(uploaded, _cfg(tmp_path, cache_gb=0)))
    assert len(batch.y) == 4 and batch.skipped == 0


@pytest.mark.parametrize(
    ("damage", "needle"),
    [("delete", "is missing"), ("resize", "bytes, the manifest says"),
     ("resign", "another sha256")],
)  # fmt: skip
def test_a_missing_or_replaced_s3_shard_fails_before_spark_starts(
    shards, uploaded, bucket, tmp_path, damage, needle
):
    victim = _manifest(shards).shards("val")[0]
    s3 = boto3.client("s3")
    if damage == "delete":
        s3.delete_object(Bucket=bucket, Key=f"ds/{victim.name}")
    elif damage == "resize":
        _replace(bucket, victim.name, b"short", victim.sha256)
    else:
        data = _flip((shards / victim.name).read_bytes())
        _replace(bucket, victim.name, data, "0" * 64)
    with pytest.raises(SparknetError) as exc:
        shard_source(uploaded, _cfg(tmp_path))
    text = str(exc.value)
    assert "\n" not in text and victim.name in text and needle in text, text
    assert f"sparknet data verify {uploaded}" in text


def test_a_missing_local_shard_fails_before_spark_starts(shards, tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    for p in shards.iterdir():
        (ds / p.name).write_bytes(p.read_bytes())
    gone = _manifest(ds).shards("train")[-1]
    (ds / gone.name).unlink()
    with pytest.raises(SparknetError, match=f"{gone.name} is missing"):
        shard_source(str(ds), _cfg(tmp_path))


def test_a_dataset_without_a_val_split_warns_in_one_line(shards, tmp_path, capsys):
    ds = tmp_path / "ds"
    ds.mkdir()
    m = _manifest(shards)
    for info in m.shards("train"):
        (ds / info.name).write_bytes((shards / info.name).read_bytes())
    only_train = Manifest(classes=m.classes, splits={"train": m.shards("train")})
    (ds / MANIFEST_NAME).write_text(only_train.dumps())
    shard_source(str(ds), _cfg(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning:") and "'val'" in err[0], err
    shard_source(str(shards), _cfg(tmp_path))
    assert capsys.readouterr().err == ""


def _with_splits(shards: Path, ds: Path, **splits) -> None:
    """A copy of the dataset whose manifest has the given splits (lists of ShardInfo)."""
    ds.mkdir()
    m = _manifest(shards)
    for infos in splits.values():
        for info in infos:
            (ds / info.name).write_bytes((shards / info.name).read_bytes())
    (ds / MANIFEST_NAME).write_text(Manifest(classes=m.classes, splits=splits).dumps())


def _emptied(info: ShardInfo) -> ShardInfo:
    return info.model_copy(update={"samples": 0})


def test_an_empty_val_split_warns_like_a_missing_one_and_evaluates_nothing(
    shards, tmp_path, capsys
):
    """Shards of an older sparknet could hold no sample (all of its images bad)."""
    m = _manifest(shards)
    _with_splits(shards, tmp_path / "ds", train=m.shards("train"),
                 val=[_emptied(i) for i in m.shards("val")])  # fmt: skip
    source = shard_source(str(tmp_path / "ds"), _cfg(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty 'val' split" in err[0], err
    inp = TaskInput(partition=0, workers=1, seed=0, run_id="r", threads=1)
    assert list(source.eval_batches(inp)) == []


def test_a_train_split_without_samples_is_refused_in_one_line(shards, tmp_path):
    m = _manifest(shards)
    _with_splits(shards, tmp_path / "ds", train=[_emptied(i) for i in m.shards("train")])
    with pytest.raises(SparknetError) as info:
        shard_source(str(tmp_path / "ds"), _cfg(tmp_path))
    assert "has no training samples" in str(info.value) and "\n" not in str(info.value)


def test_a_partition_of_only_empty_shards_is_a_permanent_task_error():
    from sparknet.data.stream import locate

    with pytest.raises(PermanentTaskError, match="only empty shards"):
        locate([0, 0], seed=0, workers=2, partition=0, position=0)
