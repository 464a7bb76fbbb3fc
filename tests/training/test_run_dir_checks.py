"""What `train` refuses about its run dir before Spark starts: a dir in use by another run, a dir
that is not a sparknet run's, an --out it cannot create. No Spark: each fails before it starts
(a test that reached Spark would start a session of its own and fail on its missing data)."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import torch

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
    out = tmp_path / "runs" / "new"
    with pytest.raises(SparknetError):
        train(TrainConfig(out=out, data="no-such-dataset-name", **SMALL))
    assert not (tmp_path / "runs").exists()


def test_resume_of_a_run_cut_after_its_last_checkpoint_finishes_it_without_spark(tmp_path):
    """An interrupt between the last checkpoint and the final files left model.safetensors and
    curves.png out; --resume writes them from that checkpoint, with no Spark (none is given, and
    one started here would fail the test by its time alone)."""
    from safetensors.torch import load_file

    from sparknet.data.store import LocalStore
    from sparknet.training import checkpoint
    from sparknet.training.state import StateLayout
    from tests.helpers import initial_model

    cfg = TrainConfig(out=tmp_path, rounds=2, **SMALL)
    state = initial_model(cfg).state_dict()
    layout = StateLayout.of(state)
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    row = {"round": 2, "loss": 1.0, "samples": 16, "seconds": {"total": 1.0}, "elapsed_s": 2.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({**row, "round": 1}) + "\n")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    flat = layout.flatten(state)
    last = tmp_path / checkpoint.write(
        LocalStore(tmp_path), 2, layout, flat, layout.integers(state), None, 2.0, cfg.to_yaml()
    )

    result = train(cfg, resume=True)
    assert [r["round"] for r in result.metrics] == [1, 2]
    model = load_file(tmp_path / "model.safetensors")
    assert model.keys() == state.keys()
    assert all(torch.equal(model[k], v) for k, v in load_file(last / "weights.safetensors").items())
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_resume_changes_that_change_nothing_for_the_data_are_not_changes():
    """digits: 10 classes from the dataset, and no images to crop: `--num-classes 10` and
    `--image-size 32` on a resume are what ran already; `--lr` is a change."""
    from sparknet.data.sources import resolve_source
    from sparknet.training.driver import _changes_that_matter
    from sparknet.training.problem import prepare

    cfg = TrainConfig(data="digits", **SMALL)
    problem = prepare(cfg, resolve_source(cfg, None))
    changes = {"num_classes": (None, 10), "image_size": (64, 32), "lr": (0.05, 0.1)}
    assert _changes_that_matter(changes, problem) == {"lr": (0.05, 0.1)}
    assert _changes_that_matter({"num_classes": (None, 7)}, problem) == {"num_classes": (None, 7)}


@pytest.mark.parametrize(
    ("rounds", "damage"),
    [(2, {"weights.safetensors": b"not safetensors"}), (3, {"state.json": b""})],
)
def test_a_damaged_checkpoint_is_one_error_naming_it_and_nothing_is_copied(
    tmp_path, rounds, damage
):
    """A resume from a checkpoint whose files do not parse names it and says what to do (before
    Spark: none is given here); garbage weights never become model.safetensors."""
    from sparknet.data.store import LocalStore
    from sparknet.training import checkpoint
    from sparknet.training.state import StateLayout
    from tests.helpers import initial_model

    cfg = TrainConfig(out=tmp_path, rounds=rounds, **SMALL)
    state = initial_model(cfg).state_dict()
    layout = StateLayout.of(state)
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    flat = layout.flatten(state)
    last = tmp_path / checkpoint.write(
        LocalStore(tmp_path), 2, layout, flat, layout.integers(state), None, 2.0, cfg.to_yaml()
    )
    for file, data in damage.items():
        (last / file).write_bytes(data)
    with pytest.raises(SparknetError) as exc:
        train(cfg, resume=True)
    (file,) = damage
    assert str(exc.value).startswith(f"checkpoint {last} is damaged ({file}: ")
    assert str(exc.value).endswith("delete that checkpoint dir to resume from the one before it")
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "model.safetensors").exists()


def test_the_summary_names_the_rounds_time_training_time():
    """elapsed_s counts the rounds only (not Spark's start-up): the summary must not call it
    wall time."""
    from rich.console import Console

    from sparknet.cli.train import _summary
    from sparknet.training.driver import RunResult

    row = {"round": 1, "loss": 1.0, "samples": 16, "seconds": {"total": 2.0}, "elapsed_s": 2.5}
    console = Console(width=100, record=True)
    console.print(_summary(RunResult("runs/x", 1, [row])))
    text = console.export_text()
    assert "training time" in text and "2.5 s" in text and "wall time" not in text
