"""Dataset upload / verify / ls and the executor shard cache, against moto's real S3 server.

Datasets are built here: a manifest made with Manifest/ShardInfo over shard files of random bytes
(the transfer code never opens a tar, so real shards are not needed).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import boto3
import botocore.exceptions as bx
import pytest

from sparknet.data import s3
from sparknet.data.cache import ShardCache
from sparknet.data.manifest import MANIFEST_NAME, ClassInfo, Manifest, ShardInfo
from sparknet.data.store import S3Store, Store, open_store
from sparknet.data.transfer import list_dataset, upload_dataset, verify_dataset
from sparknet.errors import SparknetError

pytestmark = pytest.mark.integration


def make_dataset(root: Path, splits: dict[str, list[int]]) -> Manifest:
    """Shards of random bytes with the given sizes per split, and their manifest, under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    shards: dict[str, list[ShardInfo]] = {}
    for split, sizes in splits.items():
        for i, size in enumerate(sizes):
            data = os.urandom(size)
            name = f"{split}-{i:06d}.tar"
            (root / name).write_bytes(data)
            info = ShardInfo(
                name=name, samples=10 + i, bytes=size, sha256=hashlib.sha256(data).hexdigest()
            )
            shards.setdefault(split, []).append(info)
    manifest = Manifest(
        classes=[ClassInfo(index=i, wnid=f"n{i:08d}") for i in range(3)], splits=shards
    )
    (root / MANIFEST_NAME).write_text(manifest.dumps())
    return manifest


def keys(endpoint: str, bucket: str) -> set[str]:
    resp = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket)
    return {obj["Key"] for obj in resp.get("Contents", [])}


def assert_one_line(err: BaseException, *needles: str) -> None:
    text = str(err)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, Manifest]:
    src = tmp_path / "ds"
    return src, make_dataset(src, {"train": [3000, 2500, 4000, 1000, 2000], "val": [1500]})


def test_upload_then_verify_is_clean(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest]
) -> None:
    src, manifest = dataset
    uri = f"s3://{bucket}/imagenet"
    seen: list[int] = []
    report = upload_dataset(src, uri, endpoint_url=moto_endpoint, on_progress=seen.append)
    names = [s.name for shards in manifest.splits.values() for s in shards]
    total = sum(s.bytes for shards in manifest.splits.values() for s in shards)
    assert report.uploaded == names and report.skipped == []
    assert report.bytes_uploaded == total == sum(seen)
    assert keys(moto_endpoint, bucket) == {f"imagenet/{n}" for n in [*names, MANIFEST_NAME]}
    head = boto3.client("s3", endpoint_url=moto_endpoint).head_object(
        Bucket=bucket, Key="imagenet/train-000000.tar"
    )
    assert head["Metadata"]["sha256"] == manifest.splits["train"][0].sha256

    result = verify_dataset(uri, endpoint_url=moto_endpoint)
    assert (result.checked, result.problems) == (6, [])
    assert verify_dataset(str(src)).problems == []  # a local dataset verifies the same way

    listing = list_dataset(uri, endpoint_url=moto_endpoint)
    assert listing.num_classes == 3 and listing.missing == []
    train = next(s for s in listing.splits if s.split == "train")
    assert (train.shards, train.samples, train.bytes) == (5, 10 + 11 + 12 + 13 + 14, 12500)


def test_verify_names_a_shard_whose_bytes_changed_at_the_same_size(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest]
) -> None:
    src, _ = dataset
    uri = f"s3://{bucket}/ds"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    s3c = boto3.client("s3", endpoint_url=moto_endpoint)
    s3c.put_object(Bucket=bucket, Key="ds/train-000003.tar", Body=os.urandom(1000))  # same size
    s3c.put_object(Bucket=bucket, Key="ds/train-000004.tar", Body=b"short")
    s3c.delete_object(Bucket=bucket, Key="ds/val-000000.tar")

    result = verify_dataset(uri, endpoint_url=moto_endpoint)
    assert result.checked == 6
    assert result.problems == [
        "train-000003.tar: sha256 differs from the manifest",
        "train-000004.tar: size 5, manifest says 2000",
        "val-000000.tar: missing",
    ]
    assert list_dataset(uri, endpoint_url=moto_endpoint).missing == ["val-000000.tar"]


def test_an_interrupted_upload_leaves_no_manifest_and_a_rerun_sends_only_the_rest(
    moto_endpoint: str,
    bucket: str,
    dataset: tuple[Path, Manifest],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, _ = dataset
    uri = f"s3://{bucket}/ds"
    # upload_dataset runs in this test's process, so patching the cached client's method here is
    # what it uses (an executor or subprocess would not see this patch).
    s3c = s3.client(moto_endpoint)
    real_upload = s3c.upload_file

    def failing_third(filename: str, *args: object, **kwargs: object) -> None:
        if filename.endswith("train-000002.tar"):
            raise bx.ConnectionClosedError(endpoint_url=moto_endpoint)
        real_upload(filename, *args, **kwargs)

    monkeypatch.setattr(s3c, "upload_file", failing_third)
    with pytest.raises(SparknetError) as info:
        upload_dataset(src, uri, endpoint_url=moto_endpoint, max_concurrency=1)
    assert_one_line(info.value, "2 of 6 shards were uploaded", "no manifest", "again")
    present = keys(moto_endpoint, bucket)
    assert f"ds/{MANIFEST_NAME}" not in present
    assert present == {"ds/train-000000.tar", "ds/train-000001.tar"}
    with pytest.raises(SparknetError, match=r"has no manifest\.json"):
        verify_dataset(uri, endpoint_url=moto_endpoint)

    monkeypatch.undo()
    report = upload_dataset(src, uri, endpoint_url=moto_endpoint, max_concurrency=1)
    assert report.skipped == ["train-000000.tar", "train-000001.tar"]
    assert report.uploaded == [
        "train-000002.tar",
        "train-000003.tar",
        "train-000004.tar",
        "val-000000.tar",
    ]
    assert report.bytes_uploaded == 4000 + 1000 + 2000 + 1500
    assert f"ds/{MANIFEST_NAME}" in keys(moto_endpoint, bucket)
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_reupload_skips_finished_shards_but_replaces_changed_ones(
    moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    src = tmp_path / "ds"
    make_dataset(src, {"train": [1000, 1000]})
    uri = f"s3://{bucket}/ds"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    again = upload_dataset(src, uri, endpoint_url=moto_endpoint)
    assert again.uploaded == [] and again.skipped == ["train-000000.tar", "train-000001.tar"]

    make_dataset(src, {"train": [1000, 1000]})  # same names and sizes, new bytes
    redo = upload_dataset(src, uri, endpoint_url=moto_endpoint)
    assert redo.uploaded == ["train-000000.tar", "train-000001.tar"] and redo.skipped == []
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_a_big_shard_goes_up_in_parts_with_its_sha256(
    moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    src = tmp_path / "big"
    manifest = make_dataset(src, {"train": [6 << 20]})
    uri = f"s3://{bucket}/big"
    kwargs = {"multipart_threshold": 5 << 20, "multipart_chunksize": 5 << 20}
    upload_dataset(src, uri, endpoint_url=moto_endpoint, **kwargs)
    head = boto3.client("s3", endpoint_url=moto_endpoint).head_object(
        Bucket=bucket, Key="big/train-000000.tar"
    )
    assert head["ETag"].strip('"').endswith("-2")  # a two-part upload
    assert head["Metadata"]["sha256"] == manifest.splits["train"][0].sha256
    assert upload_dataset(src, uri, endpoint_url=moto_endpoint, **kwargs).skipped == [
        "train-000000.tar"
    ]
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_upload_to_a_missing_bucket_fails_before_sending_anything(
    moto_endpoint: str, dataset: tuple[Path, Manifest]
) -> None:
    src, _ = dataset
    with pytest.raises(SparknetError) as info:
        upload_dataset(src, "s3://no-such-bucket-xyz/ds", endpoint_url=moto_endpoint)
    assert_one_line(info.value, "bucket no-such-bucket-xyz does not exist")


def test_upload_refuses_a_local_dataset_that_does_not_match_its_manifest(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest]
) -> None:
    src, _ = dataset
    (src / "train-000001.tar").write_bytes(b"truncated")
    (src / "val-000000.tar").unlink()
    with pytest.raises(SparknetError) as info:
        upload_dataset(src, f"s3://{bucket}/ds", endpoint_url=moto_endpoint)
    assert_one_line(info.value, "train-000001.tar has 9 bytes, the manifest says 2500", "1 more")
    assert keys(moto_endpoint, bucket) == set()
    with pytest.raises(SparknetError, match=r"manifest\.json not found"):
        upload_dataset(src / "nowhere", f"s3://{bucket}/ds", endpoint_url=moto_endpoint)


# ---------------------------------------------------------------- the executor shard cache


class CountingStore:
    """Wraps a store to count whole-object fetches (a cache hit must not fetch)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.fetched: list[str] = []

    def fetch(self, name: str, dest: Path) -> None:
        self.fetched.append(name)
        self.inner.fetch(name, dest)


def test_shard_cache_evicts_least_recently_used_to_stay_under_its_cap(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest], tmp_path: Path
) -> None:
    src, manifest = dataset
    upload_dataset(src, f"s3://{bucket}/ds", endpoint_url=moto_endpoint)
    store = CountingStore(S3Store(f"s3://{bucket}/ds", endpoint_url=moto_endpoint))
    t0, t1, t2, t3, _ = manifest.splits["train"]  # 3000, 2500, 4000, 1000 bytes
    cache = ShardCache(tmp_path / "cache", cap_bytes=7000)

    p0 = cache.path(store, t0)
    assert p0.read_bytes() == (src / t0.name).read_bytes()
    p1 = cache.path(store, t1)
    os.utime(p0, ns=(1, 1))  # make t0 the oldest beyond doubt, then touch it by a hit
    os.utime(p1, ns=(2, 2))
    assert cache.path(store, t0) == p0
    assert store.fetched == [t0.name, t1.name]  # the hit fetched nothing

    cache.path(store, t2)  # 3000 + 2500 + 4000 > 7000: evict t1 (LRU)
    assert p0.exists() and not p1.exists()
    assert cache.total_bytes() == 7000
    cache.path(store, t3)
    assert cache.total_bytes() <= 7000
    assert not any(p.name.startswith(".") for p in (tmp_path / "cache").iterdir())


def test_shard_cache_rejects_bytes_that_do_not_match_the_manifest_sha256(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest], tmp_path: Path
) -> None:
    src, manifest = dataset
    uri = f"s3://{bucket}/ds"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    boto3.client("s3", endpoint_url=moto_endpoint).put_object(
        Bucket=bucket, Key="ds/train-000003.tar", Body=os.urandom(1000)
    )
    cache = ShardCache(tmp_path / "cache", cap_bytes=1 << 20)
    with pytest.raises(SparknetError) as info:
        cache.path(open_store(uri, moto_endpoint), manifest.splits["train"][3])
    assert_one_line(info.value, f"{uri}/train-000003.tar", "sha256", "upload it again")
    assert list(cache.root.iterdir()) == []  # nothing cached, no temp left


def test_shard_cache_keeps_two_datasets_with_equal_shard_names_apart(
    moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    a = make_dataset(tmp_path / "a", {"train": [100]})
    b = make_dataset(tmp_path / "b", {"train": [100]})
    upload_dataset(tmp_path / "a", f"s3://{bucket}/a", endpoint_url=moto_endpoint)
    cache = ShardCache(tmp_path / "cache", cap_bytes=1 << 20)
    from_s3 = cache.path(open_store(f"s3://{bucket}/a", moto_endpoint), a.splits["train"][0])
    local = cache.path(open_store(str(tmp_path / "b")), b.splits["train"][0])
    assert from_s3 != local
    assert from_s3.read_bytes() == (tmp_path / "a" / "train-000000.tar").read_bytes()
    assert local.read_bytes() == (tmp_path / "b" / "train-000000.tar").read_bytes()


@pytest.mark.parametrize("parts", [False, True], ids=["single", "multipart"])
def test_reupload_resends_an_object_whose_bytes_changed_behind_unchanged_metadata(
    moto_endpoint: str, bucket: str, tmp_path: Path, parts: bool
) -> None:
    """What `verify` calls bad, `upload` sends again: same size, same sha256 metadata, other
    bytes (an overwrite by another tool, or an upload of an older sparknet without checksums)."""
    src = tmp_path / "ds"
    manifest = make_dataset(src, {"train": [6 << 20 if parts else 3000, 2000]})
    uri = f"s3://{bucket}/ds"
    kwargs = {"multipart_threshold": 5 << 20, "multipart_chunksize": 5 << 20} if parts else {}
    upload_dataset(src, uri, endpoint_url=moto_endpoint, **kwargs)
    assert upload_dataset(src, uri, endpoint_url=moto_endpoint, **kwargs).uploaded == []
    victim = manifest.splits["train"][0]
    boto3.client("s3", endpoint_url=moto_endpoint).put_object(
        Bucket=bucket, Key=f"ds/{victim.name}", Body=os.urandom(victim.bytes),
        Metadata={"sha256": victim.sha256},
    )  # fmt: skip
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == [
        f"{victim.name}: sha256 differs from the manifest"
    ]
    redo = upload_dataset(src, uri, endpoint_url=moto_endpoint, **kwargs)
    assert redo.uploaded == [victim.name] and redo.skipped == ["train-000001.tar"]
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_force_sends_every_shard_again(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest]
) -> None:
    src, manifest = dataset
    uri = f"s3://{bucket}/ds"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    forced = upload_dataset(src, uri, endpoint_url=moto_endpoint, force=True)
    assert forced.skipped == []
    assert forced.uploaded == [s.name for v in manifest.splits.values() for s in v]


def test_verify_announces_its_total_before_the_first_byte(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest]
) -> None:
    """The progress bar shows done/total MB, not done/? MB."""
    src, manifest = dataset
    events: list[tuple[str, int]] = []
    verify_dataset(
        str(src), on_total=lambda n: events.append(("total", n)),
        on_progress=lambda n: events.append(("done", n)),
    )  # fmt: skip
    total = sum(s.bytes for v in manifest.splits.values() for s in v)
    assert events[0] == ("total", total)
    assert sum(n for kind, n in events if kind == "done") == total


def flip_byte(path: Path, at: int = 100) -> None:
    """Change one byte of a file in place, keeping its size."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("parts", [False, True], ids=["single", "multipart"])
def test_upload_refuses_a_local_shard_whose_bytes_differ_from_the_manifest(
    moto_endpoint: str, bucket: str, tmp_path: Path, parts: bool
) -> None:
    """A local shard corrupted at the same size is never sent, and never replaces a good copy."""
    src = tmp_path / "ds"
    make_dataset(src, {"train": [6 << 20 if parts else 3000, 2000]})
    uri = f"s3://{bucket}/ds"
    kwargs = {"multipart_threshold": 5 << 20, "multipart_chunksize": 5 << 20} if parts else {}
    if parts:  # a good copy is there already
        upload_dataset(src, uri, endpoint_url=moto_endpoint, **kwargs)
    before = keys(moto_endpoint, bucket)
    flip_byte(src / "train-000000.tar")
    with pytest.raises(SparknetError) as info:
        upload_dataset(src, uri, endpoint_url=moto_endpoint, **kwargs)
    assert_one_line(info.value, "train-000000.tar", "sha256", "sparknet data shard")
    assert keys(moto_endpoint, bucket) == before
    if parts:
        assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_a_cache_hit_whose_bytes_changed_at_the_same_size_is_fetched_again(
    tmp_path: Path,
) -> None:
    """A cached file is hashed once per process: rewritten in place (same size), it is not
    handed out; the shard is fetched again from the store and the good bytes are served."""
    from sparknet.data.integrity import forget_hashes

    manifest = make_dataset(tmp_path / "ds", {"train": [3000]})
    info = manifest.splits["train"][0]
    store = CountingStore(open_store(str(tmp_path / "ds")))
    cache = ShardCache(tmp_path / "cache", cap_bytes=1 << 20)
    cached = cache.path(store, info)
    assert cache.path(store, info) == cached and store.fetched == [info.name]  # a plain hit
    flip_byte(cached)
    forget_hashes()  # as a new Python worker would start
    again = cache.path(store, info)
    assert store.fetched == [info.name, info.name]
    assert again.read_bytes() == (tmp_path / "ds" / info.name).read_bytes()


def test_verify_and_upload_catch_stale_sha256_metadata_on_good_bytes(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest]
) -> None:
    """Training refuses an object whose sha256 metadata is not the manifest's: so does verify,
    and upload sends it again."""
    src, _ = dataset
    uri = f"s3://{bucket}/ds"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    s3c = boto3.client("s3", endpoint_url=moto_endpoint)
    s3c.copy_object(
        Bucket=bucket, Key="ds/train-000002.tar", Metadata={"sha256": "0" * 64},
        CopySource={"Bucket": bucket, "Key": "ds/train-000002.tar"}, MetadataDirective="REPLACE",
    )  # fmt: skip
    (problem,) = verify_dataset(uri, endpoint_url=moto_endpoint).problems
    assert problem.startswith("train-000002.tar: its sha256 metadata differs from the manifest")
    redo = upload_dataset(src, uri, endpoint_url=moto_endpoint)
    assert redo.uploaded == ["train-000002.tar"]
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_eviction_removes_temps_of_dead_writers_and_counts_live_ones(tmp_path: Path) -> None:
    """A `kill -9` mid-fetch leaves a temp: eviction removes it once its writer is gone (or it
    has been idle an hour), and counts live temps against the cap."""
    import subprocess
    import sys
    import time

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid, me = int(gone.stdout), os.getpid()
    cache = ShardCache(tmp_path / "cache", cap_bytes=6000)
    root = cache.root
    root.mkdir(parents=True)
    k = "0123456789ab-0123456789abcdef"
    dead = root / f"..{k}-train-000000.tar.{dead_pid}.0badf00d.tmp.{dead_pid}.00c0ffee.tmp"
    idle = root / f".{k}-train-000001.tar.{me}.0badf00d.tmp"
    live = root / f".{k}-train-000002.tar.{me}.00c0ffee.tmp"
    cached = root / f"{k}-train-000003.tar"
    for path in (dead, idle, live, cached):
        path.write_bytes(b"x" * 4000)
    old = time.time() - 2 * 3600
    os.utime(idle, (old, old))
    assert cache.evict() == 2
    assert not dead.exists() and not idle.exists() and live.exists()
    assert not cached.exists()  # 4000 live + 4000 cached > 6000: the cached file goes


def test_the_shard_cache_never_touches_the_users_files_in_its_dir(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """--cache-dir names a directory the user may keep other files in: the cache lives in its own
    subdirectory, and eviction and temp clean-up there touch only names sparknet writes."""
    import time

    src, manifest = dataset
    uri = f"s3://{bucket}/ds"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    userdir = tmp_path / "userdir"
    userdir.mkdir()
    notes = userdir / "notes.txt"
    draft = userdir / ".draft.4000000.abcdef12.tmp"  # a dead PID in a temp-like name
    cache = ShardCache(userdir, cap_bytes=2000)
    cache.root.mkdir(parents=True)
    own = cache.root / "mine.txt"
    own_draft = cache.root / ".draft.4000000.abcdef12.tmp"
    for path in (notes, draft, own, own_draft):
        path.write_bytes(b"u" * 3000)
        os.utime(path, (time.time() - 6 * 365 * 86400,) * 2)
    store = open_store(uri, moto_endpoint)
    for info in manifest.splits["train"][:2]:
        assert cache.path(store, info).read_bytes() == (src / info.name).read_bytes()
    assert cache.root == userdir / "sparknet-shards"
    assert all(p.read_bytes() == b"u" * 3000 for p in (notes, draft, own, own_draft))
    cached = [p.name for p in cache.root.iterdir() if p.name.endswith("train-000001.tar")]
    assert len(cached) == 1 and not any(cache.root.glob("*train-000000.tar"))


def test_a_rerun_aborts_the_multipart_uploads_a_killed_upload_left(
    moto_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kill -9` mid-file leaves parts S3 bills until aborted: stale ones of the new manifest's
    shards and of the old manifest's dropped ones are aborted; another prefix's, and a young one
    (maybe another machine's live upload), are not."""
    from datetime import timedelta

    from sparknet.data import transfer

    src = tmp_path / "ds"
    make_dataset(src, {"train": [1000, 1000, 1000], "val": [500]})
    uri = f"s3://{bucket}/ds"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    s3c = boto3.client("s3", endpoint_url=moto_endpoint)

    def start(*keys: str) -> None:
        for key in keys:
            started = s3c.create_multipart_upload(Bucket=bucket, Key=key)
            s3c.upload_part(Bucket=bucket, Key=key, UploadId=started["UploadId"], PartNumber=1,
                            Body=b"x" * 1000)  # fmt: skip

    def unfinished() -> list[str]:
        return sorted(
            u["Key"] for u in s3c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        )

    start("ds/train-000001.tar", "ds/train-000002.tar", "other/train-000001.tar")
    # moto reports one fixed `Initiated` date for every multipart upload (2010): "now" is set
    # a minute after it to make them young, then left real to make them hours old
    initiated = s3c.list_multipart_uploads(Bucket=bucket)["Uploads"][0]["Initiated"]
    with monkeypatch.context() as young:
        young.setattr(transfer, "_now", lambda: initiated + timedelta(minutes=1))
        upload_dataset(src, uri, endpoint_url=moto_endpoint)  # maybe another machine's: kept
    assert unfinished() == ["ds/train-000001.tar", "ds/train-000002.tar", "other/train-000001.tar"]
    for name in ("train-000002.tar", MANIFEST_NAME):
        (src / name).unlink()
    make_dataset(src, {"train": [1500, 1500], "val": [900]})  # drops train-000002.tar
    report = upload_dataset(src, uri, endpoint_url=moto_endpoint)
    assert report.removed == ["train-000002.tar"]
    assert unfinished() == ["other/train-000001.tar"]


def test_an_upload_of_a_reshard_into_fewer_shards_removes_the_old_extra_ones(
    moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    src = tmp_path / "ds"
    make_dataset(src, {"train": [1000, 1000, 1000], "val": [500, 500]})
    uri = f"s3://{bucket}/ds"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    s3c = boto3.client("s3", endpoint_url=moto_endpoint)
    s3c.put_object(Bucket=bucket, Key="ds/notes.txt", Body=b"the user's own")
    for name in ("train-000002.tar", "val-000001.tar", MANIFEST_NAME):
        (src / name).unlink()
    make_dataset(src, {"train": [1500, 1500], "val": [900]})
    report = upload_dataset(src, uri, endpoint_url=moto_endpoint)
    assert report.removed == ["train-000002.tar", "val-000001.tar"]
    assert keys(moto_endpoint, bucket) == {
        f"ds/{n}" for n in ("train-000000.tar", "train-000001.tar", "val-000000.tar",
                            MANIFEST_NAME, "notes.txt")
    }  # fmt: skip
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_upload_deletes_only_old_shards_sparknet_wrote_never_the_users_objects(
    moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """Names like shards under the prefix (or at the bucket root) that carry no sha256 metadata,
    or belong to no split of the manifest, are the user's: listed, never deleted."""
    src = tmp_path / "ds"
    make_dataset(src, {"train": [1000, 1000], "val": [500]})
    s3c = boto3.client("s3", endpoint_url=moto_endpoint)
    users = ["mix/imagenet-000000.tar", "mix/backup-000001.tar", "mix/train-000007.tar"]
    for key in [*users, "rootlogs-000001.tar"]:
        s3c.put_object(Bucket=bucket, Key=key, Body=b"user data")
    tagged_stray = "mix/train-000009.tar"  # sparknet's metadata, its split: an old shard
    s3c.put_object(Bucket=bucket, Key=tagged_stray, Body=b"x", Metadata={"sha256": "ab" * 32})
    report = upload_dataset(src, f"s3://{bucket}/mix", endpoint_url=moto_endpoint)
    assert report.removed == ["train-000009.tar"]
    assert report.left == ["backup-000001.tar", "imagenet-000000.tar", "train-000007.tar"]
    report = upload_dataset(src, f"s3://{bucket}", endpoint_url=moto_endpoint)
    assert report.removed == [] and report.left == ["rootlogs-000001.tar"]
    left = keys(moto_endpoint, bucket)
    assert {*users, "rootlogs-000001.tar"} <= left and tagged_stray not in left
    for key in users:
        assert s3c.get_object(Bucket=bucket, Key=key)["Body"].read() == b"user data"


def _deny(operation: str, key_part: str = "") -> Callable[[], None]:
    """Make the shared client's `operation` (on keys containing `key_part`) answer 403
    AccessDenied, as S3 does for a policy without that permission; the returned function undoes
    it. moto's server enforces no IAM policy unless the whole server is switched to it, so only
    this answer is faked, on the real client; every other call still goes to moto."""
    from botocore.awsrequest import AWSResponse

    client = s3.client(os.environ["AWS_ENDPOINT_URL"])

    def answer(params: dict, **_: object) -> tuple[AWSResponse, dict] | None:
        if key_part not in params.get("url_path", ""):
            return None
        error = {"Code": "AccessDenied", "Message": "Access Denied"}
        return AWSResponse("", 403, {}, None), {
            "Error": error,
            "ResponseMetadata": {"HTTPStatusCode": 403},
        }

    event = f"before-call.s3.{operation}"
    client.meta.events.register(event, answer)
    return lambda: client.meta.events.unregister(event, answer)


def test_an_upload_that_may_not_delete_old_shards_succeeds_and_names_them(
    moto_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    src = tmp_path / "ds"
    make_dataset(src, {"train": [1000, 1000, 1000], "val": [500]})
    uri = f"s3://{bucket}/y"
    upload_dataset(src, uri, endpoint_url=moto_endpoint)
    for name in ("train-000002.tar", MANIFEST_NAME):
        (src / name).unlink()
    make_dataset(src, {"train": [1500, 1500], "val": [900]})
    undo = _deny("DeleteObject", "train-000002.tar")
    try:
        for _ in range(2):  # the upload, then a re-run of the complete dataset
            report = upload_dataset(src, uri, endpoint_url=moto_endpoint)
            assert report.removed == []
            [warning] = report.warnings
            assert "train-000002.tar" in warning and "denied" in warning and "\n" not in warning
    finally:
        undo()
    assert "y/train-000002.tar" in keys(moto_endpoint, bucket)
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_an_upload_without_permission_to_list_multipart_uploads_warns_and_goes_on(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest]
) -> None:
    src, _ = dataset
    uri = f"s3://{bucket}/x"
    undo = _deny("ListMultipartUploads")
    try:
        report = upload_dataset(src, uri, endpoint_url=moto_endpoint)
    finally:
        undo()
    assert len(report.uploaded) == 6
    [warning] = report.warnings
    assert "s3:ListBucketMultipartUploads" in warning and f"s3://{bucket}/x/" in warning
    assert verify_dataset(uri, endpoint_url=moto_endpoint).problems == []


def test_upload_and_shard_exclude_each_other_on_the_dataset_dir(
    moto_endpoint: str, bucket: str, dataset: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """A `data shard` rewriting a shard between upload's hash and its send would put other bytes
    under the manifest's sha256: an upload is refused while a shard run holds the dir, and a
    shard run is refused while an upload reads it."""
    import fcntl

    from sparknet.data.shards import LOCK_NAME, reading_lock, write_dataset
    from tests.imagenet_tree import make_tree

    src, _ = dataset
    with open(src / LOCK_NAME, "w") as held:  # what a running `data shard` holds
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SparknetError) as info:
            upload_dataset(src, f"s3://{bucket}/ds", endpoint_url=moto_endpoint)
    assert_one_line(info.value, "`sparknet data shard` is writing into", str(src))
    assert keys(moto_endpoint, bucket) == set()
    make_tree(tmp_path / "tree", classes=2, train_per_class=2, val_per_class=1, size=(32, 24))
    with reading_lock(src), pytest.raises(SparknetError) as info:
        write_dataset(tmp_path / "tree", src, shard_bytes=1 << 20, seed=0, processes=1)
    assert_one_line(info.value, "`data upload` is using", str(src))
    assert upload_dataset(src, f"s3://{bucket}/ds", endpoint_url=moto_endpoint).uploaded
