"""The algorithm contract of design.md section 3, on a real local Spark (local[2,2]), for both
transports: `spark` (one job per round) and `allreduce` (one barrier stage, torch.distributed)."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import torch
import yaml

from sparknet.config import TrainConfig, load_train_config
from sparknet.data.sources import digits
from sparknet.training.driver import train
from sparknet.training.report import START_UP
from sparknet.training.rundir import read_run_config
from sparknet.training.worker import task_seed
from tests.helpers import (
    assert_state_close,
    assert_state_equal,
    double_batch_reference,
    failed_tasks,
    identical_samples,
    initial_model,
    load_run_model,
    mean_state,
    sgd_step,
    worker_batch,
)

pytestmark = pytest.mark.integration

QUIET = {"eval_every": 0, "checkpoint_every": 0}
TRANSPORTS = pytest.mark.parametrize("transport", ["spark", "allreduce"])


def run(spark, tmp_path, name="run", **settings) -> dict[str, torch.Tensor]:
    cfg = TrainConfig(out=tmp_path / name, **{**QUIET, **settings})
    train(cfg, spark=spark)
    return load_run_model(cfg.out)


@TRANSPORTS
def test_tau1_two_workers_equal_one_worker_with_double_batch(spark, tmp_path, transport):
    cfg = TrainConfig(
        transport=transport,
        model="mlp",
        workers=2,
        tau=1,
        rounds=4,
        batch_size=8,
        lr=0.1,
        momentum=0.0,
        inner_state="reset",
        seed=3,
    )
    got = run(spark, tmp_path, **cfg.model_dump(exclude={"out"}))
    assert_state_close(got, double_batch_reference(cfg, cfg.rounds, lr=0.1))


@pytest.mark.parametrize(("transport", "workers"), [("spark", 3), ("allreduce", 2)])
def test_identical_samples_average_equals_plain_loop_with_momentum(
    spark, tmp_path, transport, workers
):
    """(A barrier stage needs a task slot per worker: local[2,2] has two.)"""
    cfg = TrainConfig(
        transport=transport,
        model="mlp",
        data="tests.helpers:identical_samples",
        num_classes=10,
        workers=workers,
        tau=4,
        rounds=3,
        batch_size=4,
        lr=0.05,
        momentum=0.9,
    )
    got = run(spark, tmp_path, **cfg.model_dump(exclude={"out"}))
    x, y = identical_samples()[0].tensors
    model = initial_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(cfg.rounds * cfg.tau):
        sgd_step(model, opt, x[:4], y[:4])
    assert_state_close(got, model.state_dict(), rtol=1e-5)


@TRANSPORTS
def test_identical_samples_nesterov_equals_hand_written_outer_step(spark, tmp_path, transport):
    cfg = TrainConfig(
        transport=transport,
        model="mlp",
        data="tests.helpers:identical_samples",
        num_classes=10,
        workers=2,
        tau=3,
        rounds=4,
        batch_size=4,
        lr=0.05,
        momentum=0.9,
        outer="nesterov",
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    got = run(spark, tmp_path, **cfg.model_dump(exclude={"out"}))
    x, y = identical_samples()[0].tensors
    model = initial_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # kept across rounds
    theta = [p.detach().clone() for p in model.parameters()]
    buf = [torch.zeros_like(t) for t in theta]
    for _ in range(cfg.rounds):
        with torch.no_grad():
            for p, t in zip(model.parameters(), theta, strict=True):
                p.copy_(t)
        for _ in range(cfg.tau):
            sgd_step(model, opt, x[:4], y[:4])
        for i, p in enumerate(model.parameters()):
            delta = theta[i] - p.detach()
            buf[i] = 0.9 * buf[i] + delta
            theta[i] = theta[i] - 0.7 * (delta + 0.9 * buf[i])
    names = [n for n, _ in model.named_parameters()]
    assert_state_close({n: got[n] for n in names}, dict(zip(names, theta, strict=True)))


@TRANSPORTS
def test_batchnorm_running_statistics_are_the_workers_mean(spark, tmp_path, transport):
    """Under Nesterov too: the outer optimizer steps parameters; buffers take the plain mean
    (an extrapolated running variance goes negative and makes evaluation NaN)."""
    cfg = TrainConfig(
        transport=transport,
        model="cnn",
        workers=2,
        tau=3,
        rounds=1,
        batch_size=16,
        lr=0.1,
        momentum=0.9,
        seed=1,
        outer="nesterov",
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    got = run(spark, tmp_path, **cfg.model_dump(exclude={"out"}))
    train_set, _ = digits()
    init = initial_model(cfg).state_dict()
    finals = []
    for k in range(cfg.workers):
        model = initial_model(cfg)
        model.load_state_dict(init)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(task_seed(cfg.seed, k, 0))
        for step in range(cfg.tau):
            sgd_step(model, opt, *worker_batch(cfg, train_set, k, step))
        finals.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    assert not torch.allclose(finals[0]["1.running_mean"], finals[1]["1.running_mean"])
    mean = mean_state(finals)
    params = {n for n, _ in initial_model(cfg).named_parameters()}
    # first Nesterov step: theta - lr * (1 + mu) * (theta - mean)
    want = {n: init[n] + 0.7 * 1.9 * (m - init[n]) if n in params else m for n, m in mean.items()}
    assert_state_close(got, want, rtol=1e-4, atol=1e-5)
    assert int(got["1.num_batches_tracked"]) == cfg.tau


@TRANSPORTS
def test_same_seed_gives_identical_model_file(spark, tmp_path, transport):
    settings = dict(
        model="cnn", workers=2, tau=3, rounds=3, batch_size=16, seed=9, transport=transport
    )
    run(spark, tmp_path, "a", **settings)
    run(spark, tmp_path, "b", **settings)
    assert filecmp.cmp(
        tmp_path / "a/model.safetensors", tmp_path / "b/model.safetensors", shallow=False
    )
    other = run(spark, tmp_path, "c", **{**settings, "seed": 10})
    assert not torch.equal(other["0.weight"], load_run_model(tmp_path / "a")["0.weight"])


def test_a_task_that_fails_once_is_retried_with_identical_result(spark, tmp_path):
    settings = dict(model="cnn", workers=2, tau=3, rounds=4, batch_size=16, momentum=0.9, seed=2)
    sc = spark.sparkContext
    sc.setJobGroup("clean", "clean run")
    clean = run(spark, tmp_path, "clean", **settings)
    sc.setJobGroup("drill", "run with one failing task")
    retried = run(spark, tmp_path, "drill", fail_once="2:1", **settings)
    sc.setJobGroup("after", "")
    assert failed_tasks(sc, "clean") == 0
    assert failed_tasks(sc, "drill") == 1
    assert_state_equal(retried, clean)


@TRANSPORTS
def test_resume_continues_bit_for_bit(spark, tmp_path, transport):
    settings = dict(
        transport=transport,
        model="cnn",
        workers=2,
        tau=2,
        batch_size=16,
        momentum=0.9,
        seed=4,
        outer="nesterov",
        eval_every=2,
        checkpoint_every=0,
    )
    full = TrainConfig(out=tmp_path / "full", rounds=6, **settings)
    train(full, spark=spark)
    part = TrainConfig(out=tmp_path / "part", rounds=3, **settings)
    train(part, spark=spark)
    # the stored transport is not a setting (`auto` decides again where a resume runs), but
    # `auto` keeps the one the checkpoint was made on where it can run: not named here
    assert "transport" not in read_run_config(part.out)
    resumed = load_train_config(base=read_run_config(part.out), flags={"rounds": 6}, environ={})
    assert resumed.transport == "auto"
    result = train(resumed, resume=True, spark=spark)
    assert yaml.safe_load((Path(part.out) / "config.yaml").read_text())["train"]["transport"] == (
        transport
    )
    assert [r["round"] for r in result.metrics] == [1, 2, 3, 4, 5, 6]
    # each process's first round is marked as holding a start-up: the run's and the resume's
    assert [r["round"] for r in result.metrics if r.get(START_UP)] == [1, 4]
    assert sorted(p.name for p in (Path(part.out) / "checkpoints").iterdir()) == [
        "round-00003",
        "round-00006",
    ]
    assert_state_equal(load_run_model(part.out), load_run_model(full.out))
    assert filecmp.cmp(
        Path(full.out) / "model.safetensors", Path(part.out) / "model.safetensors", shallow=False
    )
    assert all(r["inner_state_misses"] == 0 for r in result.metrics)
