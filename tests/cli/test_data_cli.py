"""`sparknet data ...` on bad input and interruption: one `error:` line on stderr (no traceback,
no progress frame when stderr is not a terminal: plain progress lines only), exit 2 (130 on
Ctrl-C). Real subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import SPARKNET
from tests.imagenet_tree import make_tree


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SPARKNET), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    make_tree(root / "tree", classes=2, train_per_class=3, val_per_class=2, size=(32, 24))
    (root / "afile").write_text("not a directory")
    return root


def assert_one_error_line(done: subprocess.CompletedProcess, needle: str, rc: int = 2) -> None:
    lines = done.stderr.splitlines()
    assert done.returncode == rc and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("dest", "needle"),
    [
        ("afile", "afile, or a directory above it, is a file"),
        ("afile/sub", "is a file: give a directory"),
        ("/proc/nope", "cannot write /proc/nope"),
    ],
)
def test_a_destination_that_cannot_be_written_is_one_line(tree, dest, needle):
    assert_one_error_line(run("data", "shard", "tree", dest, cwd=tree), needle)


def test_ctrl_c_during_a_process_pool_prints_one_line(tmp_path):
    """Ctrl-C goes to the whole foreground process group, pool workers included: they ignore it
    and leave the one line to the parent."""
    make_tree(tmp_path / "tree", classes=4, train_per_class=40, val_per_class=2, size=(64, 48))
    proc = subprocess.Popen(
        [str(SPARKNET), "data", "shard", "tree", "ds", "--processes", "2", "--shard-mb", "1"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 60
    while len(children.read_text().split()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the pool's workers are up once the parent has 2+ children
    time.sleep(0.2)  # let them start importing
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    # the progress lines a log gets (no terminal here), then the one error line, no traceback
    *progress, last = err.splitlines()
    assert last == "error: interrupted; run the same command again to resume", err
    assert all(line.startswith(("check: ", "write: ")) for line in progress), err


def test_a_dataset_entry_endpoint_without_a_scheme_names_the_settings_file(tmp_path):
    (tmp_path / "sparknet.yaml").write_text(
        "datasets:\n  foo:\n    uri: s3://bkt/ds\n    endpoint_url: localhost:5066\n"
    )
    done = run("data", "ls", "foo", cwd=tmp_path)
    assert_one_error_line(done, "sparknet.yaml: datasets.foo: invalid setting endpoint_url")
    assert "http://HOST:PORT" in done.stderr and "'localhost:5066'" in done.stderr


def test_upload_lists_the_users_shard_like_objects_and_leaves_them(
    tmp_path: Path, moto_endpoint: str, bucket: str
) -> None:
    """The user's objects named like shards survive `data upload`, and the summary names them."""
    import boto3

    make_tree(tmp_path / "tree", classes=2, train_per_class=3, val_per_class=2, size=(32, 24))
    assert run("data", "shard", "tree", "ds", "--shard-mb", "1", cwd=tmp_path).returncode == 0
    s3c = boto3.client("s3", endpoint_url=moto_endpoint)
    for key in ("mix/imagenet-000000.tar", "mix/train-000007.tar"):
        s3c.put_object(Bucket=bucket, Key=key, Body=b"user data")
    done = run("data", "upload", "ds", f"s3://{bucket}/mix", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "old removed" not in done.stdout
    assert "not written by sparknet): imagenet-000000.tar, train-000007.tar" in done.stdout
    for key in ("mix/imagenet-000000.tar", "mix/train-000007.tar"):
        assert s3c.get_object(Bucket=bucket, Key=key)["Body"].read() == b"user data"
