"""Learning-rate schedules and label smoothing: the lr of each global step, the settings that
shape it (checked, recorded, resumed), a worker that steps at those rates, and a Spark run that
resumes with the same rates as one that never stopped."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from sparknet.config import TrainConfig, load_train_config
from sparknet.data.sources import TensorSource, digits
from sparknet.errors import SparknetError
from sparknet.training import schedule
from sparknet.training.driver import train
from sparknet.training.outer import OuterOptimizer
from sparknet.training.rundir import read_run_config
from sparknet.training.schedule import Clock, inner_lr, outer_lr, round_lrs
from sparknet.training.state import StateLayout
from sparknet.training.sync import Synchronizer, fragments_of
from sparknet.training.worker import RoundTask, train_partition
from tests.helpers import assert_state_equal, initial_model, load_run_model, worker_batch

# ---- the lr of a global step -----------------------------------------------------------------


def _at(cfg: TrainConfig, steps: int, train_size: int = 1000) -> Clock:
    """The clock of global step `steps` under a fixed tau."""
    rnd, i = divmod(steps, cfg.first_tau)
    return Clock.at(cfg, train_size, rnd * cfg.first_tau, rnd, cfg.first_tau, i)


def test_warmup_is_linear_in_steps_then_cosine_decays_to_min_lr():
    cfg = TrainConfig(
        lr=0.1, warmup_steps=4, lr_schedule="cosine", lr_unit="steps", lr_decay_length=20,
        min_lr=0.01, tau=3,
    )  # fmt: skip
    lrs = {s: inner_lr(cfg, _at(cfg, s)) for s in (0, 1, 2, 3, 10, 20, 25)}

    def cos(s):
        return 0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * s / 20))

    assert lrs[0] == pytest.approx(0.25 * 0.1)  # the first step already learns
    assert lrs[1] == pytest.approx(0.5 * cos(1))
    assert lrs[2] == pytest.approx(0.75 * cos(2))
    assert lrs[3] == pytest.approx(cos(3))  # the warmup's last step: the full schedule
    assert lrs[10] == pytest.approx(0.055)  # half-way down
    assert lrs[20] == pytest.approx(0.01) and lrs[25] == pytest.approx(0.01)  # min_lr after


def test_multistep_at_epochs_falls_on_the_step_the_samples_reach_it():
    """100 samples, 2 workers of 10: an epoch is 5 global steps."""
    cfg = TrainConfig(
        lr=0.1, lr_schedule="multistep", lr_unit="epochs", lr_milestones=[1, 3], workers=2,
        batch_size=10, tau=4,
    )  # fmt: skip
    got = [inner_lr(cfg, _at(cfg, s, train_size=100)) for s in range(17)]
    assert got == pytest.approx([0.1] * 5 + [0.01] * 10 + [0.001] * 2)


def test_a_schedule_in_steps_is_the_same_whatever_tau_and_workers():
    """The global step counts the trajectory's steps: rounds of 3 or of 4, 2 workers or 5."""
    shape = dict(
        lr=0.2, warmup_steps=3, lr_schedule="step", lr_unit="steps", lr_step_size=5, lr_gamma=0.5
    )
    want = [0.2 * min(1, (s + 1) / 3) * 0.5 ** (s // 5) for s in range(12)]
    for tau, workers in ((3, 2), (4, 5), (1, 3)):
        cfg = TrainConfig(tau=tau, workers=workers, **shape)
        got = [lr for r in range(12 // tau) for lr in round_lrs(cfg, 100, r * tau, r, tau)]
        assert got == pytest.approx(want), (tau, workers)


def test_rounds_count_each_round_whatever_its_tau():
    """Under tau auto rounds run at different taus: a milestone at round 2 starts round 3,
    and the global step goes on from the steps the rounds before it took."""
    cfg = TrainConfig(lr=0.1, tau="auto", lr_schedule="multistep", lr_milestones=[2])
    taus, first = [5, 3, 4], 0
    seen = []
    for rnd, tau in enumerate(taus):
        seen.append(round_lrs(cfg, 100, first, rnd, tau))
        first += tau
    assert seen == [[0.1] * 5, [0.1] * 3, [pytest.approx(0.01)] * 4]


def test_step_schedule_in_rounds_moves_within_no_round():
    cfg = TrainConfig(lr=0.1, tau=3, lr_schedule="step", lr_step_size=2, lr_gamma=0.5)
    by_round = [round_lrs(cfg, 100, r * 3, r, 3) for r in range(5)]
    assert by_round == [[0.1] * 3, [0.1] * 3, [0.05] * 3, [0.05] * 3, [0.025] * 3]


def test_outer_cosine_starts_at_outer_lr_and_never_reaches_0_within_the_run():
    cfg = TrainConfig(outer="nesterov", outer_lr=0.7, outer_lr_schedule="cosine", rounds=4, tau=2)
    got = [outer_lr(cfg, 100, r * 2, r, 2) for r in range(4)]
    assert got == pytest.approx([0.7, 0.7 * (1 + math.cos(math.pi / 4)) / 2, 0.35, 0.7 * 0.1464466])
    assert outer_lr(TrainConfig(outer="nesterov", tau=2), 100, 6, 3, 2) == 0.7  # constant


def test_outer_cosine_decays_over_the_runs_rounds_whatever_the_inner_length_and_unit():
    """The probe's run: an inner step schedule in epochs, 6 rounds: the outer lr was 0 from
    round 2 on (it took lr_decay_length 3 in epochs). Now it is the run's 6 rounds."""
    cfg = TrainConfig(
        outer="nesterov", outer_lr_schedule="cosine", rounds=6, tau=5, lr_unit="epochs",
        lr_schedule="step", lr_step_size=1, lr_gamma=0.5, warmup_steps=3,
    )  # fmt: skip
    assert cfg.outer_lr_decay_rounds == 6
    got = [outer_lr(cfg, 1797, r * 5, r, 5) for r in range(6)]
    assert got == pytest.approx([0.7 * (1 + math.cos(math.pi * r / 6)) / 2 for r in range(6)])
    assert min(got) > 0.04


def test_the_outer_optimizer_steps_at_the_rate_it_is_given():
    opt = OuterOptimizer(np.zeros(2, np.float32), lr=0.7, momentum=0.5)
    opt.lr = 0.1
    assert opt.step(np.ones(2, np.float32)).tolist() == pytest.approx([-0.15, -0.15])
    opt.lr = 0.0  # a schedule's end: nothing moves, the momentum is kept
    assert opt.trial(np.ones(2, np.float32)).tolist() == pytest.approx([-0.15, -0.15])


def test_every_fragment_steps_at_the_scheduled_outer_rate():
    """Fragments (and overlap) hold an outer optimizer each: a schedule's rate reaches them all."""
    layout = StateLayout.of({f"l{i}.weight": torch.zeros(2) for i in range(2)})
    sync = Synchronizer(
        layout, fragments_of(layout, 2), np.zeros(4, np.float32), lr=0.7, momentum=0.0,
        momentum_buffer=None, overlap=False, exchange=lambda buf: buf,
    )  # fmt: skip
    sync.set_outer_lr(0.5)
    sync.end_round(0, np.ones(4, np.float32))  # fragment 0 syncs: -0.5 on its layer
    sync.set_outer_lr(0.25)
    sync.end_round(1, np.ones(4, np.float32))  # fragment 1 has two rounds of progress unsent
    assert sync.theta.tolist() == pytest.approx([-0.5, -0.5, -0.5, -0.5])


def test_a_rounds_row_names_its_rates_and_the_steps_taken():
    cfg = TrainConfig(
        outer="nesterov", outer_lr_schedule="cosine", rounds=2, tau=4, lr=0.1, warmup_steps=8
    )
    assert schedule.round_fields(cfg, 100, 4, 1, 4) == {
        "lr": pytest.approx(0.1 * 5 / 8),
        "steps": 8,
        "outer_lr": pytest.approx(0.35),
    }
    assert schedule.round_fields(TrainConfig(), 100, 0, 0, 10) == {"lr": 0.05, "steps": 10}


# ---- the settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"lr_schedule": "multistep"}, "lr_schedule multistep needs lr_milestones (in rounds)"),
        ({"lr_schedule": "step", "lr_unit": "epochs"}, "lr_schedule step needs lr_step_size"),
        ({"lr_milestones": "30,60"}, "lr_milestones applies to lr_schedule multistep only"),
        ({"min_lr": 0.001}, "min_lr applies to lr_schedule cosine only"),
        ({"lr_decay_length": 9}, "lr_decay_length applies to lr_schedule cosine only"),
        ({"lr_gamma": 0.5}, "lr_gamma applies to lr_schedule step or multistep only"),
        ({"lr_gamma": 0.1, "lr_schedule": "cosine"}, "lr_gamma applies to lr_schedule step or"),
        ({"lr_unit": "epochs"}, "lr_unit applies to lr_schedule cosine, step or multistep only"),
        (
            {"outer": "nesterov", "outer_lr_schedule": "cosine", "lr_decay_length": 9},
            "lr_decay_length applies to lr_schedule cosine only",
        ),
        ({"outer_lr_decay_rounds": 30}, "outer_lr_decay_rounds applies to outer_lr_schedule"),
        (
            {"outer": "nesterov", "outer_lr_schedule": "cosine", "outer_lr_decay_rounds": 3},
            "outer_lr_decay_rounds 3 is below rounds 30: the outer lr would be 0 from round 4",
        ),
        ({"lr_schedule": "cosine", "lr_unit": "epochs"}, "a cosine schedule in epochs needs "),
        ({"lr_schedule": "cosine", "min_lr": 0.5}, "min_lr 0.5 must be below lr 0.05"),
        ({"outer_lr_schedule": "cosine"}, "outer_lr_schedule applies to outer 'nesterov' only"),
    ],
)
def test_a_schedule_setting_where_it_does_not_apply_is_one_line(flags, message):
    with pytest.raises(SparknetError) as caught:
        load_train_config(flags=flags, environ={})
    assert str(caught.value).startswith("invalid settings: " + message)
    assert "\n" not in str(caught.value)


def test_a_cosine_or_step_schedule_fills_in_its_unit_and_gamma_and_constant_records_none():
    assert (TrainConfig().lr_unit, TrainConfig().lr_gamma) == (None, None)
    step = TrainConfig(lr_schedule="step", lr_step_size=2)
    assert (step.lr_unit, step.lr_gamma) == ("rounds", 0.1)
    assert TrainConfig(lr_schedule="cosine").lr_unit == "rounds"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keep_checkpoints=true", "invalid setting keep_checkpoints: a whole number of check"),
        ("stop_at=true", "invalid setting stop_at: an accuracy in (0, 1], not true"),
        ("outer_lr_decay_rounds=true", "invalid setting outer_lr_decay_rounds: a whole number"),
    ],
)
def test_yaml_true_is_no_count_of_checkpoints_and_no_accuracy(text, message):
    """`true` read as 1: one checkpoint kept, or a stop only at 100 %."""
    with pytest.raises(SparknetError) as caught:
        load_train_config(sets=[text], environ={})
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("text", ["2.0", "2.5", "[2, 4.5]", "2,x"])
def test_a_milestone_that_is_no_whole_number_says_so(text):
    with pytest.raises(SparknetError) as caught:
        load_train_config(sets=["lr_schedule=multistep", f"lr_milestones={text}"], environ={})
    assert str(caught.value).startswith("invalid setting lr_milestones: whole numbers (got ")


def test_milestones_are_increasing_whole_numbers_from_text_too():
    cfg = load_train_config(sets=["lr_schedule=multistep", "lr_milestones=30,60,80"], environ={})
    assert cfg.lr_milestones == [30, 60, 80]
    assert load_train_config(sets=["lr_milestones=[5]", "lr_schedule=multistep"], environ={})
    with pytest.raises(SparknetError, match=r"^invalid setting lr_milestones: increasing"):
        load_train_config(flags={"lr_schedule": "multistep", "lr_milestones": [60, 30]})
    with pytest.raises(SparknetError, match=r"^invalid setting label_smoothing"):
        load_train_config(flags={"label_smoothing": 1.0}, environ={})


def test_config_yaml_records_the_schedule_with_the_length_a_cosine_took():
    cfg = TrainConfig(
        rounds=40, lr_schedule="cosine", warmup_steps=100, min_lr=0.001, label_smoothing=0.1,
        outer="nesterov", outer_lr_schedule="cosine",
    )  # fmt: skip
    saved = yaml.safe_load(cfg.to_yaml())["train"]
    assert {k: saved[k] for k in saved if k in SCHEDULE_KEYS} == {
        "label_smoothing": 0.1, "warmup_steps": 100, "lr_schedule": "cosine",
        "lr_unit": "rounds", "lr_milestones": [], "lr_step_size": None, "lr_gamma": None,
        "lr_decay_length": 40, "min_lr": 0.001, "outer_lr_schedule": "cosine",
        "outer_lr_decay_rounds": 40,
    }  # fmt: skip
    # a resume with more rounds keeps the inner decay it ran (rounds is no change to the
    # trajectory); the outer one's would reach 0 within the run: a new length is asked for
    more = load_train_config(base=saved, flags={"rounds": 40}, environ={})
    assert more.lr_decay_length == 40 and more.trajectory_changes(cfg) == {}
    with pytest.raises(SparknetError, match="outer_lr_decay_rounds 40 is below rounds 80"):
        load_train_config(base=saved, flags={"rounds": 80}, environ={})
    longer = load_train_config(
        base=saved, flags={"rounds": 80}, sets=["outer_lr_decay_rounds=80"], environ={}
    )
    assert longer.lr_decay_length == 40
    assert longer.trajectory_changes(cfg) == {"outer_lr_decay_rounds": (40, 80)}
    # another schedule on resume takes its own shape, not the stored cosine's
    other = load_train_config(
        base=saved, flags={"lr_schedule": "step", "lr_step_size": 10}, environ={}
    )
    assert (other.lr_decay_length, other.min_lr, other.lr_gamma) == (None, 0.0, 0.1)
    assert other.outer_lr_decay_rounds == 40  # the outer cosine's own, kept
    assert set(other.trajectory_changes(cfg)) == {
        "lr_schedule", "lr_step_size", "min_lr", "lr_decay_length", "lr_gamma",
    }  # fmt: skip


SCHEDULE_KEYS = {
    "label_smoothing", "warmup_steps", "lr_schedule", "lr_unit", "lr_milestones",
    "lr_step_size", "lr_gamma", "lr_decay_length", "min_lr", "outer_lr_schedule",
    "outer_lr_decay_rounds",
}  # fmt: skip


def _stored(**settings) -> dict:
    return yaml.safe_load(TrainConfig(**settings).to_yaml())["train"]


def test_a_changed_outer_schedule_on_resume_keeps_the_inner_shape():
    """Only a changed inner lr_schedule takes a shape anew: an outer cosine turned on keeps the
    inner cosine's floor and length, and a multistep's milestones."""
    saved = _stored(lr_schedule="cosine", min_lr=0.01, outer="nesterov", rounds=8)
    got = load_train_config(
        base=saved, flags={"outer_lr_schedule": "cosine", "rounds": 12}, environ={}
    )
    assert (got.min_lr, got.lr_decay_length, got.outer_lr_decay_rounds) == (0.01, 8, 12)
    assert set(got.trajectory_changes(TrainConfig(**saved))) == {
        "outer_lr_schedule", "outer_lr_decay_rounds",
    }  # fmt: skip
    saved = _stored(
        lr_schedule="multistep", lr_milestones=[2, 4], lr_gamma=0.5, outer="nesterov", rounds=8
    )
    got = load_train_config(base=saved, flags={"outer_lr_schedule": "cosine"}, environ={})
    assert (got.lr_milestones, got.lr_gamma, got.lr_unit) == ([2, 4], 0.5, "rounds")
    # the outer schedule changed back drops its own length only
    back = load_train_config(base=_stored(**{**saved, "outer_lr_schedule": "cosine"}),
                             flags={"outer_lr_schedule": "constant"}, environ={})  # fmt: skip
    assert (back.outer_lr_decay_rounds, back.lr_milestones) == (None, [2, 4])


@pytest.mark.parametrize(
    ("stored", "again", "field", "want"),
    [
        (
            {"lr_schedule": "multistep", "lr_milestones": [2, 4]},
            {"lr_milestones": [2, 4]}, "lr_milestones", [2, 4],
        ),
        ({"lr_schedule": "cosine"}, {"lr_decay_length": 8}, "lr_decay_length", 8),
        ({"lr_schedule": "step", "lr_step_size": 2}, {"lr_step_size": 2}, "lr_step_size", 2),
    ],
)  # fmt: skip
def test_a_shape_given_again_with_a_new_unit_is_taken_even_when_equal(stored, again, field, want):
    """A value given again counts as given, even where it equals the stored one."""
    saved = _stored(rounds=8, **stored)
    got = load_train_config(base=saved, flags={"lr_unit": "steps", **again}, environ={})
    assert (getattr(got, field), got.lr_unit) == (want, "steps")
    # and with a new kind too: given, so kept, where the stored one would be dropped
    other = _stored(rounds=8, outer="nesterov")
    kind = stored["lr_schedule"]
    got = load_train_config(base=other, flags={"lr_schedule": kind, **again}, environ={})
    assert getattr(got, field) == want


def test_a_run_dir_of_the_earlier_schedule_format_resumes_as_it_ran(tmp_path):
    """config.yaml once held lr_gamma and lr_unit under every schedule, and the outer cosine's
    length in lr_decay_length: read as today's, with no change to refuse."""
    older = _stored(outer="nesterov")
    del older["outer_lr_decay_rounds"]
    older.update(lr_gamma=0.1, lr_unit="rounds", outer_lr_schedule="cosine", lr_decay_length=30)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"train": older}))
    stored = read_run_config(tmp_path)
    cfg = load_train_config(base=stored, environ={})
    assert (cfg.lr_gamma, cfg.lr_unit, cfg.lr_decay_length) == (None, None, None)
    assert cfg.outer_lr_decay_rounds == 30
    assert cfg.trajectory_changes(TrainConfig(**stored)) == {}


# ---- a worker's steps ------------------------------------------------------------------------


def test_a_worker_steps_at_the_scheduled_rates_with_label_smoothing(tmp_path):
    """Round 2 of rounds of 3 steps, 4 steps into a warmup of 8: plain SGD by hand at the rates
    the schedule gives steps 6, 7 and 8, on the worker's batches, gives the worker's update;
    its loss is torch's CrossEntropyLoss(label_smoothing=0.2) on those batches."""
    cfg = TrainConfig(
        model="mlp", workers=2, tau=3, batch_size=8, lr=0.1, momentum=0.0, warmup_steps=8,
        lr_schedule="multistep", lr_unit="steps", lr_milestones=[8], lr_gamma=0.5,
        label_smoothing=0.2, inner_state="reset",
    )  # fmt: skip
    model = initial_model(cfg)
    state = model.state_dict()
    layout = StateLayout.of(state)
    task = RoundTask(
        cfg, TensorSource.load("digits"), uuid.uuid4().hex[:12], 2, layout,
        layout.integers(state), 10, (1, 8, 8), str(tmp_path), tau=3, step=6,
    )  # fmt: skip
    theta = layout.flatten(state)
    contrib = train_partition(task, theta, 0, local_dir=tmp_path)

    def by_hand(smoothing: float) -> tuple[np.ndarray, float]:
        """(the update, the mean loss) of plain SGD at the scheduled rates."""
        model = initial_model(cfg)
        loss_of = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)
        losses = []
        for i, lr in enumerate([0.1 * 7 / 8, 0.1 * 8 / 8, 0.1 * 0.5]):
            x, y = worker_batch(cfg, train_set, 0, 2 * 3 + i)  # the data's position: round x tau
            model.zero_grad(set_to_none=True)
            loss = loss_of(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
            losses.append(loss.item())
        return theta - layout.flatten(model.state_dict()), float(np.mean(losses))

    train_set, _ = digits()
    want, loss = by_hand(0.2)
    np.testing.assert_allclose(contrib.delta_sum, want, rtol=1e-5, atol=1e-7)
    assert contrib.reports[0].loss == pytest.approx(loss, rel=1e-6)
    plain, plain_loss = by_hand(0.0)  # what the smoothing changed: the loss and the update
    assert contrib.reports[0].loss - plain_loss > 1e-5, (contrib.reports[0].loss, plain_loss)
    assert np.abs(contrib.delta_sum - plain).max() > 100 * np.abs(contrib.delta_sum - want).max()


# ---- a run on Spark ----------------------------------------------------------------------------


@pytest.mark.integration
def test_a_resumed_run_takes_the_rates_of_one_that_never_stopped(spark, tmp_path):
    """Warmup, an inner cosine, an outer cosine and label smoothing over 6 rounds, against 3
    rounds resumed to 6: the same rates each round, the same weights; the allreduce transport's
    rates too; then a resume that changes tau goes on from the steps taken (9), not from
    rounds x tau."""
    settings = dict(
        transport="spark", model="mlp", workers=2, tau=3, batch_size=16, lr=0.1, seed=2,
        warmup_steps=5, lr_schedule="cosine", lr_decay_length=6, min_lr=0.01,
        outer="nesterov", outer_lr_schedule="cosine", outer_lr_decay_rounds=6,
        label_smoothing=0.1,
        eval_every=0, checkpoint_every=3,
    )  # fmt: skip
    full = TrainConfig(out=tmp_path / "full", rounds=6, **settings)
    done = train(full, spark=spark).metrics
    part = TrainConfig(out=tmp_path / "part", rounds=3, **settings)
    train(part, spark=spark)
    manifest = json.loads((Path(part.out) / "checkpoints/round-00003/state.json").read_text())
    assert manifest["steps"] == 9
    stored = read_run_config(part.out)
    assert (stored["lr_decay_length"], stored["warmup_steps"]) == (6, 5)
    resumed = train(
        load_train_config(base=stored, flags={"rounds": 6}, environ={}), resume=True, spark=spark
    ).metrics

    def rates(rows):
        return [(r["round"], r["steps"], r["lr"], r["outer_lr"]) for r in rows]

    assert rates(resumed) == rates(done)
    want = [inner_lr(full, Clock.at(full, 0, 3 * r, r, 3)) for r in range(6)]
    assert [r["lr"] for r in done] == want
    assert want[0] == pytest.approx(0.1 / 5)  # the warmup's first step
    assert [r["steps"] for r in done] == [3, 6, 9, 12, 15, 18]
    assert [r["outer_lr"] for r in done][::2] == pytest.approx([0.7, 0.525, 0.175])
    assert_state_equal(load_run_model(part.out), load_run_model(full.out))
    assert (Path(full.out) / "curves.png").stat().st_size > 0
    # the allreduce transport's ranks step at the same rates and keep the same count
    ranks = TrainConfig(out=tmp_path / "ranks", rounds=4, **{**settings, "transport": "allreduce"})
    assert rates(train(ranks, spark=spark).metrics) == rates(done[:4])
    manifest = json.loads((Path(ranks.out) / "checkpoints/round-00003/state.json").read_text())
    assert manifest["steps"] == 9

    # the count goes on from the steps taken: round 4 begins at step 9 at tau 5
    again = TrainConfig(out=tmp_path / "again", rounds=3, **settings)
    train(again, spark=spark)
    changed = load_train_config(
        base=read_run_config(again.out), flags={"rounds": 5, "tau": 5}, environ={}
    )
    rows = train(changed, resume=True, spark=spark, allow_change=True).metrics
    assert [r["steps"] for r in rows] == [3, 6, 9, 14, 19]
    assert [r["lr"] for r in rows[3:]] == [
        inner_lr(changed, Clock.at(changed, 0, first, rnd, 5)) for rnd, first in ((3, 9), (4, 14))
    ]
