"""The options for slow links (overlap, fragments, int8/int4, tau auto) on a real local Spark
(local[2,2], the allreduce transport): a retried stage and a resumed run end with the very model
of an undisturbed run, a longer resumed run goes on as if the shorter one had never ended, tau
auto chooses from the measured rounds and keeps its chooser across a resume, and the options
that need the allreduce transport or a model with enough layers are refused before Spark runs a
task. The math itself is pinned in test_sync, test_compress and test_tau_choice."""

from __future__ import annotations

import filecmp
import json
import math
import re
import shutil
from pathlib import Path

import pytest

from sparknet.config import TAU_PROBE, TrainConfig, load_train_config
from sparknet.errors import SettingError, SparknetError
from sparknet.training.driver import train
from sparknet.training.rundir import read_run_config
from sparknet.training.tau_choice import TauChooser
from tests.helpers import assert_state_close, load_run_model

pytestmark = pytest.mark.integration

SETTINGS = dict(
    model="cnn", workers=2, tau=3, batch_size=16, momentum=0.9, seed=5, eval_every=2,
    transport="allreduce", checkpoint_every=2,
)  # fmt: skip

#: every path of the round: fragments and overlap over int8 (the synchronizer), and the blocking
#: round over int4 (the quantized exchange without it)
OPTIONS = {
    "overlap-fragments-int8": dict(overlap=True, fragments=3, compress="int8", outer="nesterov"),
    "int4": dict(compress="int4"),
}


def _same_model(a: Path, b: Path) -> bool:
    return filecmp.cmp(a / "model.safetensors", b / "model.safetensors", shallow=False)


@pytest.mark.parametrize("name", OPTIONS)
def test_a_retried_stage_ends_with_the_model_of_an_undisturbed_run(spark, tmp_path, name):
    clean = TrainConfig(out=tmp_path / "clean", rounds=5, **SETTINGS, **OPTIONS[name])
    train(clean, spark=spark)
    warned: list[str] = []
    drill = clean.model_copy(update={"out": str(tmp_path / "drill"), "fail_once": "2:1"})
    train(drill, spark=spark, on_warning=warned.append)
    assert len(warned) == 1 and "running it again from round 2" in warned[0]
    assert _same_model(tmp_path / "clean", tmp_path / "drill")


@pytest.mark.parametrize("name", OPTIONS)
def test_a_resumed_run_with_more_rounds_ends_as_one_that_never_stopped(spark, tmp_path, name):
    """The short run's last round keeps every worker's progress in its model but leaves the
    run's state (what is in flight, what each worker has not sent) as a longer run has it."""
    whole = TrainConfig(out=tmp_path / "whole", rounds=5, **SETTINGS, **OPTIONS[name])
    train(whole, spark=spark)
    part = whole.model_copy(update={"out": str(tmp_path / "part"), "rounds": 3})
    train(part, spark=spark)
    resumed = load_train_config(
        base=read_run_config(part.out), flags={"rounds": 5, "transport": "allreduce"}, environ={}
    )
    result = train(resumed, resume=True, spark=spark)
    assert [r["round"] for r in result.metrics] == [1, 2, 3, 4, 5]
    assert _same_model(tmp_path / "whole", tmp_path / "part")


def test_the_options_train_close_to_the_blocking_run(spark, tmp_path):
    full = TrainConfig(out=tmp_path / "full", rounds=4, **SETTINGS)
    train(full, spark=spark)
    want = load_run_model(tmp_path / "full")
    for name, options in {"int8": {"compress": "int8"}, "frag": {"fragments": 2}}.items():
        cfg = full.model_copy(update={"out": str(tmp_path / name), **options})
        train(cfg, spark=spark)
        got = load_run_model(tmp_path / name)
        assert any(not (got[k] == want[k]).all() for k in want)  # it did take another path
        assert_state_close(got, want, rtol=0.1, atol=5e-3)


def test_the_ranks_keep_their_own_state_in_the_checkpoint(spark, tmp_path):
    cfg = TrainConfig(out=tmp_path / "run", rounds=2, **SETTINGS, overlap=True, fragments=2)
    train(cfg, spark=spark)
    ckpt = tmp_path / "run/checkpoints/round-00002"
    assert sorted(p.name for p in (ckpt / "inner").iterdir() if "sync" in p.name) == [
        "partition-00000.sync.safetensors",
        "partition-00001.sync.safetensors",
    ]
    assert (ckpt / "final.safetensors").read_bytes() == (
        tmp_path / "run/model.safetensors"
    ).read_bytes()
    assert (ckpt / "weights.safetensors").read_bytes() != (ckpt / "final.safetensors").read_bytes()


def test_more_fragments_than_layers_is_refused_before_spark_runs(spark, tmp_path):
    cfg = TrainConfig(out=tmp_path / "many", rounds=1, **{**SETTINGS, "model": "mlp"}, fragments=9)
    with pytest.raises(SettingError) as caught:
        train(cfg, spark=spark)
    assert caught.value.setting == "fragments"
    assert "is more than the" in str(caught.value) and "lower --fragments" in str(caught.value)
    assert not (tmp_path / "many/checkpoints").exists()


@pytest.mark.parametrize("options", [{"overlap": True}, {"fragments": 2}])
def test_the_spark_transport_refuses_the_options_in_one_line(options):
    with pytest.raises(ValueError, match="allreduce transport only"):
        TrainConfig(**{**SETTINGS, "transport": "spark"}, **options)


@pytest.mark.parametrize("transport", ["spark", "allreduce"])
def test_tau_auto_chooses_from_measured_rounds_and_a_resume_goes_on_with_it(
    spark, tmp_path, transport
):
    """The probe's rounds, then the tau the paper's model asks for (the exchange at most
    tau_share of a round) from their measured step and exchange, recorded with its reasons; a
    resume goes on with the chooser its checkpoint kept."""
    settings = {**SETTINGS, "transport": transport, "checkpoint_every": 3, "eval_every": 0}
    auto = {"tau": "auto", "tau_max": 1000}  # the bound's own tests: test_tau_choice
    cfg = TrainConfig(out=tmp_path / "auto", rounds=6, **{**settings, **auto})
    rows = train(cfg, spark=spark).metrics
    assert [r["tau"] for r in rows[:5]] == [TAU_PROBE] * 5
    choice = rows[4]["tau_choice"]
    want = math.ceil(choice["exchange_s"] * 0.9 / (0.1 * choice["step_s"]))
    assert choice["tau"] == min(max(want, 1), 1000) == rows[5]["tau"]
    assert choice["share"] <= 0.1 + 1e-9
    kept = json.loads((tmp_path / "auto/checkpoints/round-00006/state.json").read_text())
    resumed = load_train_config(
        base=read_run_config(cfg.out), flags={"rounds": 8, "transport": transport}, environ={}
    )
    more = train(resumed, resume=True, spark=spark).metrics
    assert more[6]["tau"] == TauChooser.from_state(kept["tau_choice"]).next_tau()
    manifest = tmp_path / "auto/checkpoints/round-00008/state.json"
    damaged = json.loads(manifest.read_text())
    damaged["tau_choice"]["version"] = 99
    manifest.write_text(json.dumps(damaged))
    further = resumed.model_copy(update={"rounds": 10})
    with pytest.raises(SparknetError, match=r"round-00008 is damaged \(state.json: "):
        train(further, resume=True, spark=spark)


def test_a_tau_that_is_neither_steps_nor_auto_is_one_line():
    for bad in (0, "fast", True):
        with pytest.raises(SettingError, match=r"^invalid setting tau: a whole number of steps"):
            load_train_config(base={}, flags={"tau": bad}, environ={})


def test_a_checkpoint_without_its_workers_state_or_model_is_refused_in_one_line(spark, tmp_path):
    """Under fragments and overlap a checkpoint's weights lack what the workers had not yet
    exchanged: a mid-run checkpoint gives no model, a lost final.safetensors is not replaced by
    the weights, and one worker's missing state stops the resume before any rank trains."""
    cfg = TrainConfig(
        out=tmp_path / "run", rounds=4, **{**SETTINGS, "model": "mlp", "eval_every": 0},
        overlap=True, fragments=2,
    )  # fmt: skip
    train(cfg, spark=spark)

    def copy(name: str) -> Path:
        shutil.copytree(tmp_path / "run", tmp_path / name)
        (tmp_path / name / "model.safetensors").unlink()
        return tmp_path / name

    no_final = copy("no-final")
    (no_final / "checkpoints/round-00004/final.safetensors").unlink()
    mid = copy("mid")
    shutil.rmtree(mid / "checkpoints/round-00004")
    missing = copy("missing")
    shutil.rmtree(missing / "checkpoints/round-00004")
    (missing / "checkpoints/round-00002/inner/partition-00001.sync.safetensors").unlink()
    for run_dir, rounds, words in (
        (no_final, 4, "holds no model of its own (final.safetensors)"),
        (mid, 2, "holds no model of its own (final.safetensors)"),
        (missing, 4, "is damaged (inner/partition-00001.sync.safetensors is missing)"),
    ):
        again = cfg.model_copy(update={"out": str(run_dir), "rounds": rounds})
        with pytest.raises(SparknetError, match=re.escape(words)):
            train(again, resume=True, spark=spark)
        assert not (run_dir / "model.safetensors").exists()
