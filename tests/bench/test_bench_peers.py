"""`sparknet bench peers` as a user runs it (a subprocess, output to a file): its files with
every contender's rows, nothing of its lab left afterwards (also after a Ctrl-C mid-run), bad
options in one line; and its figures from runs' curves, on numbers made up here."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import time

import pytest

from sparknet.bench.links import Link, why_no_namespaces
from sparknet.bench.peers import Plan, accuracy_at, contenders_of, goal_notes, seconds_to, table
from tests.conftest import REPO, SPARKNET

pytestmark = pytest.mark.integration

LAB = pytest.mark.skipif(why_no_namespaces() is not None, reason=f"{why_no_namespaces()}")


def _lab_leftovers(pid: int, out) -> list[str]:
    """Namespaces and links a `bench peers` of process `pid` made (named snb<pid>...), and any
    process still running inside them or on its `out` dir (its driver, Spark, torchrun)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left = [n for n in (names + links).split() if n.startswith(f"snb{pid}")]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return left + [p for p in ps.splitlines() if f"snb{pid}n" in p or str(out) in p]


def _peers(tmp_path, *args: str) -> subprocess.Popen:
    log = (tmp_path / "log").open("w")
    return subprocess.Popen(
        [str(SPARKNET), "bench", "peers", *args, "--out", str(tmp_path / "bench")],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


@LAB
def test_peers_writes_every_contenders_rows_and_leaves_no_lab(tmp_path):
    proc = _peers(
        tmp_path, "--data", "digits", "--links", "100mbit", "--contenders",
        "allreduce,distributor,plain", "--tau", "5", "--outer", "average", "--budget-s", "1.5",
    )  # fmt: skip
    code = proc.wait(timeout=600)
    text = (tmp_path / "log").read_text()
    assert code == 0, text[-3000:]
    out = tmp_path / "bench"
    doc = json.loads((out / "peers.json").read_text())
    rows = {r["contender"]: r for r in doc["rows"]}
    assert set(rows) == {"sparknet allreduce tau=5 average", "TorchDistributor", "plain PyTorch"}
    assert {r["link"] for r in doc["rows"]} == {"100mbit-0ms"}
    for row in rows.values():
        assert row["samples_per_s"] > 0 and 0 <= row["accuracy_at_budget"] <= 1
    # what crossed the links: the ranks' exchanges and Spark's own traffic, none for plain
    assert rows["TorchDistributor"]["wire_bytes_per_sample"] > 0
    assert rows["sparknet allreduce tau=5 average"]["wire_bytes_per_sample"] > 0
    runs = {r["contender"]: r for r in doc["runs"]}
    ddp = runs["TorchDistributor"]
    assert ddp["samples"] % (2 * 32) == 0 and ddp["curve"][0][1] == 0  # step 0 is evaluated
    # evaluated every 2 rounds of 5 steps: as often as the others, every 10 steps
    assert [p[1] for p in runs["sparknet allreduce tau=5 average"]["curve"]][:2] == [640, 1280]
    with (out / "peers.csv").open() as fh:
        assert {r["contender"] for r in csv.DictReader(fh)} == set(rows)
    assert (out / "peers-digits.png").read_bytes()[:4] == b"\x89PNG"
    assert _lab_leftovers(proc.pid, tmp_path) == []


@LAB
def test_ctrl_c_mid_run_exits_130_and_removes_the_lab(tmp_path):
    proc = _peers(
        tmp_path, "--data", "digits", "--links", "1gbit", "--contenders", "allreduce",
        "--tau", "1", "--outer", "average", "--budget-s", "600",
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while "lab up" not in (tmp_path / "log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
        time.sleep(0.5)
    time.sleep(20)  # into the runs: Spark's master, workers and the driver are up
    assert _lab_leftovers(proc.pid, tmp_path), "the lab was up"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    text = (tmp_path / "log").read_text()
    assert text.strip().splitlines()[-1].startswith("error: interrupted"), text[-2000:]
    assert _lab_leftovers(proc.pid, tmp_path) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--links", "fast"], "error: bad link 'fast': links are comma-separated"),
        (["--links", "1gbit,1gbit:0ms"], "error: --links lists 1gbit-0ms more than once"),
        (["--contenders", "horovod"], "error: --contenders takes any of allreduce, spark, "),
        (["--budget-s", "0"], "error: --budget-s takes a number of seconds > 0, got 0"),
        (["--workers", "1"], "error: --workers takes a whole number from 2 to 64, got 1"),
        (
            ["--links", "0.5mbit"],
            "error: bad link '0.5mbit': the slowest link a lab makes is 1mbit",
        ),
        (["--data", "digits,digits"], "error: --data lists digits more than once"),
        (["--seed", "-1"], "error: --seed takes a whole number >= 0, got -1"),
    ],
)
def test_peers_refuses_bad_options_in_one_line(tmp_path, args, message):
    proc = _peers(tmp_path, *args)
    assert proc.wait(timeout=120) == 2
    lines = (tmp_path / "log").read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert not (tmp_path / "bench" / "runs").exists()


# ---- the figures, from curves made up here ----------------------------------------------------


def _run(contender: str, kind: str, curve, link="1gbit-0ms", samples=1000, train_s=10.0, **kw):
    return {
        "link": link, "dataset": "digits", "contender": contender, "kind": kind, "rep": 0,
        "samples": samples, "train_s": train_s, "setup_s": 1.0, "wall_s": 12.0,
        "wire_bytes": 4000, "curve": curve, "exchange_s": None, **kw,
    }  # fmt: skip


def test_seconds_to_the_target_and_accuracy_at_the_budget_read_the_curve():
    curve = [(0.0, 0, 0.1), (2.0, 64, 0.79), (4.0, 128, 0.81), (9.0, 256, 0.85)]
    assert seconds_to(curve, 0.80) == 4.0
    assert seconds_to(curve, 0.9) is None
    assert accuracy_at(curve, 5.0) == 0.81
    assert accuracy_at([(6.0, 64, 0.5)], 5.0) is None


def test_the_table_and_the_goal_lines_say_ratio_and_where_the_time_goes(tmp_path):
    plan = Plan(
        datasets=["digits"], contenders=[], workers=2, threads=1, batch_size=32, budget_s=10.0,
        reps=1, seed=0, links=[Link(10**9, 0.0)], out=tmp_path,
    )  # fmt: skip
    outcomes = [
        _run("sparknet allreduce tau=10 average", "allreduce", [(1.0, 10, 0.5), (3.0, 30, 0.8)],
             exchange_s=2.5),
        _run("TorchDistributor", "distributor", [(0.0, 0, 0.1), (5.0, 50, 0.82)], samples=400),
        _run("plain PyTorch", "plain", [(0.0, 0, 0.1), (8.0, 80, 0.8)], samples=500),
    ]  # fmt: skip
    rows = {r["contender"]: r for r in table(outcomes, plan)}
    ours = rows["sparknet allreduce tau=10 average"]
    assert ours["seconds_to_target"] == 3.0 and ours["samples_per_s"] == 100.0
    assert ours["wire_bytes_per_sample"] == 4.0 and ours["exchange_share"] == 0.25
    assert rows["TorchDistributor"]["seconds_to_target"] == 5.0
    [line] = goal_notes(list(rows.values()), plan.links, plan)
    assert line.startswith(
        "1gbit-0ms, digits: sparknet's best (sparknet allreduce tau=10 average) 3.0 s to 0.8 "
        "against TorchDistributor's 5.0 s: 0.60x, goal <= 0.5x missed by 1.20x ("
    ), line
    assert "25% of its training time in the exchange" in line
    assert "TorchDistributor at 40% of K x plain's rate" in line  # 40 / (2 x 50)


def test_contenders_are_every_tau_and_outer_for_allreduce_and_average_for_spark():
    got = [c.label for c in contenders_of(["allreduce", "spark", "plain"], [1, 10], ["average",
                                           "nesterov"])]  # fmt: skip
    assert got == [
        "sparknet allreduce tau=1 average", "sparknet allreduce tau=1 nesterov",
        "sparknet allreduce tau=10 average", "sparknet allreduce tau=10 nesterov",
        "sparknet spark tau=1 average", "sparknet spark tau=10 average", "plain PyTorch",
    ]  # fmt: skip
