"""`sparknet bench convergence` as a user runs it (a subprocess with its own embedded Spark,
output to a file: no terminal), one setting run to its target on the shared session, and the
report's arithmetic on made-up outcomes (the goal's verdict needs tau >= 20, too slow here)."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess

import pytest
import torch

from sparknet.bench import convergence
from sparknet.bench.convergence import (
    COLUMNS,
    RECIPES,
    Outcome,
    Setting,
    goal_notes,
    outcome_of,
)
from tests.conftest import REPO, SPARKNET

pytestmark = pytest.mark.integration

WORKERS, TAUS, OUTERS, MAX_ROUNDS = (1, 2), (1, 5), ("average", "nesterov"), 3
BATCH = RECIPES["digits"].batch_size


def flat(text: str) -> str:
    """The output without its whitespace: rich wraps long lines for an 80-column file."""
    return "".join(text.split())


def bench(*args: str, log, timeout: float = 240) -> subprocess.CompletedProcess:
    """The CLI with stdout and stderr to `log` (a file: no terminal, as in CI or a cron job)."""
    with log.open("w") as fh:
        return subprocess.run(
            [str(SPARKNET), "bench", "convergence", *args],
            cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
        )  # fmt: skip


@pytest.mark.slow
def test_cli_sweep_writes_json_csv_and_plot_with_sane_figures(tmp_path):
    """2 K x 2 tau x 2 outers on digits, 3 rounds at most each: too few for the target at these
    tau, so every setting runs its 3 rounds (the reached path is the next test's)."""
    out, log = tmp_path / "out", tmp_path / "log.txt"
    proc = bench(
        "--data", "digits", "--workers", ",".join(map(str, WORKERS)),
        "--tau", ",".join(map(str, TAUS)), "--outer", ",".join(OUTERS),
        "--max-rounds", str(MAX_ROUNDS), "--out", str(out), log=log,
    )  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text
    for name in ("convergence.json", "convergence.csv", "convergence.png"):
        assert (out / name).stat().st_size > 0, name
        assert flat(f"wrote {out / name}") in flat(text)
    assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "digits K=2 tau=5 average:" in text  # the progress line of each setting

    with (out / "convergence.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(WORKERS) * len(TAUS) * len(OUTERS)
    assert list(rows[0]) == COLUMNS
    seen = {(int(r["workers"]), int(r["tau"]), r["outer"]) for r in rows}
    assert seen == {(k, t, o) for k in WORKERS for t in TAUS for o in OUTERS}

    doc = json.loads((out / "convergence.json").read_text())
    assert doc["columns"] == COLUMNS and doc["max_rounds"] == MAX_ROUNDS
    for row in doc["rows"]:
        _check_row(row, doc["curves"])
    assert any("goal" in n and "not checked" in n for n in doc["notes"])  # no tau >= 20 here
    for row in doc["rows"]:  # every setting has its run dir, named as documented
        name = f"digits-K{row['workers']}-tau{row['tau']}-{row['outer']}"
        assert (out / "runs" / name / "metrics.jsonl").exists(), name


def _check_row(row: dict, curves: dict) -> None:
    assert row["dataset"] == "digits" and row["target"] == RECIPES["digits"].target
    curve = curves[f"digits-K{row['workers']}-tau{row['tau']}-{row['outer']}"]
    assert all(0.0 <= a <= 1.0 for a in curve)
    assert row["final_accuracy"] == curve[-1]
    assert row["seconds"] > 0
    if row["rounds"] is None:
        assert row["samples"] is None
        assert len(curve) == MAX_ROUNDS and curve[-1] < row["target"]
    else:
        assert 1 <= row["rounds"] <= MAX_ROUNDS and len(curve) == row["rounds"]
        assert row["samples"] == row["rounds"] * row["workers"] * row["tau"] * BATCH
        assert curve[-1] >= row["target"] > max(curve[:-1], default=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, says",
    [
        (("--tau", "0"), "--tau takes numbers >= 1"),
        (("--data", "nope"), "--data takes any of digits, imagenet-like"),
        (("--max-rounds", "0"), "--max-rounds takes a whole number >= 1, got 0"),
    ],
)
def test_bad_option_is_one_line_and_exit_2(tmp_path, args, says):
    log = tmp_path / "log.txt"
    proc = bench(*args, "--out", str(tmp_path / "out"), log=log, timeout=60)
    text = log.read_text()
    assert proc.returncode == 2, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], text
    assert "Traceback" not in text and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_setting_stops_at_its_target(spark, tmp_path, monkeypatch):
    """A target low enough for round 2 or 3: the run stops there, and rounds, samples and the
    curve agree with its metrics.jsonl (the rounds after the target are never run)."""
    monkeypatch.setitem(RECIPES, "digits", dataclasses.replace(RECIPES["digits"], target=0.2))
    setting = Setting("digits", 2, 5, "average")
    run_dir = tmp_path / "run"
    statuses: list[str] = []
    o = convergence.run_setting(spark, setting, 10, "local[2,2]", run_dir, statuses.append)
    assert o.reached and 1 <= o.rounds < 10, o
    assert o.samples == o.rounds * 2 * 5 * BATCH
    assert o.final_accuracy >= 0.2 and o.final_accuracy == o.curve[-1]
    assert len(o.curve) == o.rounds and max(o.curve[:-1], default=0.0) < 0.2
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == list(range(1, o.rounds + 1))
    assert statuses == []  # no warnings

    again = convergence.run_setting(spark, setting, 10, "local[2,2]", run_dir, statuses.append)
    assert again.curve == o.curve  # a rerun replaces the dir (and is deterministic)


def _outcome(k: int, tau: int, outer: str, rounds: int | None) -> Outcome:
    return Outcome(Setting("digits", k, tau, outer), 0.8, rounds, None, 1.0, 0.5)


def test_goal_verdict_from_the_ratios_at_large_tau():
    outcomes = [
        _outcome(2, 5, "average", 10), _outcome(2, 5, "nesterov", 2),  # tau < 20: not counted
        _outcome(2, 20, "average", 10), _outcome(2, 20, "nesterov", 7),
        _outcome(2, 50, "average", None), _outcome(2, 50, "nesterov", 4),
        _outcome(4, 20, "average", 4), _outcome(4, 20, "nesterov", None),
    ]  # fmt: skip
    notes = goal_notes(outcomes, max_rounds=9)
    assert notes[0] == (
        "digits K=2, rounds nesterov/average: tau=20: 7/10 = 0.70; tau=50: 4/>9 = <=0.40"
    )
    assert notes[1] == "digits K=4, rounds nesterov/average: tau=20: >9/4 = >=2.50"
    assert notes[2].endswith("MISSED, met at 2 of 3 (K, tau) pairs; not met at K=4 tau=20")
    met = goal_notes(outcomes[:6], max_rounds=9)
    assert met[-1].endswith("MET, met at 2 of 2 (K, tau) pairs")
    none = goal_notes(outcomes[:2], max_rounds=9)
    assert len(none) == 1 and "not checked" in none[0]
    # the other dataset's settings of the same K and tau (run after digits) change nothing
    other = [
        Outcome(dataclasses.replace(o.setting, dataset="imagenet-like"), 0.55, 1, None, 1.0, 0.6)
        for o in outcomes
    ]
    assert goal_notes(outcomes + other, max_rounds=9) == notes


def test_outcome_of_counts_up_to_the_first_round_at_the_target():
    rows = [
        {"round": i, "samples": 64, "eval_accuracy": a, "elapsed_s": float(i)}
        for i, a in enumerate([0.3, 0.85, 0.7, 0.9], 1)
    ]
    hit = outcome_of(Setting("digits", 2, 1, "average"), 0.8, rows[:2])
    assert (hit.rounds, hit.samples, hit.seconds, hit.final_accuracy) == (2, 128, 2.0, 0.85)
    miss = outcome_of(Setting("digits", 2, 1, "average"), 0.95, rows)
    assert (miss.rounds, miss.samples, miss.seconds, miss.final_accuracy) == (None, None, 4.0, 0.9)
    assert miss.row()["rounds"] is None and list(miss.row()) == COLUMNS


def test_imagenet_like_is_deterministic_learnable_shaped_data():
    """10 classes of 3x16x16 images, the same on every call (every Spark worker builds its own)
    and from a fresh generation (the cache is no part of the promise)."""
    train, test = convergence.imagenet_like()
    assert convergence.imagenet_like() is convergence.imagenet_like()
    x, y = train.tensors
    assert x.shape == (10 * convergence.TRAIN_PER_CLASS, 3, 16, 16) and x.dtype == torch.float32
    assert torch.bincount(y).tolist() == [convergence.TRAIN_PER_CLASS] * 10
    assert len(test) == 10 * convergence.TEST_PER_CLASS
    assert torch.isfinite(x).all()
    fresh = convergence.imagenet_like.__wrapped__()
    assert torch.equal(fresh[0].tensors[0], x) and torch.equal(fresh[1].tensors[1], test.tensors[1])
    assert not torch.equal(test.tensors[0][:10], x[:10])  # train and test are separate draws
    # class means differ (colour alone already separates some classes): learnable
    means = torch.stack([x[y == c].mean(dim=(0, 2, 3)) for c in range(10)])
    assert torch.cdist(means, means).add(torch.eye(10) * 1e9).min() > 0.01
