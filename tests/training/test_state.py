import numpy as np
import torch

from sparknet.models import cnn
from sparknet.training.state import StateLayout


def test_float_buffers_travel_and_integer_buffers_ride_beside():
    model = cnn((1, 8, 8), 10)
    state = model.state_dict()
    layout = StateLayout.of(state)
    flat, ints = layout.flatten(state), layout.integers(state)
    floats = [k for k, v in state.items() if v.is_floating_point()]
    assert "0.weight" in floats and "1.running_mean" in floats and "1.running_var" in floats
    assert set(ints) == {"1.num_batches_tracked", "4.num_batches_tracked"}
    assert flat.dtype == np.float32 and flat.size == sum(state[k].numel() for k in floats)
    back = layout.unflatten(flat, ints)
    assert list(back) == list(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_unflatten_loads_into_a_fresh_model():
    a, b = cnn((1, 8, 8), 10), cnn((1, 8, 8), 10)
    layout = StateLayout.of(a.state_dict())
    b.load_state_dict(
        layout.unflatten(layout.flatten(a.state_dict()), layout.integers(a.state_dict()))
    )
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)


def test_a_channels_last_model_flattens_in_logical_order():
    """On a GPU conv nets are kept channels-last; the flat buffer must not see the difference."""
    model = cnn((1, 8, 8), 10)
    state = model.state_dict()
    layout = StateLayout.of(state)
    last = model.to(memory_format=torch.channels_last).state_dict()
    assert not last["3.weight"].is_contiguous()
    assert np.array_equal(layout.flatten(last), layout.flatten(state))


def test_unflatten_onto_a_device_copies_the_buffer_once_and_views_it():
    model = cnn((1, 8, 8), 10)
    state = model.state_dict()
    layout = StateLayout.of(state)
    flat = layout.flatten(state)
    back = layout.unflatten(flat, layout.integers(state), device="cpu")
    first = back["0.weight"].untyped_storage().data_ptr()
    assert all(
        t.untyped_storage().data_ptr() == first for t in back.values() if t.is_floating_point()
    )
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_of_model_marks_batchnorm_statistics_as_buffers():
    model = cnn((1, 8, 8), 10)
    layout = StateLayout.of_model(model)
    buffers = {e.name for e in layout.entries if e.offset >= 0 and e.buffer}
    assert buffers == {"1.running_mean", "1.running_var", "4.running_mean", "4.running_var"}
    mask = layout.buffer_mask()
    state = model.state_dict()
    flat = layout.flatten(state)
    want = np.concatenate([state[n].reshape(-1).numpy() for n in sorted(buffers)])
    assert mask.sum() == want.size
    np.testing.assert_array_equal(np.sort(flat[mask]), np.sort(want))
    assert StateLayout.of(state).buffer_mask() is None


def test_pseudo_gradient_is_theta_minus_the_flat_weights_bit_for_bit():
    """The worker's update, with a gradient's sign (theta_r - theta_k), written in one pass per
    entry: the very bits of subtracting the flattened weights, channels-last or not, and into
    a given buffer when one is passed (reused round after round by the allreduce transport)."""
    torch.manual_seed(0)
    model = cnn((1, 8, 8), 10)
    layout = StateLayout.of_model(model)
    theta = layout.flatten(model.state_dict()) + np.float32(0.25)
    for p in model.parameters():
        p.data.mul_(1.5)
    want = theta - layout.flatten(model.state_dict())
    assert np.array_equal(layout.pseudo_gradient(theta, model.state_dict()), want)
    last = model.to(memory_format=torch.channels_last).state_dict()
    buf = np.full(layout.size, np.nan, dtype=np.float32)
    got = layout.pseudo_gradient(theta, last, out=buf)
    assert got is buf and np.array_equal(buf, want)


def test_bind_makes_every_float_entry_a_view_of_one_flat_buffer():
    """After bind, the model's parameters and BatchNorm statistics live in the flat buffer:
    what training writes is in it, and what is written into it (an all-reduce) is the model.
    The Parameter objects stay the same, so an optimizer made before keeps working."""
    model = cnn((1, 8, 8), 10)
    layout = StateLayout.of_model(model)
    before = layout.flatten(model.state_dict())
    params = list(model.parameters())
    flat = layout.bind(model)
    assert flat is not None and flat.shape == (layout.size,)
    assert np.array_equal(flat.numpy(), before)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)
    model.train()
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    optimizer.step()
    assert np.array_equal(flat.numpy(), layout.flatten(model.state_dict()))  # steps and stats
    assert not np.array_equal(flat.numpy(), before)
    flat.mul_(0.0)
    assert all(not v.any() for v in model.state_dict().values() if v.is_floating_point())
    assert model.state_dict()["1.num_batches_tracked"] == 1  # integers are not in the buffer


def test_bind_refuses_what_cannot_be_one_buffer():
    """Channels-last weights and tied weights cannot be views of one flat buffer in layout order:
    bind says so (None) and leaves the model as it was."""
    model = cnn((1, 8, 8), 10).to(memory_format=torch.channels_last)
    assert StateLayout.of_model(model).bind(model) is None
    assert not model.state_dict()["3.weight"].is_contiguous()
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    assert StateLayout.of_model(tied).bind(tied) is None
    assert tied[1].weight is tied[0].weight


def test_bind_again_brings_back_a_reassigned_buffer_taking_or_dropping_its_value():
    """A forward() that reassigns a buffer leaves a tensor outside the flat buffer: binding
    again makes it a view once more, with its own value (after training) or the buffer's
    (before a round, when the buffer holds the averaged weights)."""
    model = cnn((1, 8, 8), 10)
    layout = StateLayout.of_model(model)
    flat = layout.bind(model)
    bn = model.get_submodule("1")
    for take, want in ((True, 7.0), (False, 0.0)):
        flat.zero_()
        bn.running_mean = torch.full_like(bn.running_mean, 7.0)  # a new tensor, not a view
        assert layout.bind(model, flat, take=take) is flat
        assert bn.running_mean.data_ptr() == flat.data_ptr() + 4 * _offset(layout, "1.running_mean")
        assert (bn.running_mean == want).all()
        bn.running_mean.add_(1.0)  # a view again: what the model writes is in the buffer
        assert np.array_equal(flat.numpy(), layout.flatten(model.state_dict()))


def _offset(layout: StateLayout, name: str) -> int:
    return next(e.offset for e in layout.entries if e.name == name)
