"""`sparknet bench sync` on tiny settings, as a user runs it (a subprocess, output to files)."""

from __future__ import annotations

import csv
import json
import subprocess

import pytest

from tests.conftest import REPO, SPARKNET

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_sync_measures_both_transports_against_gloo_and_writes_its_files(tmp_path):
    out = tmp_path / "bench"
    log = tmp_path / "log"
    with log.open("w") as fh:
        proc = subprocess.run(
            [str(SPARKNET), "bench", "sync", "--sizes-mb", "0.2", "--rounds", "2", "--out",
             str(out)],
            cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=300,
        )  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    doc = json.loads((out / "sync.json").read_text())
    rows = doc["rows"]
    assert [r["transport"] for r in rows] == ["spark", "allreduce"]
    for row in rows:
        assert 0.15 < row["size_mb"] < 0.25
        assert row["sync_s"] > 0 and row["gloo_s"] > 0
        assert row["ratio"] == pytest.approx(row["sync_s"] / row["gloo_s"])
    # what travels through PySpark's task results costs more than what the workers exchange
    assert rows[0]["sync_s"] > rows[1]["sync_s"]
    # a spark round is one job: the floor its report names, measured in the same session
    job_s = doc["empty_job_s"]
    assert 0 < job_s < 5
    assert f"an empty Spark job of the same tasks: {job_s:.3f} s" in " ".join(text.split())
    with (out / "sync.csv").open() as fh:
        assert [r["transport"] for r in csv.DictReader(fh)] == ["spark", "allreduce"]
    assert (out / "sync.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "runs").exists() or not any((out / "runs").iterdir())
    assert "wrote" in text and "sync.json" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes-mb", "x"], "--sizes-mb takes numbers separated by commas, got 'x'"),
        (["--sizes-mb", "5,"], "--sizes-mb takes numbers separated by commas, got '5,'"),
        (["--sizes-mb", "0"], "--sizes-mb takes numbers > 0, got '0'"),
        (["--sizes-mb", "5,1,5"], "--sizes-mb lists 5 more than once"),
        (["--transports", "mpi"], "--transports takes any of spark, allreduce, got 'mpi'"),
        (["--rounds", "0"], "--rounds takes a whole number >= 1, got 0"),
    ],
)
def test_sync_refuses_bad_options_in_one_line(tmp_path, args, message):
    proc = subprocess.run(
        [str(SPARKNET), "bench", "sync", *args, "--out", str(tmp_path / "b")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "b").exists()
