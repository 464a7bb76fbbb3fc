"""Resuming a worker's inner optimizer state with changed settings (pure PyTorch, no Spark)."""

from __future__ import annotations

import torch

from sparknet.config import TrainConfig
from sparknet.training.worker import load_inner_state, make_inner_optimizer


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
