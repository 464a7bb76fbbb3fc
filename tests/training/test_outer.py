import numpy as np
import pytest
import torch

from sparknet.training.outer import OuterOptimizer, mean_update


def test_average_is_mean_not_sum():
    theta = np.array([1.0, 1.0, 1.0], np.float32)
    workers = [np.array(v, np.float32) for v in ([0.0, 1.0, 2.0], [2.0, 1.0, 0.0], [1.0, 4.0, 1.0])]
    delta_sum = sum(theta - w for w in workers)
    opt = OuterOptimizer(theta, lr=1.0, momentum=0.0)
    new = opt.step(mean_update(delta_sum, len(workers)))
    np.testing.assert_allclose(new, np.mean(workers, axis=0), rtol=1e-6)
    assert opt.momentum_buffer is None


def test_nesterov_matches_hand_written_formula():
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(5).astype(np.float32)
    opt = OuterOptimizer(theta, lr=0.7, momentum=0.9)
    ref, buf = theta.astype(np.float64), np.zeros(5)
    for _ in range(4):
        delta = rng.standard_normal(5).astype(np.float32)
        got = opt.step(delta)
        buf = 0.9 * buf + delta
        ref = ref - 0.7 * (delta + 0.9 * buf)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    np.testing.assert_allclose(opt.momentum_buffer, buf, rtol=1e-5)


def test_momentum_buffer_round_trips():
    theta = np.zeros(3, np.float32)
    a = OuterOptimizer(theta, lr=0.7, momentum=0.9)
    a.step(np.ones(3, np.float32))
    b = OuterOptimizer(a.theta.numpy(), lr=0.7, momentum=0.9)
    b.load_momentum_buffer(a.momentum_buffer)
    step = np.full(3, 0.5, np.float32)
    np.testing.assert_array_equal(a.step(step), b.step(step))


@pytest.mark.parametrize(("lr", "momentum"), [(0.0, 0.0), (1.0, 1.0), (1.0, -0.1)])
def test_bad_hyperparameters_are_rejected(lr, momentum):
    with pytest.raises(ValueError, match=r"lr|momentum"):
        OuterOptimizer(np.zeros(1, np.float32), lr=lr, momentum=momentum)


def test_mean_update_rejects_zero_workers():
    with pytest.raises(ValueError, match="workers"):
        mean_update(torch.zeros(1).numpy(), 0)


def test_nesterov_steps_parameters_and_averages_buffers():
    """Nesterov would extrapolate this running variance to 0.05 - 0.056 < 0; buffers take the
    workers' plain mean each round (0.05 - 3 * 0.01), parameters the Nesterov step."""
    theta = np.array([1.0, 0.05, 2.0], np.float32)  # parameter, running_var, parameter
    opt = OuterOptimizer(theta, lr=0.7, momentum=0.9, buffers=np.array([False, True, False]))
    plain = OuterOptimizer(theta, lr=0.7, momentum=0.9)
    delta = np.array([0.5, 0.01, -1.0], np.float32)
    for _ in range(3):
        got, want = opt.step(delta.copy()), plain.step(delta.copy())
    assert want[1] < 0
    np.testing.assert_allclose(got[1], 0.02, rtol=1e-5)
    np.testing.assert_array_equal(got[[0, 2]], want[[0, 2]])
    assert opt.momentum_buffer[1] == 0


def test_buffers_get_exactly_the_mean_in_one_step():
    theta = np.array([1.0, 0.5], np.float32)
    opt = OuterOptimizer(theta, lr=0.7, momentum=0.9, buffers=np.array([False, True]))
    got = opt.step(np.array([0.25, 0.125], np.float32))
    assert got[1] == np.float32(0.5) - np.float32(0.125)
    assert got[0] == pytest.approx(1.0 - 0.7 * (0.25 + 0.9 * 0.25))
