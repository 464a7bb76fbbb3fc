"""The math of fragments and overlap (`sparknet.training.sync`), pinned against the algorithms
written out as their papers state them: K workers run as threads, each with its own
`Synchronizer`, over an exchange that is the exact mean of what the K of them sent (the real
collectives are tested in test_compress and, end to end, test_slow_links)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from sparknet.training.outer import OuterOptimizer
from sparknet.training.state import StateLayout
from sparknet.training.sync import RankState, Synchronizer, due, fragments_of, layers_of

LR, MU = 0.7, 0.9


def _layout(*sizes: int) -> StateLayout:
    """A model of layers `l0`, `l1`, ... with one weight of the given size each."""
    return StateLayout.of({f"l{i}.weight": torch.zeros(n) for i, n in enumerate(sizes)})


def _step(k: int, r: int, w: np.ndarray) -> np.ndarray:
    """Worker k's progress in round r from weights w (start minus end): a step towards its own
    target, so where a worker starts matters, as in training."""
    target = np.linspace(-1.0, 1.0, w.size, dtype=np.float32) * (k + 1) + 0.1 * r
    return (0.3 * (w - target)).astype(np.float32)


class _MeanOfK:
    """An exchange among K threads: each call blocks until all K have sent, and every one gets
    the mean of the K buffers, summed in rank order (what an all-reduce gives)."""

    def __init__(self, k: int) -> None:
        self.k, self.sent = k, [None] * k
        self.barrier = threading.Barrier(k)

    def of(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def exchange(buf: torch.Tensor) -> torch.Tensor:
            self.sent[rank] = buf.clone()
            self.barrier.wait()
            total = self.sent[0].clone()
            for other in self.sent[1:]:
                total += other
            self.barrier.wait()
            return buf.copy_(total / self.k)

        return exchange


def _run(
    layout: StateLayout, k: int, n: int, overlap: bool, rounds: int, theta: np.ndarray,
    *, lr: float = LR, mu: float = MU, stop_after: int | None = None,
    states: list[RankState | None] | None = None, momentum: np.ndarray | None = None,
    first: int = 0,
) -> tuple[np.ndarray, list[Synchronizer]]:  # fmt: skip
    """K threads of `rounds` rounds from round `first`; the final weights after the last (or
    the global ones after round `stop_after`), and the synchronizers as a checkpoint finds
    them."""
    mean = _MeanOfK(k)
    syncs = [
        Synchronizer(
            layout,
            fragments_of(layout, n),
            theta,
            lr=lr,
            momentum=mu,
            momentum_buffer=momentum,
            overlap=overlap,
            exchange=mean.of(rank),
            rank_state=None if states is None else states[rank],
        )
        for rank in range(k)
    ]
    finals: list[np.ndarray] = [s.theta for s in syncs]

    def worker(rank: int) -> None:
        try:
            sync = syncs[rank]
            for r in range(first, rounds):
                sync.end_round(r, _step(rank, r, sync.start))
                if r == stop_after:
                    return
            finals[rank] = sync.final_weights()
        except BaseException:
            mean.barrier.abort()  # the other threads stop waiting for this one
            raise

    with concurrent.futures.ThreadPoolExecutor(k) as pool:
        list(pool.map(worker, range(k)))  # raises a worker's error
    assert all((f == finals[0]).all() for f in finals)  # every rank holds the same weights
    return finals[0].copy(), syncs


def _nesterov(theta: np.ndarray, b: np.ndarray | None, g: np.ndarray, lr=LR, mu=MU):
    """One step of SGD with Nesterov momentum, as the DiLoCo paper writes it."""
    b = g.copy() if b is None else mu * b + g
    return theta - lr * (g + mu * b), b


THETA = np.linspace(0.5, -0.5, 18, dtype=np.float32)


def test_one_fragment_without_overlap_is_the_blocking_round_bit_for_bit():
    """The blocking round as it is without this module: every worker starts from the global
    weights, the mean update is stepped at once."""
    layout = _layout(8, 10)
    got, _ = _run(layout, 2, 1, False, 4, THETA)
    outer = OuterOptimizer(THETA, LR, MU)
    theta = THETA.copy()
    for r in range(4):
        deltas = [_step(k, r, theta) for k in range(2)]
        theta = outer.step((deltas[0] + deltas[1]) / np.float32(2)).copy()
    assert (got == theta).all()


def test_overlap_with_one_worker_is_the_written_out_delayed_update():
    """x_{r+1} = G_r - d_r (the worker goes on from its own weights); G_{r+1} = outer(G_r, d_r)
    lands a round late; the last round lands both what is in flight and its own progress."""
    layout, rounds = _layout(8, 10), 5
    got, _ = _run(layout, 1, 1, True, rounds, THETA)
    g, b, x = THETA.astype(np.float64), None, THETA.astype(np.float64)
    sent = None
    for r in range(rounds):
        d = _step(0, r, x.astype(np.float32)).astype(np.float64)
        if sent is not None:
            g, b = _nesterov(g, b, sent)
        x, sent = g - d, d
    g, b = _nesterov(g, b, sent)  # the last round's own progress
    np.testing.assert_allclose(got, g, rtol=0, atol=1e-5)


def test_fragments_are_streaming_diloco_as_the_paper_writes_it():
    """Fragment p syncs after rounds r = p mod N: its outer gradient is the global fragment
    minus each worker's, averaged; the global fragment takes an outer step and every worker
    takes it; the other fragments go on locally. The last round syncs every fragment."""
    layout, k, n, rounds = _layout(3, 3, 3, 3, 3, 3), 2, 3, 7
    got, _ = _run(layout, k, n, False, rounds, THETA)
    frags = fragments_of(layout, n)
    g = THETA.astype(np.float64)
    w = [g.copy() for _ in range(k)]
    b: list[np.ndarray | None] = [None] * n
    for r in range(rounds):
        for j in range(k):
            w[j] = w[j] - _step(j, r, w[j].astype(np.float32))
        for p in range(n) if r == rounds - 1 else [r % n]:
            idx = np.concatenate([np.arange(a, z) for a, z in frags[p].spans])
            outer_grad = np.mean([g[idx] - w[j][idx] for j in range(k)], axis=0)
            g[idx], b[p] = _nesterov(g[idx], b[p], outer_grad)
            for j in range(k):
                w[j][idx] = g[idx]
    np.testing.assert_allclose(got, g, rtol=0, atol=1e-5)


def test_a_round_moves_one_fragment_of_the_bytes():
    sent: list[int] = []

    def exchange(buf: torch.Tensor) -> torch.Tensor:
        sent.append(buf.numel())
        return buf

    layout = _layout(4, 4, 4, 4)
    sync = Synchronizer(
        layout, fragments_of(layout, 4), np.zeros(16, np.float32), lr=1.0, momentum=0.0,
        momentum_buffer=None, overlap=True, exchange=exchange,
    )  # fmt: skip
    for r in range(6):
        sync.end_round(r, np.ones(16, np.float32))
    sync.final_weights()
    sync.close()
    assert sent == [4] * 6 + [4] * 3  # one a round; the final weights take the three unsent


@pytest.mark.parametrize("overlap", [False, True])
def test_a_resume_from_the_ranks_states_goes_on_bit_for_bit(overlap):
    """Stopped after round 3, with each rank's state and the global state as a checkpoint
    holds them, and resumed: the very weights of the run that went through."""
    layout, k, n, rounds = _layout(2, 3, 4, 5), 2, 2, 8
    whole, _ = _run(layout, k, n, overlap, rounds, THETA[:14])
    _, syncs = _run(layout, k, n, overlap, rounds, THETA[:14], stop_after=3)
    states = [s.rank_state() for s in syncs]
    if overlap:
        assert all(s.sent is not None and s.fragment == due(3, n) for s in states)
    theta, momentum = syncs[0].theta.copy(), syncs[0].momentum_buffer
    for s in syncs:
        s.close()
    resumed, _ = _run(
        layout, k, n, overlap, rounds, theta, states=states, momentum=momentum, first=4
    )
    assert (resumed == whole).all()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_run_that_ended_goes_on_with_more_rounds_as_if_it_never_had(overlap):
    """The final weights are made on copies: a run of 4 rounds, continued to 8 from the state
    its end left, ends with the very weights of a run of 8 (whose round 4 sent nothing extra)."""
    layout, k, n = _layout(2, 3, 4, 5), 2, 3
    whole, _ = _run(layout, k, n, overlap, 8, THETA[:14])
    short, syncs = _run(layout, k, n, overlap, 4, THETA[:14])
    assert not (short == syncs[0].theta).all()  # its model holds what was still unsent
    states = [s.rank_state() for s in syncs]
    theta, momentum = syncs[0].theta.copy(), syncs[0].momentum_buffer
    for s in syncs:
        s.close()
    longer, _ = _run(layout, k, n, overlap, 8, theta, states=states, momentum=momentum, first=4)
    assert (longer == whole).all()


def test_fragments_balance_the_layers_round_robin_where_they_are_equal():
    equal = fragments_of(_layout(4, 4, 4, 4, 4, 4), 3)
    assert [f.spans for f in equal] == [((0, 4), (12, 16)), ((4, 8), (16, 20)), ((8, 12), (20, 24))]
    unequal = fragments_of(_layout(10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), 2)
    assert sorted(f.size for f in unequal) == [10, 10]
    layers = _layout(3, 3)
    assert len(layers_of(layers)) == 2
    with pytest.raises(ValueError, match="2 layer"):
        fragments_of(layers, 3)


def test_a_layers_weight_bias_and_running_stats_sync_together():
    bn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    layout = StateLayout.of_model(bn)
    frags = fragments_of(layout, 2)
    spans = {e.name: (e.offset, e.offset + e.numel) for e in layout.entries if e.offset >= 0}
    for layer in ("0", "1", "2"):
        owners = {
            i for i, f in enumerate(frags) for name, (a, z) in spans.items()
            if name.startswith(layer + ".") and any(s <= a and z <= t for s, t in f.spans)
        }  # fmt: skip
        assert len(owners) == 1, layer
