"""`sparknet bench scaling`'s C and S from measured rounds, on made-up rounds whose answer is
known."""

from __future__ import annotations

import pytest

from sparknet.bench.scaling import Measured, measure_costs


def _run(workers: int, tau: int, totals: list[float], computes: list[float]) -> Measured:
    rows = [{"seconds": {"total": t, "compute": c}} for t, c in zip(totals, computes, strict=True)]
    return Measured(workers, tau, rows)


def test_c_is_the_slope_over_tau_and_s_each_ks_own_rest():
    """Rounds of 5 ms + 2 ms a step at K=1 and 9 ms + 2 ms a step at K=2: C = 2 ms, S(1) = 5 ms,
    S(2) = 9 ms, and S for larger K the largest measured K's."""
    runs = [_run(1, t, [0.005 + 0.002 * t] * 3, [0.001 + 0.002 * t] * 3) for t in (1, 5, 20)]
    runs += [_run(2, t, [0.009 + 0.002 * t] * 3, [0.001 + 0.002 * t] * 3) for t in (1, 5, 20)]
    costs = measure_costs(runs)
    step = costs.C
    assert costs.C_is_slope and step == pytest.approx(0.002)
    assert costs.S_by_k == pytest.approx({1: 0.005, 2: 0.009})
    assert (costs.S, costs.S_workers, costs.S_at(32)) == (costs.S_by_k[2], 2, costs.S_by_k[2])


def test_a_slope_lost_in_noise_falls_back_to_compute_over_steps():
    """Two close taus whose rounds got shorter (noise): no slope, C = compute over steps."""
    runs = [_run(1, 1, [0.010, 0.010], [0.003, 0.003]), _run(1, 2, [0.009, 0.009], [0.004] * 2)]
    costs = measure_costs(runs)
    assert not costs.C_is_slope
    step = costs.C
    assert step == pytest.approx((0.006 + 0.008) / 6)


def test_a_slope_that_leaves_a_k_no_sync_falls_back_to_compute_over_steps():
    """K=1's longer rounds slowed by a busy machine: the slope (30 ms a step) would make K=2's
    rounds (25 and 45 ms at tau 1 and 2) cost less than their steps; C is compute over steps
    and every S stays above zero (the run CI once refused with S < 0)."""
    runs = [_run(1, 1, [0.010] * 2, [0.004] * 2), _run(1, 2, [0.040] * 2, [0.008] * 2)]
    runs += [_run(2, 1, [0.025] * 2, [0.004] * 2), _run(2, 2, [0.045] * 2, [0.008] * 2)]
    costs = measure_costs(runs)
    assert not costs.C_is_slope
    assert pytest.approx(0.024 / 6) == costs.C
    assert costs.S_by_k == pytest.approx({1: 0.025 - 1.5 * 0.004, 2: 0.035 - 1.5 * 0.004})


def test_a_k_left_no_sync_by_either_c_takes_its_rounds_time_outside_the_steps():
    """K=1's steps slowed by a busy machine (compute 46 ms a step) and K=2's rounds shorter
    than tau steps of that (the run CI refused with S=-2.3 ms): K=2's S is its rounds' own
    time outside the steps, and C stays compute over steps."""
    runs = [_run(1, 1, [0.060] * 2, [0.046] * 2), _run(1, 2, [0.100] * 2, [0.092] * 2)]
    runs += [_run(2, 1, [0.040] * 2, [0.030] * 2), _run(2, 2, [0.080] * 2, [0.070] * 2)]
    costs = measure_costs(runs)
    assert not costs.C_is_slope
    assert pytest.approx(0.046) == costs.C
    assert costs.S_direct == (2,)
    assert costs.S_by_k == pytest.approx({1: 0.011, 2: 0.010})
    assert costs.S > 0
