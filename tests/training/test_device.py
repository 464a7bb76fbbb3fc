"""Which device a task trains on, and the kernel settings it trains under.

No GPU exists on the test machine: device selection is a pure function fed fake Spark GPU
addresses, GPU counts and CUDA_VISIBLE_DEVICES values; the worker itself runs in-process on the
CPU with a probe model that records what the settings were while it ran.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import numpy as np
import pytest
import torch
from torch import nn

from sparknet.config import TrainConfig
from sparknet.data.sources import TensorSource
from sparknet.errors import PermanentTaskError
from sparknet.models import build_model
from sparknet.training import device, worker
from sparknet.training.device import select_device
from sparknet.training.state import StateLayout
from sparknet.training.worker import (
    InnerStateStore,
    RoundTask,
    evaluate_partition,
    train_partition,
)


def test_auto_without_gpus_is_the_cpu():
    assert select_device("auto", None, 0, None) == torch.device("cpu")
    assert select_device("auto", [], 0, "") == torch.device("cpu")


def test_cpu_is_the_cpu_even_with_a_spark_gpu():
    assert select_device("cpu", ["1"], 2, None) == torch.device("cpu")


def test_local_mode_with_a_gpu_is_cuda_0():
    assert select_device("auto", None, 2, None) == torch.device("cuda", 0)
    assert select_device("cuda", None, 1, None) == torch.device("cuda", 0)


def test_spark_address_is_the_torch_ordinal():
    assert select_device("auto", ["1"], 2, None) == torch.device("cuda", 1)
    assert select_device("cuda", ["0"], 4, None) == torch.device("cuda", 0)


def test_address_indexes_cuda_visible_devices_as_torch_distributor_does():
    # address 1 among CUDA_VISIBLE_DEVICES=4,5 is physical GPU 5: torch numbers it 1
    assert select_device("auto", ["1"], 2, "4,5") == torch.device("cuda", 1)
    assert select_device("auto", ["0", "1"], 2, "4,5") == torch.device("cuda", 0)


def test_address_beyond_cuda_visible_devices_is_one_line():
    with pytest.raises(PermanentTaskError) as exc:
        select_device("auto", ["2"], 2, "4,5")
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("Spark assigned this task GPU 2 but CUDA_VISIBLE_DEVICES='4,5' lists 2")


def test_malformed_address_is_refused():
    with pytest.raises(PermanentTaskError, match="'01' is not a GPU index"):
        select_device("auto", ["01"], 2, None)


def test_cuda_requested_without_a_gpu_says_what_to_fix():
    with pytest.raises(PermanentTaskError) as exc:
        select_device("cuda", None, 0, None)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg == (
        "--device cuda, but this task has no GPU (Spark assigned none and torch sees none): "
        "give the workers GPUs (--gpus-per-worker), or pass --device auto or cpu"
    )


def test_a_spark_gpu_torch_cannot_see_is_an_error_not_a_silent_cpu_run():
    with pytest.raises(PermanentTaskError, match=r"GPU 0 but torch sees 0 GPU\(s\)"):
        select_device("auto", ["0"], 0, None)


def test_this_machine_trains_on_the_cpu():
    assert device.task_device("auto") == torch.device("cpu")
    with pytest.raises(PermanentTaskError, match=r"^--device cuda, but this task has no GPU"):
        device.task_device("cuda")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cpu_autocasts_to_both_half_precisions(precision):
    cpu = torch.device("cpu")
    device.check_precision(cpu, precision)
    layer = nn.Linear(4, 3)
    with device.autocast(cpu, precision):
        out = layer(torch.randn(2, 4))
    assert out.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert (device.make_scaler(cpu, precision) is not None) == (precision == "fp16")


class ViewFlattens(nn.Module):
    """A user's image model without convolutions: `.view` fails on a channels-last batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(len(x), -1))


def test_channels_last_only_for_conv_nets_on_cuda():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    conv = build_model("cnn", (3, 8, 8), 10)
    assert device.uses_channels_last(cuda, conv)
    assert not device.uses_channels_last(cuda, ViewFlattens())
    assert not device.uses_channels_last(cuda, build_model("mlp", (64,), 10))
    assert not device.uses_channels_last(cpu, conv)
    with pytest.raises(RuntimeError, match="view"):  # what channels-last would do to it
        ViewFlattens()(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last))
    x = torch.randn(2, 1, 8, 8)
    assert device.to_device(x, cpu, channels_last=True) is x


def test_kernel_settings_apply_for_the_task_and_are_restored(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cpu = torch.device("cpu")
    assert not torch.are_deterministic_algorithms_enabled()
    with device.kernel_settings(cpu, deterministic=True):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # unset again after the task
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own value is left alone
    with device.kernel_settings(cpu, deterministic=True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert not torch.backends.cudnn.deterministic
    with device.kernel_settings(torch.device("cuda", 0), deterministic=False):
        assert torch.backends.cudnn.benchmark  # only the flag: nothing runs on CUDA here
    assert not torch.backends.cudnn.benchmark


def test_kernel_settings_leave_the_deterministic_flag_alone_when_it_does_not_change():
    """`torch.use_deterministic_algorithms` imports torch._inductor (about 1.7 s of CPU per
    Python worker): a task that keeps the setting does not call it, and a user's warn-only
    setting comes back as it was."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from sparknet.training import device\n"
        "cpu = torch.device('cpu')\n"
        "with device.kernel_settings(cpu, deterministic=False):\n"
        "    pass\n"
        "print('torch._inductor' in sys.modules)\n"
        "torch.use_deterministic_algorithms(False, warn_only=True)\n"
        "with device.kernel_settings(cpu, deterministic=True):\n"
        "    assert torch.are_deterministic_algorithms_enabled()\n"
        "print(torch.are_deterministic_algorithms_enabled(),\n"
        "      torch.is_deterministic_algorithms_warn_only_enabled())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["False", "False", "True"]


# ---- the worker, in-process --------------------------------------------------------------

SEEN: list[dict] = []


class Probe(nn.Module):
    """The cnn, recording the kernel settings and autocast state each forward pass runs under."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = build_model("cnn", (1, 8, 8), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(
            {
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "autocast": torch.is_autocast_enabled("cpu"),
                "device": x.device.type,
            }
        )
        return self.net(x)


def probe(num_classes: int = 10) -> nn.Module:
    return Probe(num_classes)


class Loud(Probe):
    """The probe with logits 1e4 times larger: fp16 gradients scaled by 2**16 overflow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1e4


def loud(num_classes: int = 10) -> nn.Module:
    return Loud(num_classes)


def _task(tmp_path, model: str = "probe", **settings) -> tuple[RoundTask, np.ndarray]:
    cfg = TrainConfig(model=f"tests.training.test_device:{model}", workers=2, tau=2, **settings)
    torch.manual_seed(0)
    state = probe().state_dict()
    layout = StateLayout.of(state)
    task = RoundTask(
        cfg, TensorSource.load("digits"), uuid.uuid4().hex[:12], 0, layout,
        layout.integers(state), 10, (1, 8, 8), str(tmp_path), cfg.first_tau,
    )  # fmt: skip
    return task, layout.flatten(state)


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_worker_trains_and_evaluates_under_the_task_settings(tmp_path, deterministic):
    SEEN.clear()
    task, theta = _task(tmp_path, deterministic=deterministic, precision="bf16")
    contrib = train_partition(task, theta, 0, local_dir=tmp_path)
    result = evaluate_partition(task, theta, 0)
    assert contrib.delta_sum is not None and np.isfinite(contrib.delta_sum).all()
    assert result.count > 0
    assert len(SEEN) == 2 + (result.count + 255) // 256
    assert {s["deterministic"] for s in SEEN} == {deterministic}
    assert {s["autocast"] for s in SEEN} == {True}
    assert {s["device"] for s in SEEN} == {"cpu"}
    assert not torch.are_deterministic_algorithms_enabled()  # restored for the next task


def test_cuda_requested_on_this_machine_fails_the_task_permanently(tmp_path):
    task, theta = _task(tmp_path, device="cuda")
    with pytest.raises(PermanentTaskError, match=r"^--device cuda, but this task has no GPU"):
        train_partition(task, theta, 0, local_dir=tmp_path)


@pytest.mark.parametrize("inner_state", ["keep", "reset"])
def test_fp16_skipped_steps_are_counted_and_the_loss_scale_is_kept(tmp_path, inner_state):
    """Every step overflows: each is counted, and the next round starts from the lowered scale
    even under reset (a scaler fresh at 2**16 every round would skip every step forever)."""
    task, theta = _task(tmp_path, "loud", precision="fp16", inner_state=inner_state)
    scales = []
    for rnd in range(2):
        at = dataclasses.replace(task, round=rnd)
        report = train_partition(at, theta, 0, local_dir=tmp_path).reports[0]
        assert report.skipped_steps == task.cfg.tau
        kept = InnerStateStore(tmp_path, task.run_id).load(0, rnd)
        scales.append(kept["scaler"]["scale"])
    assert scales == [2.0**14, 2.0**12]


def test_a_reused_worker_keeps_only_the_last_architecture(tmp_path, monkeypatch):
    emptied = []  # no GPU here: the cache emptying is recorded, not run
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(worker, "_MODELS", {})
    cpu = torch.device("cpu")
    probe_task, _ = _task(tmp_path)
    loud_task, _ = _task(tmp_path, "loud")
    first = worker._model_for(probe_task, cpu)
    assert worker._model_for(probe_task, cpu) is first
    worker._model_for(loud_task, cpu)
    assert [key[0] for key in worker._MODELS] == ["tests.training.test_device:loud"]
    assert emptied == []
    worker._MODELS[("gone", 10, (1, 8, 8), "cuda:0")] = first  # as if a GPU model were kept
    assert worker._model_for(probe_task, cpu) is not first
    assert [key[0] for key in worker._MODELS] == ["tests.training.test_device:probe"]
    assert emptied == [True]


def test_a_round_whose_fp16_scaler_skipped_most_steps_is_warned_about():
    """The driver's round callback: half the round's steps skipped or more is one warning naming
    the count; fewer is none (a loss scaler skips a step now and then by design)."""
    from sparknet.training import driver, rounds

    begin = rounds.StartPoint(None, None, {}, 0, 0.0)
    warned, rows = [], []
    on_row = driver._with_warnings(
        rows.append, warned.append, begin, TrainConfig(workers=2, tau=4)
    )  # 8 steps a round
    on_row({"round": 1, "skipped_steps": 3})
    on_row({"round": 2, "skipped_steps": 4})
    assert [r["round"] for r in rows] == [1, 2]
    assert warned == [
        "round 2: the fp16 loss scaler skipped 4 of 8 steps (gradients overflowed); if this "
        "goes on, lower --lr or use --precision bf16"
    ]
    auto = driver._with_warnings(None, warned.append, begin, TrainConfig(workers=2, tau="auto"))
    auto({"round": 7, "tau": 50, "skipped_steps": 40})  # 40 of 100: the round's own tau counts
    assert len(warned) == 1
