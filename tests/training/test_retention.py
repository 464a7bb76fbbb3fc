"""Checkpoint retention (`keep_checkpoints`: the newest N and the best by eval accuracy, named in
best.json) and `stop_at` (the run ends at the first evaluation that reaches it): the pruning
itself on a local dir and on moto's S3, then real runs on local Spark (local[2,2]) on digits."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import boto3
import pytest
import yaml
from rich.console import Console
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

import sparknet
from sparknet.cli.train import _summary
from sparknet.config import TrainConfig, load_train_config
from sparknet.data.store import Store, open_store
from sparknet.errors import SparknetError
from sparknet.training import checkpoint
from sparknet.training.driver import RunResult, train
from sparknet.training.report import EARLY, STOPPED, MetricsLog, read_metrics, target_words
from sparknet.training.retention import BEST, Retention, best_round, read_best
from sparknet.training.rundir import read_run_config
from tests.conftest import REPO, SPARKNET
from tests.helpers import assert_state_equal

#: sgd with momentum and inner_state keep: a resume is exact only if the workers' states are too
SMALL = {
    "model": "mlp", "workers": 2, "tau": 2, "batch_size": 8, "momentum": 0.9,
    "inner_state": "keep", "eval_every": 1, "checkpoint_every": 1,
}  # fmt: skip


def _rows(accuracies: dict[int, float], rounds: int) -> list[dict]:
    return [
        {"round": r, **({"eval_accuracy": accuracies[r]} if r in accuracies else {})}
        for r in range(1, rounds + 1)
    ]


def _fake_checkpoint(store: Store, rounds: int, *, manifest: bool = True) -> None:
    """A checkpoint's files (a worker's inner state, the weights) and, when complete, its
    manifest."""
    where = checkpoint.name(rounds)
    store.write_bytes(f"{where}/inner/partition-00000.pt", b"inner")
    store.write_bytes(f"{where}/{checkpoint.WEIGHTS}", b"weights")
    if manifest:
        store.write_bytes(f"{where}/{checkpoint.MANIFEST}", b'{"rounds": %d}' % rounds)


def _dirs(store: Store) -> list[str]:
    return sorted(store.entries(f"{checkpoint.CHECKPOINTS}/"))


# ---- the pruning, without Spark ---------------------------------------------------------------


def test_the_best_is_the_highest_evaluated_checkpoint_and_the_first_of_equals():
    rows = _rows({2: 0.5, 3: 0.8, 4: 0.8, 5: 0.9, 6: 0.7}, 6)
    assert best_round(rows, [1, 2, 3, 4, 6]) == (3, 0.8)  # round 5 has no checkpoint
    assert best_round(rows, [1, 2, 3, 4, 5, 6]) == (5, 0.9)
    assert best_round(rows, [1]) is None  # round 1 was not evaluated


def _prune_keeps_the_newest_and_the_best(store: Store) -> None:
    for rounds in (1, 2, 3, 4, 5):
        _fake_checkpoint(store, rounds)
    _fake_checkpoint(store, 6, manifest=False)  # being written: never touched
    retention = Retention(store, keep=2)
    assert retention.prune(_rows({2: 0.9, 4: 0.5, 5: 0.6}, 6)) == [1, 3]
    assert _dirs(store) == ["round-00002", "round-00004", "round-00005", "round-00006"]
    assert read_best(store) == retention.best
    assert json.loads(store.read_bytes(BEST)) == {
        "round": 2, "eval_accuracy": 0.9, "checkpoint": "checkpoints/round-00002",
        "weights": "checkpoints/round-00002/weights.safetensors",
    }  # fmt: skip
    # round 6 is published and beats round 2: best.json names it before round 2 goes
    store.write_bytes(f"{checkpoint.name(6)}/{checkpoint.MANIFEST}", b"{}")
    assert retention.prune(_rows({2: 0.9, 4: 0.5, 5: 0.6, 6: 0.95}, 6)) == [2, 4]
    assert _dirs(store) == ["round-00005", "round-00006"]
    assert read_best(store).round == 6
    assert checkpoint.latest(store) == 6
    # whole checkpoints only: nothing of a deleted one is left
    assert not [k for k in store.walk(f"{checkpoint.CHECKPOINTS}/") if "round-00002" in k]


def test_a_local_dir_keeps_the_newest_complete_ones_and_the_best(tmp_path):
    _prune_keeps_the_newest_and_the_best(open_store(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == [
        "round-00005", "round-00006",
    ]  # fmt: skip


def test_an_s3_run_dir_keeps_the_newest_complete_ones_and_the_best(bucket, moto_endpoint):
    _prune_keeps_the_newest_and_the_best(open_store(f"s3://{bucket}/runs/p", moto_endpoint))


def test_keep_zero_keeps_every_checkpoint_and_still_names_the_best(tmp_path):
    store = open_store(tmp_path)
    for rounds in (1, 2, 3):
        _fake_checkpoint(store, rounds)
    assert Retention(store, keep=0).prune(_rows({1: 0.3, 2: 0.6, 3: 0.4}, 3)) == []
    assert _dirs(store) == ["round-00001", "round-00002", "round-00003"]
    assert read_best(store).round == 2


def test_stop_at_needs_evaluations_as_the_run_goes():
    with pytest.raises(SparknetError, match=r"^invalid settings: stop_at needs evaluations"):
        load_train_config(flags={"stop_at": 0.9, "eval_every": 0}, environ={})
    for bad in (0, 1.5):
        with pytest.raises(SparknetError, match=r"^invalid setting stop_at: "):
            load_train_config(flags={"stop_at": bad}, environ={})
    with pytest.raises(SparknetError, match=r"^invalid setting keep_checkpoints: "):
        load_train_config(flags={"keep_checkpoints": -1}, environ={})


def test_a_run_that_predates_retention_keeps_all_its_checkpoints_on_resume(tmp_path):
    """Its config.yaml has no keep_checkpoints: a resume deletes none unasked."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"train": {"model": "mlp"}}))
    assert read_run_config(tmp_path)["keep_checkpoints"] == 0
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"train": {"keep_checkpoints": 4}}))
    assert read_run_config(tmp_path)["keep_checkpoints"] == 4


def _leaves_what_is_no_checkpoint(store: Store) -> None:
    _fake_checkpoint(store, 1)
    _fake_checkpoint(store, 2, manifest=False)  # an interrupted write: removed
    store.write_bytes(f"{checkpoint.CHECKPOINTS}/notes.txt", b"mine")
    store.write_bytes(f"{checkpoint.CHECKPOINTS}/mine/a.txt", b"mine too")
    store.write_bytes(f"{checkpoint.CHECKPOINTS}/.round-00003.partial/w", b"an old temp dir")
    assert checkpoint.discard_incomplete(store) == [".round-00003.partial", "round-00002"]
    assert _dirs(store) == ["mine", "notes.txt", "round-00001"]
    assert store.read_bytes(f"{checkpoint.CHECKPOINTS}/notes.txt") == b"mine"


def test_a_resume_deletes_incomplete_checkpoints_only_not_a_users_file_beside_them(tmp_path):
    _leaves_what_is_no_checkpoint(open_store(tmp_path / "run"))


def test_an_s3_resume_leaves_a_users_file_under_checkpoints(bucket, moto_endpoint):
    _leaves_what_is_no_checkpoint(open_store(f"s3://{bucket}/runs/notes", moto_endpoint))


def test_the_target_reached_at_the_last_round_is_recorded_without_stopped_early():
    cfg = TrainConfig(rounds=8, stop_at=0.5, eval_every=1)
    assert checkpoint.target_marker(cfg, {"round": 8, "eval_accuracy": 0.61}, 8) == {STOPPED: 0.5}
    assert checkpoint.target_marker(cfg, {"round": 5, "eval_accuracy": 0.5}, 5) == {
        STOPPED: 0.5, EARLY: True,
    }  # fmt: skip
    assert checkpoint.target_marker(cfg, {"round": 8, "eval_accuracy": 0.4}, 8) == {}
    assert checkpoint.target_marker(cfg, {"round": 8}, 8) == {}
    last = {"round": 8, "eval_accuracy": 0.614, STOPPED: 0.5}
    assert target_words(last) == (
        "target reached", "at round 8: test accuracy 0.6140 reached the target 0.5",
    )  # fmt: skip
    early = {**last, "round": 5, EARLY: True}
    assert target_words(early) == (
        "stopped early", "round 5: test accuracy 0.6140 reached the target 0.5",
    )  # fmt: skip
    assert target_words({"round": 8, "eval_accuracy": 0.614}) is None
    result = RunResult("runs/x", 8, [last])
    assert result.stopped_at_target == 0.5 and not result.stopped_early
    assert RunResult("runs/x", 5, [early]).stopped_early


def test_sparknet_trains_summary_says_target_reached_at_the_last_round_not_stopped_early():
    row = {"round": 8, "loss": 0.5, "samples": 80, "seconds": {"total": 1.0}, "elapsed_s": 9.0,
           "eval_loss": 0.9, "eval_accuracy": 0.614, "eval_top5": 1.0, STOPPED: 0.5}  # fmt: skip
    console = Console(width=200, record=True)
    console.print(_summary(RunResult("runs/x", 8, [row])))
    text = re.sub(r"[\s│]+", " ", console.export_text())
    assert "target reached at round 8: test accuracy 0.6140 reached the target 0.5 " in text
    assert "stopped early" not in text
    console = Console(width=200, record=True)
    console.print(_summary(RunResult("runs/x", 8, [{**row, EARLY: True}])))
    text = re.sub(r"[\s│]+", " ", console.export_text())
    assert "stopped early round 8: test accuracy 0.6140 reached the target 0.5 " in text


def test_a_resumed_run_that_goes_on_takes_the_marker_off_the_round_it_had_stopped_at(tmp_path):
    """r3 stopped at round 7 (target 0.4), went on to 8 with a higher target, then to 10 with
    none: only the row of the round the run last stopped at carries a marker."""
    store = open_store(tmp_path)
    log = MetricsLog(store, keep_rounds=0)
    for r in range(1, 7):
        log.append({"round": r, "eval_accuracy": 0.1})
    log.append({"round": 7, "eval_accuracy": 0.45, STOPPED: 0.4, EARLY: True})
    again = MetricsLog(store, keep_rounds=7)  # the resume
    assert again.rounds[-1][STOPPED] == 0.4  # until a round goes on from it
    again.append({"round": 8, "eval_accuracy": 0.61, STOPPED: 0.6, EARLY: True})
    rows = read_metrics(store)
    assert [r["round"] for r in rows if STOPPED in r] == [8]
    assert not any(EARLY in r for r in rows[:-1])
    more = MetricsLog(store, keep_rounds=8)
    more.append({"round": 9})
    more.append({"round": 10})
    assert not any(STOPPED in r or EARLY in r for r in read_metrics(store))


# ---- real runs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(spark, tmp_path_factory) -> Path:
    """6 rounds, a checkpoint and an evaluation after each, every checkpoint kept."""
    out = tmp_path_factory.mktemp("retention") / "reference"
    train(TrainConfig(rounds=6, keep_checkpoints=0, out=out, **SMALL), spark=spark)
    return out


def _kept(out: Path) -> list[int]:
    return sorted(int(p.name[6:]) for p in (out / "checkpoints").iterdir())


@pytest.mark.integration
def test_a_pruned_run_keeps_n_and_the_best_and_resumes_exactly(spark, tmp_path, reference):
    out = tmp_path / "run"
    cfg = TrainConfig(rounds=4, keep_checkpoints=1, out=out, **SMALL)
    seen: dict[int, list[int]] = {}  # after each round: the checkpoints in the dir

    def on_round(row: dict) -> None:
        seen[row["round"]] = _kept(out)

    rows = train(cfg, spark=spark, on_round=on_round).metrics
    for r in (1, 2, 3, 4):  # the newest and the best so far, after every round
        best, _ = best_round(rows[:r], range(1, r + 1))
        assert seen[r] == sorted({r, best}), (r, seen, rows)
    best, accuracy = best_round(rows, range(1, 5))
    assert _kept(out) == sorted({4, best})
    assert read_best(open_store(out)).round == best
    assert json.loads((out / BEST).read_text())["eval_accuracy"] == accuracy
    for rounds in _kept(out):  # each kept checkpoint whole
        files = {p.relative_to(out / checkpoint.name(rounds)).as_posix()
                 for p in (out / checkpoint.name(rounds)).rglob("*") if p.is_file()}  # fmt: skip
        assert files == {
            "config.yaml", "weights.safetensors", "state.json",
            "inner/partition-00000.pt", "inner/partition-00001.pt",
        }  # fmt: skip
    # the best checkpoint's weights, as sparknet.load_model(best=True) gives them
    weights = load_file(out / checkpoint.name(best) / checkpoint.WEIGHTS)
    assert_state_equal(sparknet.load_model(out, best=True).state_dict(), weights)

    resumed = load_train_config(base=read_run_config(out), flags={"rounds": 6}, environ={})
    seen.clear()
    result = train(resumed, resume=True, spark=spark, on_round=on_round)
    assert [r["round"] for r in result.metrics] == [1, 2, 3, 4, 5, 6]
    for r in (5, 6):
        best, _ = best_round(result.metrics[:r], range(1, r + 1))
        assert seen[r] == sorted({r, best}), (r, seen)
    assert all(r["inner_state_misses"] == 0 for r in result.metrics)
    assert (out / "model.safetensors").read_bytes() == (
        reference / "model.safetensors"
    ).read_bytes()
    assert [r["loss"] for r in result.metrics] == [r["loss"] for r in read_metrics(reference)]
    best, _ = best_round(result.metrics, range(1, 7))
    assert _kept(out) == sorted({6, best})
    assert _kept(reference) == [1, 2, 3, 4, 5, 6]  # keep_checkpoints 0: all


@pytest.mark.integration
def test_an_s3_run_keeps_only_its_newest_checkpoint_and_its_best(spark, bucket, moto_endpoint):
    uri = f"s3://{bucket}/runs/kept"
    cfg = TrainConfig(rounds=4, keep_checkpoints=1, out=uri, **{**SMALL, "eval_every": 2})
    train(cfg, spark=spark)
    rows = read_metrics(uri)
    best, _ = best_round(rows, [2, 4])
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="runs/kept/")["Contents"]
    keys = [o["Key"][len("runs/kept/") :] for o in listed]
    ckpts = sorted({k.split("/")[1] for k in keys if k.startswith("checkpoints/")})
    assert ckpts == sorted({checkpoint.name(r).split("/")[1] for r in {4, best}})
    for rounds in {4, best}:
        assert {k for k in keys if k.startswith(checkpoint.name(rounds) + "/")} == {
            f"{checkpoint.name(rounds)}/{f}" for f in (
                "config.yaml", "weights.safetensors", "state.json",
                "inner/partition-00000.pt", "inner/partition-00001.pt",
            )
        }  # fmt: skip
    assert BEST in keys and read_best(open_store(uri, moto_endpoint)).round == best
    data = s3.get_object(
        Bucket=bucket, Key=f"runs/kept/{checkpoint.name(best)}/weights.safetensors"
    )
    assert_state_equal(
        sparknet.load_model(uri, moto_endpoint, best=True).state_dict(),
        load_safetensors(data["Body"].read()),
    )


def _target(rows: list[dict], by: int) -> tuple[float, int]:
    """A target that the run reaches by round `by`: (its accuracy, the first round at it)."""
    target = max(r["eval_accuracy"] for r in rows[:by])
    return target, next(r["round"] for r in rows if r["eval_accuracy"] >= target)


@pytest.mark.integration
@pytest.mark.parametrize(
    "transport",
    [
        {"transport": "spark"},
        {"transport": "allreduce"},
        {"transport": "allreduce", "overlap": True},
    ],
    ids=["spark", "allreduce", "overlap"],
)
def test_stop_at_ends_the_run_at_the_first_evaluation_that_reaches_it(spark, tmp_path, transport):
    """Under overlap the model kept is the one evaluated (what is in flight is not in it)."""
    settings = {**SMALL, "checkpoint_every": 5, **transport}
    full = TrainConfig(rounds=5, keep_checkpoints=0, out=tmp_path / "full", **settings)
    rows = train(full, spark=spark).metrics
    target, stop = _target(rows, by=3)
    out = tmp_path / "stopped"
    cfg = TrainConfig(rounds=5, stop_at=target, out=out, **settings)
    result = train(cfg, spark=spark)
    assert result.rounds == stop and result.stopped_at_target == target
    got = read_metrics(out)
    assert [r["round"] for r in got] == list(range(1, stop + 1))
    assert [r["eval_accuracy"] for r in got] == [r["eval_accuracy"] for r in rows[:stop]]
    assert got[-1][STOPPED] == target and got[-1][EARLY] is True
    assert all(STOPPED not in r for r in got[:-1])
    # a checkpoint after every evaluation (the run may end there), the last one the model's
    assert checkpoint.latest(open_store(out)) == stop
    model = out / "model.safetensors"
    assert model.read_bytes() == (out / checkpoint.name(stop) / checkpoint.WEIGHTS).read_bytes()
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["stop_at"] == target

    # a resume with the same target is already finished; without one it goes on to the end
    again = load_train_config(base=read_run_config(out), environ={})
    assert train(again, resume=True, spark=spark).rounds == stop
    more = train(again.model_copy(update={"stop_at": None}), resume=True, spark=spark)
    assert more.rounds == 5 and more.stopped_at_target is None
    assert [r["round"] for r in more.metrics] == [1, 2, 3, 4, 5]
    # from the checkpoint the stop left, exactly as the run that never stopped
    assert model.read_bytes() == (tmp_path / "full/model.safetensors").read_bytes()


@pytest.mark.integration
def test_a_target_first_reached_at_the_last_round_is_recorded_on_its_row(spark, tmp_path):
    """The probe's r2: round 8 of 8 reached the target, and its row said nothing of it."""
    out = tmp_path / "last"
    result = train(TrainConfig(rounds=1, stop_at=0.01, out=out, **SMALL), spark=spark)
    row = read_metrics(out)[-1]
    assert row["round"] == 1 and row[STOPPED] == 0.01 and EARLY not in row
    assert result.stopped_at_target == 0.01 and not result.stopped_early


@pytest.mark.integration
@pytest.mark.slow
def test_sparknet_train_stop_at_exits_0_and_says_where_it_stopped(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(SPARKNET), "train", "--model", "mlp", "--workers", "2", "--tau", "5",
         "--batch-size", "16", "--rounds", "40", "--eval-every", "1", "--checkpoint-every", "10",
         "--stop-at", "0.6", "--keep-checkpoints", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    stop = next(r["round"] for r in rows if r["eval_accuracy"] >= 0.6)
    assert stop < 40 and rows[-1]["round"] == stop and rows[-1][STOPPED] == 0.6
    text = re.sub(r"[\s│]+", " ", proc.stdout)  # the table's cells, however it wrapped them
    assert re.search(
        rf"stopped early round {stop}: test accuracy 0\.\d{{4}} reached the target 0\.6 ", text
    ), proc.stdout
    # one checkpoint kept (the last), and the best: the same one here
    assert _kept(out) == [stop] and read_best(open_store(out)).round == stop
    assert (out / "model.safetensors").read_bytes() == (
        out / checkpoint.name(stop) / checkpoint.WEIGHTS
    ).read_bytes()
