"""Mixed precision on the CPU, on a real local Spark (local[2,2]): each precision trains, and a run
interrupted at a checkpoint and resumed ends bit-identical to an uninterrupted one. No GPU exists
on the test machine; the same code path runs on GPUs with the device set to cuda."""

from __future__ import annotations

import filecmp
import itertools
import math
import subprocess

import pytest
import torch

from sparknet.config import TrainConfig, load_train_config
from sparknet.training.driver import train
from sparknet.training.rundir import read_run_config
from tests.conftest import REPO, SPARKNET
from tests.helpers import load_run_model

pytestmark = pytest.mark.integration

SETTINGS = dict(model="cnn", workers=2, tau=3, batch_size=16, lr=0.1, momentum=0.9, seed=5)


def inner_state(run_dir, rounds: int, partition: int = 0) -> dict:
    path = (
        run_dir / "checkpoints" / f"round-{rounds:05d}" / "inner" / f"partition-{partition:05d}.pt"
    )
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def fp32_run(spark, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32") / "run"
    cfg = TrainConfig(out=out, rounds=4, eval_every=4, checkpoint_every=0, **SETTINGS)
    return train(cfg, spark=spark).metrics, load_run_model(out)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_precision_trains(spark, tmp_path, fp32_run, precision):
    out = tmp_path / precision
    cfg = TrainConfig(
        out=out, rounds=4, eval_every=4, checkpoint_every=0, precision=precision, **SETTINGS
    )
    rows = train(cfg, spark=spark).metrics
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < losses[0] - 0.1, losses
    # evaluated at that precision too: near fp32's accuracy, not off by a broken cast
    assert abs(rows[-1]["eval_accuracy"] - fp32_run[0][-1]["eval_accuracy"]) < 0.05
    model = load_run_model(out)
    assert all(t.dtype == torch.float32 for k, t in model.items() if "num_batches" not in k)
    if precision == "fp32":
        return
    # the forward pass really ran at half precision: the weights differ from fp32's
    assert not torch.equal(model["0.weight"], fp32_run[1]["0.weight"])
    scale = inner_state(out, 4)["scaler"]
    if precision == "bf16":
        assert scale == {}
    else:  # kept across rounds: a scaler made fresh every round would count only tau steps
        assert scale["_growth_tracker"] == 4 * cfg.tau and scale["scale"] == 2.0**16


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_at_half_precision_is_bit_exact(spark, tmp_path, precision):
    settings = dict(SETTINGS, precision=precision, eval_every=0, checkpoint_every=0)
    full, part = tmp_path / "full", tmp_path / "part"
    train(TrainConfig(out=full, rounds=4, **settings), spark=spark)
    train(TrainConfig(out=part, rounds=2, **settings), spark=spark)
    resumed = load_train_config(base=read_run_config(part), flags={"rounds": 4}, environ={})
    assert resumed.precision == precision
    result = train(resumed, resume=True, spark=spark)
    assert [r["round"] for r in result.metrics] == [1, 2, 3, 4]
    assert all(r["inner_state_misses"] == 0 for r in result.metrics)
    assert filecmp.cmp(full / "model.safetensors", part / "model.safetensors", shallow=False)
    for k in range(2):
        want, got = inner_state(full, 4, k), inner_state(part, 4, k)
        assert got["scaler"] == want["scaler"]
        for a, b in zip(
            want["optimizer"]["state"].values(), got["optimizer"]["state"].values(), strict=True
        ):
            assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


@pytest.mark.slow
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [str(SPARKNET), "train", "--device", "cuda", "--model", "mlp", "--workers", "1",
         "--rounds", "1", "--out", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: --device cuda, but torch ")
    assert errors[0].endswith(
        "sees no GPU on this machine: pass --device auto or cpu, or install a CUDA build of torch"
    )
    assert "Traceback" not in proc.stderr
    assert "starting Spark" not in proc.stderr  # refused before Spark starts
    assert not (tmp_path / "run").exists()  # nothing half-written
