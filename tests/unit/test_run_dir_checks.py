"""What `train` refuses about its run dir before Spark starts: a dir in use by another run, a dir
that is not a sparknet run's, an --out it cannot create. No Spark: each fails before it starts
(a test that reached Spark would start a session of its own and fail on its missing data)."""

from __future__ import annotations

import fcntl
import os

import pytest

from sparknet.config import TrainConfig
from sparknet.errors import SparknetError
from sparknet.training.driver import train

SMALL = {"model": "mlp", "workers": 2, "tau": 1, "batch_size": 8, "eval_every": 0}


def test_a_second_run_with_the_same_out_refuses_before_writing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)  # a first run holds the dir
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SparknetError, match=f"^another sparknet run is using {out};"):
            train(TrainConfig(out=out, **SMALL))
    finally:
        os.close(fd)
    assert list(out.iterdir()) == []


def test_a_dir_that_is_not_a_run_is_never_overwritten(tmp_path):
    (tmp_path / "config.yaml").write_text("db:\n  password: x\n")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SparknetError, match="is not empty and is not a sparknet run dir"):
        train(TrainConfig(out=tmp_path, **SMALL))
    assert (tmp_path / "config.yaml").read_text() == "db:\n  password: x\n"

    # a run's config beside a file no run writes: refused too
    (tmp_path / "config.yaml").write_text(TrainConfig(out=tmp_path, **SMALL).to_yaml())
    with pytest.raises(SparknetError, match="is not empty and is not a sparknet run dir"):
        train(TrainConfig(out=tmp_path, **SMALL))


def test_an_out_that_cannot_be_made_fails_in_one_line_and_a_made_dir_is_removed(tmp_path):
    with pytest.raises(SparknetError, match=r"^--out /proc/sparknet-probe: cannot create it: "):
        train(TrainConfig(out="/proc/sparknet-probe", **SMALL))
    out = tmp_path / "new"
    with pytest.raises(SparknetError):
        train(TrainConfig(out=out, data="no-such-dataset-name", **SMALL))
    assert not out.exists()
