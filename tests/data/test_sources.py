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


def test_digits_are_scikit_learns_split_without_importing_it():
    """The saved split is scikit-learn's own, sample for sample; and loading it leaves
    scikit-learn unimported (a Python worker would pay ~1.5 s of CPU for it)."""
    import subprocess
    import sys

    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    train, test = digits()
    for got, want in zip((*train.tensors, *test.tensors), (x_tr, y_tr, x_te, y_te), strict=True):
        assert torch.equal(got, torch.from_numpy(want))
    code = (
        "import sys; from sparknet.data.sources import digits; digits(); "
        "print('sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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


@pytest.mark.parametrize(("cores", "workers"), [(1, 0), (2, 0), (3, 2), (4, 3), (64, 8)])
def test_default_loader_workers_follow_the_task_cores(cores, workers):
    """Measured on 2 cores: 2 loader workers decoded 110 samples/s, 0 (in the task) 160."""
    from sparknet.config import TrainConfig
    from sparknet.data.loader import default_loader_workers

    assert TrainConfig().loader_workers is None  # unset: the task decides from its cores
    assert default_loader_workers(cores) == workers


def test_an_unset_loader_worker_count_decodes_in_the_task_on_one_core(monkeypatch):
    import torch.utils.data

    from sparknet.data import loader

    seen = []
    real = torch.utils.data.DataLoader

    def spy(*args, **kwargs):
        seen.append(kwargs["num_workers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "DataLoader", spy)  # records the choice; the loader is real
    list(loader.decoded_batches([[None]], lambda x: x, workers=None, cores=1))
    assert seen == [0]


def test_rounds_of_other_lengths_read_on_where_the_last_step_left_the_data():
    """A round's batches follow from its first global step, not from round x tau: under tau
    auto (or a tau changed on resume) rounds of 2 then 3 steps read what one round of 5 reads,
    with no batch read twice or skipped."""
    from sparknet.data.sources import TaskInput, TensorSource

    source = TensorSource.load("digits")
    inp = TaskInput(partition=1, workers=2, seed=3, run_id="r")

    def labels(first_step: int, tau: int) -> list[list[int]]:
        return [b.y.tolist() for b in source.train_batches(inp, first_step, tau, 8)]

    assert labels(0, 2) + labels(2, 3) == labels(0, 5)
    assert labels(0, 2) + labels(2, 3) != labels(0, 2) + labels(3, 3)  # round x tau's position
