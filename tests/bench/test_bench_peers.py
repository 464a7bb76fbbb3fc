"""`sparknet bench peers` as a user runs it (a subprocess, output to a file): its files with
every contender's rows, nothing of its lab left afterwards (also after a Ctrl-C mid-run), bad
options in one line; its contenders as asked, its recipes' models as sized, and its figures from
runs' curves and waits, on numbers made up here."""

from __future__ import annotations

import csv
import json
import math
import signal
import subprocess
import time
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from sparknet.bench import peers
from sparknet.bench.common import BenchReport
from sparknet.bench.convergence import RECIPES
from sparknet.bench.links import Link, why_no_namespaces
from sparknet.bench.peers import (
    Plan,
    Variant,
    accuracy_at,
    contenders_of,
    goal_notes,
    seconds_to,
    table,
    taus_of,
    variants_of,
)
from sparknet.bench.peers_run import Contender, PeersSpec, eval_rounds
from sparknet.cli import app
from sparknet.data.sources import load_data
from sparknet.errors import SparknetError
from sparknet.models import build_model
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
        (["--tau", "10,soon"], "error: --tau takes whole numbers >= 1 or auto, comma-separated"),
        (["--variants", "int8,int3"], "error: --variants takes none or +-joined bf16, fp16, "),
        (["--variants", "int8,int8"], "error: --variants lists int8 more than once"),
        (
            ["--data", "wide"],
            "error: --data takes any of digits, imagenet-like, imagenet-like-wide",
        ),
    ],
)
def test_peers_refuses_bad_options_in_one_line(tmp_path, args, message):
    proc = _peers(tmp_path, *args)
    assert proc.wait(timeout=120) == 2
    lines = (tmp_path / "log").read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert not (tmp_path / "bench" / "runs").exists()


# ---- the figures, from curves made up here ----------------------------------------------------


def test_the_cli_makes_a_contender_of_each_tau_outer_and_variant(tmp_path, monkeypatch):
    asked = []

    def run(plan, on_status):
        asked.append(plan)
        return BenchReport(name="peers", title="made up", columns=["link"], rows=[])

    monkeypatch.setattr(peers, "run", run)
    done = CliRunner().invoke(app, [
        "bench", "peers", "--data", "imagenet-like-wide", "--links", "1gbit", "--contenders",
        "allreduce,spark,distributor", "--tau", "50,auto", "--outer", "nesterov", "--variants",
        "none,int8+overlap+frag4", "--out", str(tmp_path),
    ])  # fmt: skip
    assert done.exit_code == 0, done.output
    [plan] = asked
    assert [c.label for c in plan.contenders] == [
        "sparknet allreduce tau=50 nesterov",
        "sparknet allreduce tau=50 nesterov int8 overlap frag4",
        "sparknet allreduce tau=auto nesterov",
        "sparknet allreduce tau=auto nesterov int8 overlap frag4",
        "sparknet spark tau=50 average", "sparknet spark tau=auto average", "TorchDistributor",
    ]  # fmt: skip
    assert plan.datasets == ["imagenet-like-wide"]


# ---- the contenders, the recipes ----------------------------------------------------------------


def test_variants_read_as_asked_and_bad_ones_say_why():
    assert variants_of("none,int8, int4+overlap ,frag4+bf16") == [
        Variant(), Variant("int8"), Variant("int4", overlap=True), Variant("bf16", fragments=4)
    ]  # fmt: skip
    assert Variant.parse("overlap+fp16+frag2").name == "fp16+overlap+frag2"
    for bad, why in [
        ("int3", "'int3' is none of bf16, fp16, int8, int4, overlap, fragN (N >= 2)"),
        ("frag1", "'frag1' is none of"),
        ("int8+int4", "'int8+int4' sets compress twice"),
        ("none+int8", "'none' is none of"),
        ("", "'' is none of"),
    ]:
        with pytest.raises(SparknetError, match=r"^--variants takes none or") as caught:
            variants_of(f"none,{bad}")
        assert why in str(caught.value), caught.value
    assert taus_of("1,50,auto") == [1, 50, "auto"]
    for bad in ("0", "auto,auto", "1.5", "-3"):
        with pytest.raises(SparknetError, match=r"^--tau "):
            taus_of(bad)


def test_variants_cross_the_allreduce_contenders_alone_and_label_them():
    got = contenders_of(
        ["plain", "allreduce", "spark"], [10, "auto"], ["average"],
        [Variant(), Variant("int8", overlap=True, fragments=4)],
    )  # fmt: skip
    assert [c.label for c in got] == [
        "plain PyTorch",
        "sparknet allreduce tau=10 average", "sparknet allreduce tau=10 average int8 overlap frag4",
        "sparknet allreduce tau=auto average",
        "sparknet allreduce tau=auto average int8 overlap frag4",
        "sparknet spark tau=10 average", "sparknet spark tau=auto average",
    ]  # fmt: skip
    assert [c.slug for c in got[1:3]] == [
        "allreduce-10-average",
        "allreduce-10-average-int8-overlap-frag4",
    ]
    assert [eval_rounds(t, 10) for t in (1, 5, 10, 50, "auto")] == [10, 2, 1, 1, 1]
    assert [eval_rounds(t, 30) for t in (1, 10, 50)] == [30, 3, 1]
    with pytest.raises(ValueError, match="allreduce transport's, not spark's"):
        Contender("spark", 10, "average", compress="int8")


def test_contenders_travel_to_the_child_whole(tmp_path):
    c = Contender("allreduce", "auto", "nesterov", "int4", True, 3)
    spec = PeersSpec(
        datasets=["digits"], contenders=[c], workers=2, threads=1, batch_size=32, budget_s=1.0,
        reps=1, seed=0, link="unshaped", master="local[2]", runs_dir=str(tmp_path),
    )  # fmt: skip
    spec.dump(tmp_path / "spec.json")
    assert PeersSpec.load(tmp_path / "spec.json").contenders == [c]


def test_ddp_and_plain_are_evaluated_every_eval_steps_or_every_eval_s_seconds():
    from sparknet.bench.distributor import PeerSpec, _steps_to_next

    spec = PeerSpec(
        data="digits", model="mlp", workers=2, batch_size=32, lr=0.1, momentum=0.0, threads=1,
        seed=0, target=1.0, max_steps=100, max_seconds=10.0, eval_every=30, eval_s=2.0,
    )  # fmt: skip
    assert _steps_to_next(spec, 0, 0.0) == 1  # after step 0: one step, to learn the pace
    assert _steps_to_next(spec, 10, 1.0) == 20  # 0.1 s a step: 2 s is 20 steps
    assert _steps_to_next(spec, 10, 0.1) == 30  # 30 steps take 0.3 s: every 30
    assert _steps_to_next(spec, 2, 7.0) == 1  # 3.5 s a step: every step
    assert _steps_to_next(replace(spec, eval_s=math.inf), 0, 0.0) == 30  # steps alone


def test_the_wide_recipe_is_a_40_mb_model_on_the_generated_images():
    recipe = RECIPES["imagenet-like-wide"]
    split = load_data(recipe.data)
    model = build_model(recipe.model, split.input_shape, split.num_classes)
    params = sum(p.numel() for p in model.parameters())
    assert 9.9e6 < params < 10.1e6 and 4 * params / 1e6 == pytest.approx(40, abs=0.5)
    assert split.input_shape == (3, 16, 16) and split.num_classes == 10
    assert "imagenet-like-wide" in peers.DATASETS


# ---- the figures, from curves made up here ----------------------------------------------------


def _run(contender: str, kind: str, curve, link="1gbit-0ms", samples=1000, train_s=10.0, **kw):
    return {
        "link": link, "dataset": "digits", "contender": contender, "kind": kind, "rep": 0,
        "samples": samples, "train_s": train_s, "setup_s": 1.0, "wall_s": 12.0,
        "wire_bytes": 4000, "curve": curve, "wait_s": None, "busy_s": None, "tau_last": None,
        **kw,
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
             wait_s=2.5, busy_s=2.5),
        _run("TorchDistributor", "distributor", [(0.0, 0, 0.1), (5.0, 50, 0.82)], samples=400),
        _run("plain PyTorch", "plain", [(0.0, 0, 0.1), (8.0, 80, 0.8)], samples=500),
    ]  # fmt: skip
    rows = {r["contender"]: r for r in table(outcomes, plan)}
    ours = rows["sparknet allreduce tau=10 average"]
    assert ours["seconds_to_target"] == 3.0 and ours["samples_per_s"] == 100.0
    assert ours["wire_bytes_per_sample"] == 4.0 and ours["wait_share"] == 0.25
    # 4000 bytes, 2000 a worker, in 2.5 s: 6400 bit/s of 1 Gbit/s
    assert ours["wire_rate_share"] == pytest.approx(6.4e-6)
    assert rows["TorchDistributor"]["seconds_to_target"] == 5.0
    [line] = goal_notes(list(rows.values()), plan.links, plan)
    assert line.startswith(
        "1gbit-0ms, digits: sparknet's best (sparknet allreduce tau=10 average) 3.0 s to 0.8 "
        "against TorchDistributor's 5.0 s: 0.60x, goal <= 0.5x missed by 1.20x ("
    ), line
    assert "TorchDistributor at 40% of K x plain's rate" in line  # 40 / (2 x 50)
    assert line.endswith(
        "; network wait: sparknet 25% (exchange at 0% of the link's rate) of training"
    )


def test_contenders_are_every_tau_and_outer_for_allreduce_and_average_for_spark():
    got = [c.label for c in contenders_of(["allreduce", "spark", "plain"], [1, 10], ["average",
                                           "nesterov"])]  # fmt: skip
    assert got == [
        "sparknet allreduce tau=1 average", "sparknet allreduce tau=1 nesterov",
        "sparknet allreduce tau=10 average", "sparknet allreduce tau=10 nesterov",
        "sparknet spark tau=1 average", "sparknet spark tau=10 average", "plain PyTorch",
    ]  # fmt: skip


def test_waits_and_the_links_use_per_contender_and_a_bound_where_ddp_falls_short(tmp_path):
    plan = Plan(
        datasets=["digits"], contenders=[], workers=2, threads=1, batch_size=32, budget_s=100.0,
        reps=1, seed=0, links=[Link(10**8, 0.0)], out=tmp_path,
    )  # fmt: skip
    link = "100mbit-0ms"
    outcomes = [
        # 9e8 bytes from round 2 on, 4.5e8 a worker, 3.6e9 bits in 36 s of exchange from round
        # 2 on (of 40 s): 1.0 of 100 Mbit/s; the start's bytes are not the exchange's
        _run("sparknet allreduce tau=auto average int8", "allreduce", [(15.0, 10, 0.81)],
             link=link, train_s=100.0, wire_bytes=10**9, busy_bytes=9 * 10**8, wait_s=40.0,
             busy_s=36.0, tau_last=120),
        _run("sparknet allreduce tau=10 average overlap", "allreduce", [(90.0, 10, 0.7)],
             link=link, train_s=100.0, wire_bytes=10**9, busy_bytes=5 * 10**8, wait_s=8.0,
             busy_s=80.0, busy_what="training"),
        _run("TorchDistributor", "distributor", [(0.0, 0, 0.1), (101.0, 50, 0.6)], link=link,
             train_s=101.0, wire_bytes=10**9, wait_s=95.0, busy_s=100.0),
        _run("plain PyTorch", "plain", [(20.0, 80, 0.8)], link=link, train_s=100.0, wait_s=0.0),
    ]  # fmt: skip
    rows = {r["contender"]: r for r in table(outcomes, plan)}
    auto = rows["sparknet allreduce tau=auto average int8"]
    assert auto["wait_share"] == 0.4 and auto["wire_rate_share"] == pytest.approx(1.0)
    assert auto["tau_last"] == 120
    ddp = rows["TorchDistributor"]
    assert ddp["wait_share"] == pytest.approx(95 / 101) and ddp["wire_rate_share"] == 0.4
    assert ddp["seconds_to_target"] is None
    overlap = rows["sparknet allreduce tau=10 average overlap"]
    assert overlap["wait_share"] == 0.08 and overlap["wire_rate_share"] == pytest.approx(0.25)
    assert rows["plain PyTorch"]["wait_share"] == 0.0
    assert rows["plain PyTorch"]["wire_rate_share"] is None
    [line] = goal_notes(list(rows.values()), plan.links, plan)
    assert line == (
        "100mbit-0ms, digits: sparknet's best (sparknet allreduce tau=auto average int8) 15.0 s "
        "to 0.8; TorchDistributor did not reach it in 100 s: < 0.15x, goal <= 0.2x met; network "
        "wait: sparknet 40% (exchange at 100% of the link's rate), TorchDistributor 94% (exchange "
        "at 40% of the link's rate) of training"
    )
    outcomes[0]["curve"] = [(95.0, 10, 0.6)]  # no sparknet setting reaches it: each one said
    [line] = goal_notes(table(outcomes, plan), plan.links, plan)
    assert line == (
        "100mbit-0ms, digits: no sparknet setting reached the target in 100 s; no ratio; network "
        "wait: sparknet allreduce tau=auto average int8 40% (exchange at 100% of the link's "
        "rate), sparknet allreduce tau=10 average overlap 8% (the link at 25% of its rate over "
        "training), TorchDistributor 94% (exchange at 40% of the link's rate) of training"
    )
    unshaped = [dict(r, link="unshaped") for r in outcomes]
    assert all(r["wire_rate_share"] is None for r in table(unshaped, plan))
