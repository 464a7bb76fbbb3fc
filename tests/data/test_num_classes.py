"""--num-classes against the dataset's manifest, checked before Spark starts (a smaller head used to
train until the first high label and then fail after every retry, minutes in)."""

from __future__ import annotations

import subprocess

import pytest

from sparknet.config import TrainConfig
from sparknet.data.shards import write_dataset
from sparknet.data.sources import shard_source
from sparknet.errors import SparknetError
from sparknet.training.problem import check_num_classes
from tests.conftest import SPARKNET
from tests.imagenet_tree import make_tree


@pytest.fixture(scope="module")
def subset(tmp_path_factory):
    """A 3-class subset of a 5-class tree: indices 0..2, `subset_of` 5 in the manifest."""
    root = tmp_path_factory.mktemp("subset")
    wnids = make_tree(root / "tree", classes=5, train_per_class=3, val_per_class=1, size=(32, 24))
    write_dataset(root / "tree", root / "ds", shard_bytes=20_000, classes=wnids[:3])
    return root


def _check(subset, **settings) -> None:
    cfg = TrainConfig(data=str(subset / "ds"), **settings)
    check_num_classes(cfg, shard_source(cfg.data, cfg))


def test_the_dataset_count_or_none_passes(subset):
    _check(subset)
    _check(subset, num_classes=3)


def test_fewer_classes_than_the_dataset_is_refused_naming_both(subset):
    with pytest.raises(SparknetError, match="--num-classes 2 is fewer than the 3 classes") as e:
        _check(subset, num_classes=2)
    assert "labels run 0..2" in str(e.value) and "\n" not in str(e.value)


def test_more_classes_needs_extra_classes_and_names_the_subset(subset):
    with pytest.raises(SparknetError, match=r"--num-classes 5, but .* has 3 classes") as e:
        _check(subset, num_classes=5)
    assert "a subset of 5 classes" in str(e.value) and "--extra-classes" in str(e.value)
    _check(subset, num_classes=5, extra_classes=True)


def test_train_refuses_before_spark_starts_in_one_line(subset):
    done = subprocess.run(
        [str(SPARKNET), "train", "--data", str(subset / "ds"), "--num-classes", "2",
         "--workers", "1", "--out", str(subset / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --num-classes 2 is fewer"), lines
    assert not (subset / "run").exists()


def test_a_tensor_dataset_may_have_more_classes_than_its_highest_label_shows():
    """Without a manifest the class count is a guess from the labels (max + 1): more is fine,
    fewer still fails before Spark starts."""
    from sparknet.data.sources import TensorSource

    source = TensorSource.load("tests.helpers:identical_samples")
    check_num_classes(TrainConfig(data="tests.helpers:identical_samples", num_classes=10), source)
    have = source.num_classes
    with pytest.raises(SparknetError, match="is fewer than"):
        check_num_classes(
            TrainConfig(data="tests.helpers:identical_samples", num_classes=have - 1), source
        )
