"""`sparknet bench scaling` as a user runs it: a subprocess with its own embedded Spark, output
to a file (no terminal), checked for what it records rather than for how fast this machine is."""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess

import pytest

from tests.conftest import REPO, SPARKNET

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROUNDS = 2
TAUS = (1, 2)
#: the K measured: powers of two up to this machine's cores and --max-workers 4
FIT = [k for k in (1, 2, 4) if k <= (os.cpu_count() or 1)]


def flat(text: str) -> str:
    """The output without its whitespace: rich wraps long lines for an 80-column file."""
    return "".join(text.split())


def bench(*args: str, log, timeout: float = 240) -> subprocess.CompletedProcess:
    """The CLI with stdout and stderr to `log` (a file: no terminal, as in CI or a cron job)."""
    with log.open("w") as fh:
        return subprocess.run(
            [str(SPARKNET), "bench", "scaling", *args],
            cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
        )  # fmt: skip


@pytest.fixture(scope="module")
def scaling(tmp_path_factory):
    """One tiny run shared by the tests below: K in {1, 2} measured on 2 cores, predicted to 4."""
    tmp = tmp_path_factory.mktemp("scaling")
    out, log = tmp / "out", tmp / "log.txt"
    args = ("--tau", ",".join(map(str, TAUS)), "--max-workers", "4", "--rounds", str(ROUNDS))
    proc = bench(*args, "--out", str(out), log=log)
    assert proc.returncode == 0, log.read_text()
    return out, log.read_text()


def test_writes_json_csv_and_plot_with_positive_figures(scaling):
    out, text = scaling
    for name in ("scaling.json", "scaling.csv", "scaling.png"):
        assert (out / name).stat().st_size > 0, name
        assert flat(f"wrote {out / name}") in flat(text)
    assert "measuring C: K=1 tau=1" in text
    doc = json.loads((out / "scaling.json").read_text())
    assert doc["C_s"] > 0 and doc["S_s"] > 0
    rows = doc["rows"]
    assert {(r["workers"], r["tau"]) for r in rows} == {(k, t) for k in (1, 2, 4) for t in TAUS}
    assert len(doc["grid"]) == 4 * len(TAUS)  # every K of 1..4
    for row in rows:
        for key in ("predicted_s", "speedup_local_sgd", "speedup_naive"):
            assert row[key] > 0, (key, row)
        measured = row["workers"] in FIT
        assert (row["measured_s"] is not None) == measured, row
        assert (row["error"] is not None) == measured, row
    with (out / "scaling.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert [float(r["predicted_s"]) for r in table] == [r["predicted_s"] for r in rows]
    assert flat("goal (prediction within 15% of measured wall time): met for") in flat(text)
    # two taus: a line through two points fits K=1 exactly, and the report says so
    assert flat("with fewer than 3 taus the K=1 checks hold by construction") in flat(text)


def test_prediction_is_the_papers_model_of_the_recorded_costs(scaling):
    """predicted_s = rounds x (tau x C + S) with the C and S the report records, and those are
    the ones its measured rounds give (C: the slope of K=1's round seconds over tau; S at a
    measured K: the mean of its rounds less tau x C; beyond, the largest measured K's)."""
    out, _text = scaling
    doc = json.loads((out / "scaling.json").read_text())
    c, by_k = doc["C_s"], {int(k): v for k, v in doc["S_by_k"].items()}
    assert sorted(by_k) == FIT and doc["S_s"] == by_k[FIT[-1]] and doc["S_workers"] == FIT[-1]
    for row in doc["rows"]:
        k, tau = row["workers"], row["tau"]
        sync = by_k.get(k, doc["S_s"])
        assert row["C_s"] == c and row["S_s"] == sync
        assert row["predicted_s"] == pytest.approx(ROUNDS * (tau * c + sync), rel=1e-12)
        serial = k * tau * c
        assert row["speedup_local_sgd"] == pytest.approx(serial / (tau * c + sync))
        assert row["speedup_naive"] == pytest.approx(serial / (k * tau * (c / k + sync)))
    runs = {(m["workers"], m["tau"]): m for m in doc["measured"]}
    single = [runs[(1, t)] for t in TAUS]
    taus = [m["tau"] for m in single for _ in m["seconds"]]
    totals = [s["total"] for m in single for s in m["seconds"]]
    slope = statistics.linear_regression(taus, totals).slope

    def rounds_at(k: int) -> list[tuple[int, float]]:
        return [(t, s["total"]) for t in TAUS for s in runs[(k, t)]["seconds"]]

    # the slope, unless noise left it flat, or so steep that some K's rounds less tau x C <= 0
    fits = slope > 0 and all(
        statistics.fmean(r - t * slope for t, r in rounds_at(k)) > 0 for k in FIT
    )
    assert doc["C_is_slope"] == fits
    if fits:
        assert c == pytest.approx(slope)
    else:  # two taus this close are lost in noise: compute over steps, and the report says so
        steps = sum(m["tau"] * len(m["compute_s"]) for m in single)
        assert c == pytest.approx(sum(sum(m["compute_s"]) for m in single) / steps)
    # a K the model left no time to sync (a busy machine) takes its rounds' own time outside
    # the steps, and the report names it
    modelled = {k: statistics.fmean(r - t * c for t, r in rounds_at(k)) for k in FIT}
    assert doc["S_direct"] == ([] if fits else [k for k in FIT if modelled[k] <= 0])
    for k in FIT:
        if k in doc["S_direct"]:
            own = [s for t in TAUS for s in runs[(k, t)]["sync_s"]]
            assert by_k[k] == pytest.approx(statistics.fmean(own)) and by_k[k] > 0
        else:
            assert by_k[k] == pytest.approx(modelled[k])


def test_measured_wall_is_the_runs_timed_rounds(scaling):
    """measured_s is the sum of the run's own metrics rows after the warm-up round."""
    out, _text = scaling
    doc = json.loads((out / "scaling.json").read_text())
    for row in doc["rows"]:
        if row["measured_s"] is None:
            continue
        run = f"{row['transport']}-k{row['workers']}-tau{row['tau']}"
        metrics = out / "runs" / run / "metrics.jsonl"
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["round"] for r in lines] == list(range(1, ROUNDS + 2))
        timed = sum(r["seconds"]["total"] for r in lines[1:])
        assert row["measured_s"] == pytest.approx(timed)
        assert row["error"] == pytest.approx((row["predicted_s"] - timed) / timed)


def test_a_bad_option_is_one_error_line_and_exit_2(tmp_path):
    log = tmp_path / "log.txt"
    proc = bench("--tau", "x", "--out", str(tmp_path / "out"), log=log, timeout=60)
    lines = log.read_text().splitlines()
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error:") and "--tau" in lines[0], lines
    assert not (tmp_path / "out").exists()
