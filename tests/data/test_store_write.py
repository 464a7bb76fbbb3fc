"""Writing through a Store, as run dirs do: the same behaviour from a local dir and from S3
(moto's server)."""

from __future__ import annotations

import pytest

from sparknet.data.store import LocalStore, MissingObjectError, S3Store, open_store
from sparknet.errors import SparknetError


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "run")
    bucket = request.getfixturevalue("bucket")
    return S3Store(f"s3://{bucket}/runs/r")


def test_write_walk_entries_and_delete_agree_locally_and_on_s3(store):
    assert store.walk() == {} and store.entries() == set()
    store.write_bytes("config.yaml", b"a")
    store.write_bytes("checkpoints/round-00001/inner/partition-00000.pt", b"bc")
    store.write_bytes("checkpoints/round-00001/state.json", b"{}")
    store.write_bytes("config.yaml", b"new")  # replaced whole
    assert store.read_bytes("config.yaml") == b"new"
    assert store.walk() == {
        "config.yaml": 3,
        "checkpoints/round-00001/inner/partition-00000.pt": 2,
        "checkpoints/round-00001/state.json": 2,
    }
    assert store.entries() == {"config.yaml", "checkpoints"}
    assert store.entries("checkpoints/round-00001/") == {"inner", "state.json"}
    assert store.walk("checkpoints/") == {
        k: v for k, v in store.walk().items() if k.startswith("checkpoints/")
    }
    store.delete(["checkpoints/round-00001/state.json", "not-there"])
    assert store.size("checkpoints/round-00001/state.json") is None
    store.delete_prefix("checkpoints/")
    assert store.walk() == {"config.yaml": 3}
    with pytest.raises(MissingObjectError):
        store.read_bytes("checkpoints/round-00001/inner/partition-00000.pt")


def test_a_local_write_leaves_no_temp_and_can_refuse_a_missing_dir(tmp_path):
    store = LocalStore(tmp_path)
    store.write_bytes("a/b.bin", b"x")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]
    with pytest.raises(FileNotFoundError):  # an abandoned checkpoint dir is never recreated
        store.write_bytes("gone/b.bin", b"x", parents=False)
    assert not (tmp_path / "gone").exists()


def test_an_s3_write_to_a_missing_bucket_is_one_line(moto_endpoint):
    store = open_store("s3://no-such-bucket-w/runs/r")
    with pytest.raises(SparknetError, match=r"^bucket no-such-bucket-w does not exist; create it"):
        store.write_bytes("config.yaml", b"a")
