"""Learning-rate schedules: the lr of every inner step and of every outer step, as pure functions.

A run's inner steps are counted once, along its trajectory: the global step is the number of
inner steps taken before this one (each worker takes the same, so K does not change it; under tau
auto each round adds the tau it ran with), kept in every checkpoint so that a resume goes on at
the same count. Nothing else is state: the lr of a step is a function of where it stands
(`Clock`), so a resumed or replayed round takes exactly the rates an uninterrupted one did.

    lr(step) = warmup(step) * (min_lr + (lr - min_lr) * decay(position))

- `warmup`: (step + 1) / warmup_steps for the first warmup_steps steps, then 1 (linear, in
  steps, so the first step already learns). It multiplies the schedule, whose clock starts at 0.
- `decay` at the step's position in `lr_unit`: `rounds` (the rounds done, plus the share of its
  own round: r + i/tau), `steps` (the global step) or `epochs` (the samples all workers took
  before it, step x K x batch_size, over the training set's size):
  constant 1; `step` gamma^floor(p / lr_step_size); `multistep` gamma^(milestones <= p);
  `cosine` (1 + cos(pi * min(p / lr_decay_length, 1))) / 2, down to min_lr.

The outer lr of round r (0-based) is outer_lr, or under `outer_lr_schedule: cosine` outer_lr x
cosine(r / outer_lr_decay_rounds), in rounds whatever lr_unit says: its length is the run's
rounds unless given (never fewer), so the first round is at the full rate and none within the
run at 0. Positions are exact fractions: a milestone at epoch 30 falls on the step it should,
whatever the float rounding of step x K x B / N would say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparknet.config import TrainConfig


@dataclass(frozen=True)
class Clock:
    """Where one inner step stands, in each unit a schedule may count.

    Args:
        steps: inner steps taken before it (the global step, 0 for a run's first).
        rounds: rounds done before it plus the share of its own round done: r + i/tau.
        epochs: passes over the training set the workers' samples made before it.
    """

    steps: int
    rounds: Fraction
    epochs: Fraction

    @staticmethod
    def at(
        cfg: TrainConfig, train_size: int, first_step: int, rnd: int, tau: int, i: int = 0
    ) -> Clock:
        """The clock of step `i` (0-based) of round `rnd` (0-based), a round of `tau` steps that
        begins after `first_step` steps; `train_size` samples make an epoch."""
        steps = first_step + i
        return Clock(
            steps,
            Fraction(rnd) + Fraction(i, tau),
            Fraction(steps * cfg.workers * cfg.batch_size, max(1, train_size)),
        )

    def position(self, unit: str) -> Fraction:
        """The clock in `unit`: `steps`, `rounds` or `epochs`."""
        return {"steps": Fraction(self.steps), "rounds": self.rounds, "epochs": self.epochs}[unit]


def cosine(progress: Fraction | float) -> float:
    """(1 + cos(pi * t)) / 2 for t = `progress` clamped to [0, 1]: 1 at the start, 0 at the end."""
    t = min(max(float(progress), 0.0), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * t))


def decay(cfg: TrainConfig, at: Clock) -> float:
    """The inner schedule's factor (1 at the start) at `at`, warmup left out."""
    if cfg.lr_schedule == "constant":
        return 1.0
    assert cfg.lr_unit is not None  # filled in by the settings where a schedule counts one
    p = at.position(cfg.lr_unit)
    if cfg.lr_schedule == "step":
        assert cfg.lr_step_size is not None and cfg.lr_gamma is not None  # the settings' check
        return cfg.lr_gamma ** math.floor(p / cfg.lr_step_size)
    if cfg.lr_schedule == "multistep":
        assert cfg.lr_gamma is not None  # filled in by the settings
        return cfg.lr_gamma ** sum(1 for m in cfg.lr_milestones if p >= m)
    if cfg.lr_schedule == "cosine":
        assert cfg.lr_decay_length is not None  # filled in by the settings
        return cosine(p / Fraction(cfg.lr_decay_length))
    return 1.0


def warmup(cfg: TrainConfig, steps: int) -> float:
    """The linear warmup's factor of the step after `steps` steps: (steps + 1) / warmup_steps
    while it lasts, then 1."""
    if steps >= cfg.warmup_steps:
        return 1.0
    return (steps + 1) / cfg.warmup_steps


def inner_lr(cfg: TrainConfig, at: Clock) -> float:
    """The inner optimizer's lr for the step at `at` (see the module docstring)."""
    scheduled = cfg.min_lr + (cfg.lr - cfg.min_lr) * decay(cfg, at)
    return warmup(cfg, at.steps) * scheduled


def round_lrs(
    cfg: TrainConfig, train_size: int, first_step: int, rnd: int, tau: int
) -> list[float]:
    """The lr of each of the `tau` steps of round `rnd`, which begins after `first_step` steps."""
    return [inner_lr(cfg, Clock.at(cfg, train_size, first_step, rnd, tau, i)) for i in range(tau)]


def outer_lr(cfg: TrainConfig, train_size: int, first_step: int, rnd: int, tau: int) -> float:
    """The outer optimizer's lr for the step that ends round `rnd` (see the module docstring)."""
    assert cfg.outer_lr is not None  # filled in by the settings
    if cfg.outer_lr_schedule == "constant":
        return cfg.outer_lr
    assert cfg.outer_lr_decay_rounds is not None  # filled in by the settings
    return cfg.outer_lr * cosine(Fraction(rnd, cfg.outer_lr_decay_rounds))


def round_fields(
    cfg: TrainConfig, train_size: int, first_step: int, rnd: int, tau: int
) -> dict[str, float | int]:
    """A round's metrics.jsonl fields of the schedule: `lr` (its first step's), `outer_lr` (its
    outer step's, under nesterov) and `steps` (the inner steps taken once it is done)."""
    at = Clock.at(cfg, train_size, first_step, rnd, tau)
    fields: dict[str, float | int] = {"lr": inner_lr(cfg, at), "steps": first_step + tau}
    if cfg.outer == "nesterov":
        fields["outer_lr"] = outer_lr(cfg, train_size, first_step, rnd, tau)
    return fields
