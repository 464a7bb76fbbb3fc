"""Resuming a worker's inner optimizer state with changed settings (pure PyTorch, no Spark)."""

from __future__ import annotations

import torch

from sparknet.config import TrainConfig
from sparknet.training.worker import (
    load_inner_state,
    make_inner_optimizer,
    pack_inner_state,
    unpack_inner_state,
)


def _stepped_state(cfg: TrainConfig) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make_inner_optimizer(cfg, model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt.state_dict()


def test_a_resumed_state_keeps_the_new_lr_momentum_and_weight_decay():
    model, saved = _stepped_state(TrainConfig(lr=0.05, momentum=0.9))
    now = TrainConfig(lr=0.2, momentum=0.5, weight_decay=0.01)
    opt = make_inner_optimizer(now, model.parameters())
    assert load_inner_state(opt, saved)
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.2, 0.5, 0.01)
    buf = opt.state[model.weight]["momentum_buffer"]
    assert torch.equal(buf, saved["state"][0]["momentum_buffer"])  # the buffers are kept


def test_a_state_of_another_optimizer_is_not_loaded_and_training_goes_on():
    model, saved = _stepped_state(TrainConfig(optimizer="sgd"))
    opt = make_inner_optimizer(TrainConfig(optimizer="adamw"), model.parameters())
    assert not load_inner_state(opt, saved)
    assert len(opt.state) == 0
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # a loaded SGD state would raise KeyError: 'step'
    assert opt.param_groups[0]["lr"] == 0.05


def _fp16_step(model: torch.nn.Module, opt, scaler) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(5, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_the_fp16_loss_scale_travels_with_the_optimizer_state():
    cfg = TrainConfig(lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make_inner_optimizer(cfg, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for _ in range(3):
        _fp16_step(model, opt, scaler)
    packed = pack_inner_state(opt, scaler)
    assert set(packed) == {"optimizer", "scaler"}
    assert packed["scaler"]["scale"] == 2.0**10 and packed["scaler"]["_growth_tracker"] == 3

    again = make_inner_optimizer(cfg, model.parameters())
    fresh = torch.amp.GradScaler("cpu")
    assert unpack_inner_state(again, fresh, packed)
    assert fresh.state_dict() == scaler.state_dict()
    buf = again.state[model.weight]["momentum_buffer"]
    assert torch.equal(buf, opt.state[model.weight]["momentum_buffer"])


def test_an_older_plain_optimizer_state_still_loads():
    model, saved = _stepped_state(TrainConfig(lr=0.05, momentum=0.9))
    opt = make_inner_optimizer(TrainConfig(lr=0.05, momentum=0.9), model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    assert unpack_inner_state(opt, scaler, saved)  # not a miss
    assert torch.equal(
        opt.state[model.weight]["momentum_buffer"], saved["state"][0]["momentum_buffer"]
    )
    assert scaler.state_dict()["_growth_tracker"] == 0  # a fresh loss scale


def test_a_state_written_at_fp32_leaves_an_fp16_scaler_fresh():
    model, saved = _stepped_state(TrainConfig(momentum=0.9))
    fp32 = make_inner_optimizer(TrainConfig(momentum=0.9), model.parameters())
    fp32.load_state_dict(saved)
    packed = pack_inner_state(fp32, None)
    assert packed["scaler"] == {}
    scaler = torch.amp.GradScaler("cpu")
    assert unpack_inner_state(
        make_inner_optimizer(TrainConfig(), model.parameters()), scaler, packed
    )
    assert scaler.state_dict()["scale"] == 2.0**16
