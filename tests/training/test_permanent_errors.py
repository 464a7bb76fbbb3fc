"""A permanent fault is never retried: a full disk, a read-only file system or a permission ends
the run at once in one line that names the path and what to fix, with nothing half-written left;
only a transient one (a dropped connection, a lost executor) is worth another try. Real small
file systems: a tmpfs of a few pages, a read-only bind mount (root, as in CI)."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sparknet.data.store import LocalStore
from sparknet.errors import (
    PermanentTaskError,
    WriteRefused,
    is_permanent,
    is_permanent_text,
)
from sparknet.processes import alive
from sparknet.training import checkpoint
from sparknet.training.transport import SparkTransport
from tests.cli.test_cli_end_to_end import descendants
from tests.conftest import REPO, SPARKNET
from tests.helpers import failed_tasks

#: the tests that mount a small disk (CI runs as root)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small disk needs root")


@contextlib.contextmanager
def _mounted(where: Path, *options: str) -> Iterator[Path]:
    """`mount *options` at `where`, unmounted again whatever happens."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *options, str(where)], check=True, capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def _small_disk(where: Path, size: str) -> contextlib.AbstractContextManager[Path]:
    return _mounted(where, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


def test_permanent_and_transient_faults_are_told_apart_in_one_place():
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
        assert is_permanent(OSError(code, os.strerror(code)))
    for exc in (ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError(), OSError("?")):
        assert not is_permanent(exc)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("saving the inner state failed") from exc
    except RuntimeError as wrapped:
        assert is_permanent(wrapped)  # what caused it decides
    assert is_permanent(PermanentTaskError("shard 3: sha256 differs"))
    # a rank's failure as the driver sees it: a Python traceback inside a Py4J error
    assert is_permanent_text("  File ...\nOSError: [Errno 28] No space left on device\n")
    assert is_permanent_text("sparknet.errors.WriteRefused: /x is full (No space left ...")
    assert not is_permanent_text("ConnectionResetError: [Errno 104] Connection reset by peer")
    assert not is_permanent_text("org.apache.spark.SparkException: ExecutorLostFailure")


@needs_root
def test_a_run_dir_write_a_full_or_read_only_disk_refuses_is_one_line(tmp_path):
    with _small_disk(tmp_path / "small", "64k") as small:
        store = LocalStore(small / "run")
        with pytest.raises(WriteRefused) as full:
            store.write_bytes("checkpoints/round-00003/weights.safetensors", b"w" * (256 << 10))
        assert str(full.value) == (
            f"{small}/run is full (No space left on device) writing "
            "checkpoints/round-00003/weights.safetensors: free space or use another --out"
        )
        assert not list((small / "run" / "checkpoints" / "round-00003").iterdir())  # no temp
    kept = tmp_path / "kept"
    kept.mkdir()
    read_only = r"is on a read-only file system .* writable --out"
    with (
        _mounted(kept, "--bind", str(kept)),
        _mounted(kept, "-o", "remount,ro,bind"),
        pytest.raises(WriteRefused, match=read_only),
    ):
        LocalStore(kept).write_bytes("metrics.jsonl", b"{}\n")


def _fill(where: str, theta, partition, attempt, threads, local_dir, rows):
    """A task whose file the disk has no room for (partition 1's)."""
    if partition == 1:
        Path(where, f"inner-{partition}.pt").write_bytes(b"s" * (256 << 10))
    return theta


@needs_root
@pytest.mark.integration
def test_a_full_disk_in_a_task_fails_the_round_unretried(sc, tmp_path):
    """local[2,2] retries a failed task once; a write the disk refused is not retried."""
    with _small_disk(tmp_path / "small", "64k") as small:
        sc.setJobGroup("full-disk", "a task whose disk is full")
        try:
            with pytest.raises(PermanentTaskError, match=r"\[Errno 28\] No space left on device"):
                SparkTransport(sc, 2).map_reduce(
                    np.zeros(2, np.float32), functools.partial(_fill, str(small)), np.add
                )
        finally:
            sc.setJobGroup("after", "")
    assert failed_tasks(sc, "full-disk") == 0


@needs_root
@pytest.mark.slow
@pytest.mark.integration
def test_a_full_run_dir_ends_an_allreduce_run_at_once_in_one_line(tmp_path):
    """Room for the first round's checkpoint, not the second's: the run used to restart its
    stage three times (~90 s) before saying so; now the first refusal ends it, exit 2, with
    no incomplete checkpoint left and nothing running."""
    with _small_disk(tmp_path / "small", "320k") as small:
        out = small / "run"
        proc = subprocess.Popen(
            [str(SPARKNET), "train", "--data", "digits", "--model", "mlp", "--workers", "2",
             "--tau", "2", "--rounds", "4", "--checkpoint-every", "1",
             "--transport", "allreduce", "--out", str(out)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        seen: dict[int, str] = {}
        try:
            while proc.poll() is None:
                seen.update(descendants(proc.pid))
                time.sleep(0.1)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
        lines = err.splitlines()
        assert proc.returncode == 2, err
        errors = [ln for ln in lines if ln.startswith("error:")]
        assert len(errors) == 1 and lines[-1] == errors[0], err
        assert f"{out}/checkpoints/round-00002 is full (No space left on device) writing " in (
            errors[0]
        ) and errors[0].endswith(": free space or use another --out"), err
        assert not [ln for ln in lines if "the allreduce stage failed" in ln], err
        entries = sorted((out / "checkpoints").iterdir())
        assert [p.name for p in entries] == ["round-00001"], entries
        assert (entries[0] / checkpoint.MANIFEST).exists()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in seen):
        time.sleep(0.2)
    assert not [cmd for pid, cmd in seen.items() if alive(pid)]
