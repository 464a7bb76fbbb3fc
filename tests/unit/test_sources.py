import numpy as np
import pytest

from sparknet.data.sources import batch_indices, batch_positions, digits, load_data, shard
from sparknet.errors import SparknetError


def test_digits_has_a_fixed_split():
    train, test = digits()
    assert (len(train), len(test)) == (1437, 360)
    assert train.tensors[0].shape[1:] == (1, 8, 8)
    again, _ = digits()
    assert bool((again.tensors[0] == train.tensors[0]).all())


def test_shards_are_disjoint_and_cover_the_data():
    parts = [shard(103, 4, p, seed=7) for p in range(4)]
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(103))
    assert {len(p) for p in parts} <= {25, 26}


def test_each_epoch_is_a_permutation_of_the_shard():
    n, b = 10, 4
    seen = np.concatenate([batch_positions(1, 0, n, g, b) for g in range(5)])  # 20 = 2 epochs
    assert sorted(seen[:10].tolist()) == list(range(10))
    assert sorted(seen[10:].tolist()) == list(range(10))
    assert seen[:10].tolist() != seen[10:].tolist()


def test_batch_order_is_a_pure_function_of_seed_partition_and_step():
    a = batch_indices(seed=3, n_samples=500, workers=2, partition=1, global_step=17, batch_size=8)
    b = batch_indices(seed=3, n_samples=500, workers=2, partition=1, global_step=17, batch_size=8)
    c = batch_indices(seed=4, n_samples=500, workers=2, partition=1, global_step=17, batch_size=8)
    d = batch_indices(seed=3, n_samples=500, workers=2, partition=0, global_step=17, batch_size=8)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    assert not set(a.tolist()) & set(d.tolist())  # partitions never share samples


def test_batch_larger_than_shard_wraps_epochs():
    pos = batch_positions(0, 0, 3, 0, 7)
    assert len(pos) == 7 and set(pos.tolist()) == {0, 1, 2}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("imagenet42", "unknown dataset 'imagenet42'"),
        ("nosuchmodule:make", "cannot import module 'nosuchmodule'"),
        ("tests.helpers:nothing_here", "has no attribute 'nothing_here'"),
        ("tests.helpers:IDENTICAL_LABEL", "is not callable"),
        ("tests.helpers:random_images", "must return (train_dataset, test_dataset)"),
    ],
)
def test_bad_data_specs_say_what_is_wrong(spec, message):
    with pytest.raises(SparknetError) as exc:
        load_data(spec)
    assert message in str(exc.value)
