"""What a run dir allows next: a failed first round, a resume with changed settings, a fault
that no retry can heal. Real local Spark (local[2,2]), small runs."""

from __future__ import annotations

import warnings

import pytest
import yaml

from sparknet.config import TrainConfig, load_train_config
from sparknet.errors import SparknetError
from sparknet.training import checkpoint
from sparknet.training.driver import train
from sparknet.training.report import read_metrics
from sparknet.training.rundir import RunDir, ran_transport, read_run_config
from tests.helpers import failed_tasks

pytestmark = pytest.mark.integration

SMALL = {"model": "mlp", "workers": 2, "tau": 1, "batch_size": 8, "eval_every": 0}


def test_an_unhealable_fault_fails_at_once_and_the_dir_can_start_over(spark, tmp_path):
    sc = spark.sparkContext
    out = tmp_path / "run"
    bad = TrainConfig(
        data="tests.helpers:unhealable_digits", num_classes=10, rounds=3, out=out, **SMALL
    )
    sc.setJobGroup("unhealable", "a dataset whose samples cannot heal")
    try:
        with pytest.raises(SparknetError, match=r"^sample \d+ differs from the manifest$"):
            train(bad, spark=spark)
    finally:
        sc.setJobGroup("after", "")
    tracker = sc.statusTracker()
    # round 1 only (the Python workers probe runs in its own job group, and a local master has
    # no anchor job); nothing after (no eval, no round 2)
    assert len(tracker.getJobIdsForGroup("unhealable")) == 1
    assert failed_tasks(sc, "unhealable") == 0  # handed back in band: Spark retried nothing
    assert (out / "config.yaml").is_file() and read_metrics(out) == []

    # a resume of a dir with its settings and no checkpoint starts the run over with them:
    # it meets the same fault, in the same one line
    with pytest.raises(SparknetError, match=r"^sample \d+ differs from the manifest$"):
        train(bad, resume=True, spark=spark)
    result = train(TrainConfig(rounds=1, out=out, **SMALL), spark=spark)
    assert [r["round"] for r in result.metrics] == [1]
    assert (out / "model.safetensors").is_file()


def test_resume_refuses_a_changed_trajectory_unless_allowed(spark, tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(rounds=2, checkpoint_every=0, out=out, **SMALL), spark=spark)

    def resumed(**flags) -> TrainConfig:
        return load_train_config(base=read_run_config(out), flags=flags, environ={})

    with pytest.raises(SparknetError) as exc:
        train(resumed(rounds=3, workers=3, lr=0.1), resume=True, spark=spark)
    assert str(exc.value) == (
        f"resuming {out} would change workers 2 -> 3, lr 0.05 -> 0.1, so it would no longer equal "
        "an uninterrupted run; drop the change, or pass --allow-change to continue anyway"
    )
    assert [r["round"] for r in read_metrics(out)] == [1, 2]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(resumed(rounds=3, workers=3), resume=True, spark=spark, allow_change=True)
    # the third partition has no stored inner state: expected with a changed worker count
    assert not [w for w in caught if "inner optimizer state" in str(w.message)]
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3] == [r["round"] for r in result.metrics]
    assert rows[2]["resumed_with_changes"] == {"workers": {"stored": 2, "now": 3}}
    assert 2 in rows[2]["inner_state_missed"]
    assert "resumed_with_changes" not in rows[1]
    assert "workers: 3" in (out / "config.yaml").read_text()


def test_an_interrupted_allow_change_resume_keeps_the_stored_settings(spark, tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(rounds=1, checkpoint_every=0, out=out, **SMALL), spark=spark)
    changed = load_train_config(
        base=read_run_config(out), flags={"rounds": 3, "lr": 0.1}, environ={}
    )

    def interrupt(row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # after round 2, before any checkpoint at lr 0.1
        train(changed, resume=True, spark=spark, allow_change=True, on_round=interrupt)
    assert read_run_config(out)["lr"] == 0.05
    assert "lr: 0.05" in (out / "config.yaml").read_text()
    with pytest.raises(SparknetError, match=r"would change lr 0\.05 -> 0\.1"):
        train(changed, resume=True, spark=spark)

    train(changed, resume=True, spark=spark, allow_change=True)
    rows = read_metrics(out)
    assert rows[1]["resumed_with_changes"] == {"lr": {"stored": 0.05, "now": 0.1}}
    assert read_run_config(out)["lr"] == 0.1
    assert "lr: 0.1" in (out / "checkpoints" / "round-00003" / "config.yaml").read_text()


def test_a_signal_while_spark_stops_after_the_last_round_is_no_failure(
    spark, tmp_path, monkeypatch
):
    """The run's own session is the shared one here, and stopping it is replaced by what a
    Ctrl-C at that moment does (the handler raises KeyboardInterrupt): a mock, since the real
    signal cannot be timed to land inside `SparkSession.stop`."""
    from sparknet.training import driver

    def interrupted_stop(session):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "start_session", lambda *args: spark)
    monkeypatch.setattr(driver, "stop_quietly", interrupted_stop)
    out = tmp_path / "run"
    result = train(TrainConfig(rounds=1, out=out, **SMALL))
    assert [r["round"] for r in result.metrics] == [1]
    assert (out / "model.safetensors").is_file() and (out / "curves.png").is_file()


def test_a_resume_that_changes_the_inner_optimizer_misses_without_a_warning(spark, tmp_path):
    """sgd -> adamw: the stored states cannot be used, so every partition misses in the first
    resumed round, as asked: counted and named, but no warning."""
    out = tmp_path / "run"
    train(TrainConfig(rounds=1, out=out, momentum=0.9, **SMALL), spark=spark)
    changed = load_train_config(
        base=read_run_config(out), flags={"rounds": 2, "optimizer": "adamw"}, environ={}
    )
    warned: list[str] = []
    result = train(changed, resume=True, spark=spark, allow_change=True, on_warning=warned.append)
    assert result.metrics[1]["inner_state_missed"] == [0, 1] and warned == []


def test_a_published_checkpoint_already_has_its_metrics_row(spark, tmp_path, monkeypatch):
    """A kill right after a checkpoint's manifest must not lose that round's row (a resume keeps
    rows up to its checkpoint): at each publication the row is in metrics.jsonl already."""
    from sparknet.training import checkpoint

    real_write = checkpoint.write
    rows_when_published: dict[int, list[int]] = {}

    def write(store, rounds, *args, **kwargs):
        rows_when_published[rounds] = [r["round"] for r in read_metrics(store)]
        return real_write(store, rounds, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "write", write)
    out = tmp_path / "run"
    train(TrainConfig(rounds=2, checkpoint_every=1, out=out, **SMALL), spark=spark)
    assert rows_when_published == {1: [1], 2: [1, 2]}


def _stored_run(out, train_section: dict, checkpoint_section: dict | None = None) -> None:
    """A run dir's files as a run writes them: config.yaml, and a complete checkpoint (its
    manifest and config) where `checkpoint_section` is given."""
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump({"train": train_section}))
    if checkpoint_section is not None:
        at = out / checkpoint.name(2)
        at.mkdir(parents=True)
        (at / checkpoint.CONFIG).write_text(yaml.safe_dump({"train": checkpoint_section}))
        (at / checkpoint.MANIFEST).write_text("{}")


def test_a_tau_auto_run_from_before_tau_max_resumes_with_the_bound_it_ran_with(tmp_path):
    """Its chooser was bounded at 1000 then: a resume with today's default of 100 would clamp its
    tau, unrecorded; the stored settings say 1000, so only an --allow-change lowers it."""
    _stored_run(tmp_path / "old", {"tau": "auto", "tau_share": 0.1})
    stored = read_run_config(tmp_path / "old")
    assert stored["tau_max"] == 1000
    resumed = load_train_config(base=stored, flags={"rounds": 40}, environ={})
    assert resumed.tau_max == 1000
    assert resumed.trajectory_changes(TrainConfig(**stored)) == {}
    today = TrainConfig(tau="auto")
    assert today.trajectory_changes(TrainConfig(**stored)) == {"tau_max": (1000, 100)}
    _stored_run(tmp_path / "fixed", {"tau": 20})
    assert "tau_max" not in read_run_config(tmp_path / "fixed")
    _stored_run(tmp_path / "new", {"tau": "auto", "tau_max": 60})
    assert read_run_config(tmp_path / "new")["tau_max"] == 60


def test_the_transport_that_ran_is_read_where_the_resumed_settings_are(tmp_path):
    """The checkpoint's config.yaml first (the run dir's is rewritten by every attempt as it
    starts: an interrupted resume on another transport must not become the record), the run
    dir's where the checkpoint lost its own."""
    _stored_run(tmp_path / "a", {"transport": "spark"}, {"transport": "allreduce"})
    assert ran_transport(RunDir.open(str(tmp_path / "a")).store) == "allreduce"
    _stored_run(tmp_path / "b", {"transport": "allreduce"}, {"transport": "spark"})
    (tmp_path / "b" / checkpoint.name(2) / checkpoint.CONFIG).unlink()
    assert ran_transport(RunDir.open(str(tmp_path / "b")).store) == "allreduce"
    _stored_run(tmp_path / "c", {}, {"transport": "auto"})  # not a transport that ran
    assert ran_transport(RunDir.open(str(tmp_path / "c")).store) is None
    _stored_run(tmp_path / "d", {"transport": "allreduce"}, {"transport": "allreduce"})
    (tmp_path / "d" / checkpoint.name(2) / checkpoint.CONFIG).write_bytes(b"\xff")
    assert ran_transport(RunDir.open(str(tmp_path / "d")).store) is None


def test_a_bad_stored_value_is_named_with_the_file_it_is_in(tmp_path):
    """A resume's settings come from the newest checkpoint's config.yaml, not the run dir's:
    the error names that file, so the user edits the one that is read; a value the resume
    overrides is no fault of the file."""
    _stored_run(tmp_path / "r", {"tau": 5}, {"tau": 0})
    stored = read_run_config(tmp_path / "r")
    at = f"{tmp_path / 'r'}/{checkpoint.name(2)}/{checkpoint.CONFIG}"
    assert stored.where == at
    with pytest.raises(SparknetError) as exc:
        load_train_config(base=stored, flags={"rounds": 4}, environ={})
    assert str(exc.value).startswith(f"{at}: invalid setting tau:")
    with pytest.raises(SparknetError) as exc:
        load_train_config(base=stored, flags={"tau": 3, "lr": -1.0}, environ={})
    assert str(exc.value).startswith("invalid setting lr:")
    assert load_train_config(base=stored, flags={"tau": 3}, environ={}).tau == 3
