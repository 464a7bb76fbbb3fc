"""Outer optimizers: how the driver turns the workers' averaged update into the next weights.

Each worker k returns a pseudo-gradient delta_k = theta_r - theta_k (what it would subtract from
the global weights; `StateLayout.pseudo_gradient`). The driver takes their mean, never the sum,
and hands it to an outer optimizer as if it were a gradient:

- `average` (SparkNet): SGD with lr 1 and no momentum, so theta_{r+1} = mean_k theta_k.
- `nesterov` (DiLoCo): SGD with Nesterov momentum, exactly `torch.optim.SGD(nesterov=True)`:
  b <- mu * b + delta;  theta <- theta - lr * (delta + mu * b).

Either way only parameters are stepped: float buffers (BatchNorm running statistics, marked by
`StateLayout.buffer_mask`) take the workers' plain mean, theta - delta. An extrapolated running
variance can go below zero and make every evaluation NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from sparknet.config import TrainConfig
    from sparknet.training.state import StateLayout


def mean_update(delta_sum: np.ndarray, workers: int) -> np.ndarray:
    """delta = (1/K) * sum_k delta_k. The mean keeps the step size independent of K."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return delta_sum / np.float32(workers)


class OuterOptimizer:
    """SGD over the flat global weights, fed the mean pseudo-gradient each round.

    Args:
        theta: initial global weights (float32, copied).
        lr: outer learning rate; 1.0 with momentum 0 is plain SparkNet averaging.
        momentum: Nesterov momentum; 0 turns Nesterov off.
        buffers: True at the positions of float buffers, which are averaged, never stepped.

    Example:
        >>> opt = OuterOptimizer(np.zeros(3, np.float32), lr=1.0, momentum=0.0)
        >>> opt.step(np.ones(3, np.float32)).tolist()
        [-1.0, -1.0, -1.0]
    """

    def __init__(
        self, theta: np.ndarray, lr: float, momentum: float, buffers: np.ndarray | None = None
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.theta = torch.tensor(theta, dtype=torch.float32)
        self._opt = torch.optim.SGD([self.theta], lr=lr, momentum=momentum, nesterov=momentum > 0)
        self._buffers = None if buffers is None else torch.from_numpy(np.asarray(buffers, bool))

    @torch.no_grad()
    def step(self, delta: np.ndarray) -> np.ndarray:
        """Apply one outer step; returns the new global weights (a view, do not modify).
        Buffers get theta - delta, the workers' mean; their momentum stays zero."""
        grad = torch.from_numpy(delta)
        if self._buffers is not None:
            mean = self.theta[self._buffers] - grad[self._buffers]
            grad = grad.masked_fill(self._buffers, 0.0)
        self.theta.grad = grad
        self._opt.step()
        self.theta.grad = None
        if self._buffers is not None:
            self.theta[self._buffers] = mean
        return self.theta.numpy()

    @property
    def lr(self) -> float:
        """The rate the next step takes."""
        return self._opt.param_groups[0]["lr"]

    @lr.setter
    def lr(self, lr: float) -> None:
        """A schedule's rate for the steps to come (the momentum buffer is kept)."""
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        self._opt.param_groups[0]["lr"] = lr

    def trial(self, delta: np.ndarray) -> np.ndarray:
        """The weights `step(delta)` would give, this optimizer left as it is."""
        group, mask = self._opt.param_groups[0], self._buffers
        buffers = None if mask is None else mask.numpy()
        other = OuterOptimizer(self.theta.numpy(), 1.0, group["momentum"], buffers)
        other.lr = group["lr"]  # a schedule's, which may have come down to 0
        other.load_momentum_buffer(None if (b := self.momentum_buffer) is None else b.copy())
        return other.step(delta).copy()

    @property
    def momentum_buffer(self) -> np.ndarray | None:
        buf = self._opt.state.get(self.theta, {}).get("momentum_buffer")
        return None if buf is None else buf.numpy()

    def load_momentum_buffer(self, buf: np.ndarray | None) -> None:
        if buf is not None:
            self._opt.state[self.theta]["momentum_buffer"] = torch.tensor(buf)


def outer_at(
    cfg: TrainConfig, layout: StateLayout, theta: np.ndarray, momentum: np.ndarray | None
) -> OuterOptimizer:
    """The outer optimizer at `theta` with `momentum` as its buffer (None: a fresh one): the one
    way a run makes one, whether it starts, resumes, or replays from a checkpoint."""
    outer = OuterOptimizer(theta, cfg.outer_lr, cfg.outer_momentum, layout.buffer_mask())
    outer.load_momentum_buffer(momentum)
    return outer
