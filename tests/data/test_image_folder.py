"""A plain ImageFolder root (class folders, no train/ or val/), the val split `--val-fraction`
holds out of train, and `--shards N` for a dataset far below one shard's size."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sparknet.data.holdout import held_out_count, hold_out
from sparknet.data.imagenet import SourceImage, is_image_folder, scan
from sparknet.data.manifest import MANIFEST_NAME, VERSION_HELD_OUT, HeldOut, Manifest
from sparknet.data.shard_plan import plan_shards
from sparknet.data.shards import write_dataset
from sparknet.data.stream import epoch_shards
from sparknet.errors import SparknetError
from tests.imagenet_tree import make_tree, render

#: class folder -> images in it: uneven, as a real folder is
SIZES = {"cat": 9, "dog": 6, "emu": 3}


def make_folder(root: Path, sizes: dict[str, int] = SIZES) -> Path:
    """`root/<class>/<class>_<i>.jpg`, nothing else (torchvision's ImageFolder layout)."""
    for k, (name, count) in enumerate(sizes.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            render(k, split="train", i=i, size=(32, 24), seed=0).save(root / name / f"{i}.jpg")
    return root


def keys_of(images: list[SourceImage]) -> set[str]:
    return {image.name for image in images}


def test_a_plain_image_folder_is_all_train_with_its_folders_as_classes(tmp_path):
    src = make_folder(tmp_path / "photos")
    assert is_image_folder(src)
    tree = scan(src)
    assert [c.wnid for c in tree.classes] == ["cat", "dog", "emu"]
    assert list(tree.splits) == ["train"]
    assert Counter(i.label for i in tree.splits["train"]) == {0: 9, 1: 6, 2: 3}
    # the stems clash across classes ("0.jpg" in each): keys stay unique
    assert len({i.key for i in tree.splits["train"]}) == sum(SIZES.values())


def test_a_tree_with_train_or_val_is_not_taken_for_an_image_folder(tmp_path):
    make_tree(tmp_path / "imagenet", classes=2, train_per_class=2, val_per_class=1, size=(32, 24))
    assert not is_image_folder(tmp_path / "imagenet")
    (tmp_path / "imagenet" / "train").rename(tmp_path / "moved")
    with pytest.raises(SparknetError, match="no train/ directory, class folders"):
        scan(tmp_path / "imagenet")  # val/ alone: a train/ went missing, not a class named val


def test_val_fraction_holds_out_a_seeded_share_of_every_class(tmp_path):
    src = make_folder(tmp_path / "photos")
    report = write_dataset(
        src, tmp_path / "ds", shard_bytes=1 << 20, seed=5, processes=1, val_fraction=0.34
    )
    manifest = Manifest.loads((tmp_path / "ds" / MANIFEST_NAME).read_text(), "manifest")
    assert manifest.held_out == HeldOut(fraction=0.34, seed=5)
    assert manifest.version == VERSION_HELD_OUT
    assert json.loads(manifest.dumps())["held_out"]["method"] == "per-class-sha256-rank"
    assert report.manifest.samples("val") == 3 + 2 + 1  # round(9, 6, 3 x 0.34)
    assert report.manifest.samples("train") == 6 + 4 + 2
    # the same images again for the same seed, others for another
    tree = scan(src)
    again, _ = hold_out(tree, 0.34, 5, "photos")
    other, _ = hold_out(tree, 0.34, 6, "photos")
    assert keys_of(again.splits["val"]) != keys_of(other.splits["val"])
    assert keys_of(again.splits["val"]) == keys_of(hold_out(tree, 0.34, 5, "x")[0].splits["val"])
    for split in ("train", "val"):
        assert Counter(i.label for i in again.splits[split]) == Counter(
            i.label for i in other.splits[split]
        )  # stratified: each class's count is fixed by the fraction, whatever the seed
    assert not keys_of(again.splits["val"]) & keys_of(again.splits["train"])


def test_a_rerun_with_the_same_fraction_keeps_every_shard(tmp_path):
    src = make_folder(tmp_path / "photos")
    first = write_dataset(src, tmp_path / "ds", seed=1, processes=1, val_fraction=0.3)
    second = write_dataset(src, tmp_path / "ds", seed=1, processes=1, val_fraction=0.3)
    assert second.written == [] and sorted(second.reused) == sorted(first.written)


def test_an_added_image_moves_at_most_one_other_between_the_splits(tmp_path):
    src = make_folder(tmp_path / "photos", {"cat": 20, "dog": 20})
    before, _ = hold_out(scan(src), 0.25, 0, "photos")
    render(0, split="train", i=99, size=(32, 24), seed=0).save(src / "cat" / "new.jpg")
    after, _ = hold_out(scan(src), 0.25, 0, "photos")
    moved = keys_of(before.splits["val"]) ^ keys_of(after.splits["val"])
    assert len(moved - {"cat/new.jpg"}) <= 1
    dogs = {k for k in keys_of(before.splits["val"]) if k.startswith("dog/")}
    assert dogs == {k for k in keys_of(after.splits["val"]) if k.startswith("dog/")}


def test_a_class_keeps_at_least_one_train_image():
    assert [held_out_count(n, 0.9) for n in (1, 2, 3, 10)] == [0, 1, 2, 9]
    assert [held_out_count(n, 0.1) for n in (1, 4, 5, 15)] == [0, 0, 1, 2]


@pytest.mark.parametrize(
    ("fraction", "needle"),
    [
        (0.0, "--val-fraction 0.0 must be above 0 and below 1"),
        (1.0, "--val-fraction 1.0 must be above 0 and below 1"),
        (0.01, "--val-fraction 0.01 holds out no image: the largest class of"),
    ],
)
def test_a_fraction_that_holds_out_nothing_or_everything_is_refused(tmp_path, fraction, needle):
    src = make_folder(tmp_path / "photos")
    with pytest.raises(SparknetError) as info:
        write_dataset(src, tmp_path / "ds", processes=1, val_fraction=fraction)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "ds").exists()  # a refused source leaves no DEST behind


def test_val_fraction_is_refused_where_the_source_has_its_own_val(tmp_path):
    make_tree(tmp_path / "src", classes=2, train_per_class=4, val_per_class=1, size=(32, 24))
    with pytest.raises(SparknetError, match="has a val split of its own \\(2 images\\)"):
        write_dataset(tmp_path / "src", tmp_path / "ds", processes=1, val_fraction=0.2)


def test_val_fraction_works_for_a_train_only_imagenet_tree(tmp_path):
    make_tree(tmp_path / "src", classes=2, train_per_class=10, val_per_class=0, size=(32, 24))
    report = write_dataset(tmp_path / "src", tmp_path / "ds", processes=1, val_fraction=0.2)
    assert report.manifest.samples("val") == 4 and report.manifest.samples("train") == 16


def test_shards_cuts_a_tiny_dataset_into_a_shard_per_worker(tmp_path):
    src = make_folder(tmp_path / "photos")  # a few KiB: one shard by size
    report = write_dataset(src, tmp_path / "ds", processes=1, shards=4, val_fraction=0.2)
    m = report.manifest
    assert len(m.shards("train")) == 4 and all(s.samples > 0 for s in m.shards("train"))
    assert len(m.shards("val")) == min(4, m.samples("val"))
    counts = [s.samples for s in m.shards("train")]
    read = [epoch_shards(counts, seed=0, epoch=0, workers=4, partition=p) for p in range(4)]
    assert sorted(i for part in read for i in part) == [0, 1, 2, 3]  # one each
    assert sum(counts) == m.samples("train") and max(counts) - min(counts) <= 2


def test_more_shards_than_train_images_is_refused(tmp_path):
    src = make_folder(tmp_path / "photos")
    with pytest.raises(SparknetError, match="--shards 19 is more than the 18 train images"):
        write_dataset(src, tmp_path / "ds", processes=1, shards=19)


def test_a_count_cut_leaves_no_shard_empty_around_a_huge_image(tmp_path):
    src = make_folder(tmp_path / "photos", {"a": 6})
    images = scan(src).splits["train"]
    (src / "a" / "0.jpg").write_bytes(np.random.default_rng(0).bytes(200_000))  # mostly one
    plans = plan_shards(images, split="train", seed=0, target_bytes=1 << 20, count=5)
    assert len(plans) == 5 and all(plan.images for plan in plans)
    assert sorted(i.key for p in plans for i in p.images) == sorted(i.key for i in images)


def test_a_destination_inside_the_image_folder_is_refused(tmp_path):
    src = make_folder(tmp_path / "photos")
    with pytest.raises(SparknetError, match="where every directory is read as a class"):
        write_dataset(src, src / "shards", processes=1)


def test_val_is_held_out_of_the_images_that_decode(tmp_path):
    """A file that does not decode is dropped before the hold-out: a class of one good image
    keeps it in train, and 10 good of 11 files split 5/5 at 0.5."""
    src = make_folder(tmp_path / "photos", {"big": 10, "pair": 1})
    (src / "pair" / "zz-bad.jpg").write_bytes(b"junk")
    (src / "big" / "bad.jpg").write_bytes(b"junk")
    report = write_dataset(src, tmp_path / "ds", seed=1, processes=1, val_fraction=0.5)
    m = report.manifest
    assert report.warnings == []  # no class without a train image that decodes
    assert (m.samples("train"), m.samples("val")) == (5 + 1, 5)
    assert sorted(r.path for r in report.rejected) == ["big/bad.jpg", "pair/zz-bad.jpg"]


def test_shards_counts_the_images_that_decode(tmp_path):
    src = make_folder(tmp_path / "photos", {"a": 6})
    (src / "a" / "bad.jpg").write_bytes(b"junk")  # 7 files, 6 images
    with pytest.raises(SparknetError, match="--shards 7 is more than the 6 train images that"):
        write_dataset(src, tmp_path / "ds", processes=1, shards=7)
    assert (
        len(write_dataset(src, tmp_path / "ds", processes=1, shards=6).manifest.shards("train"))
        == 6
    )


def test_images_in_subfolders_of_a_class_are_its_own_with_their_path_in_the_key(tmp_path):
    """As torchvision's ImageFolder: a class folder is walked down (links followed, once)."""
    src = make_folder(tmp_path / "photos", {"cat": 2, "dog": 2})
    (src / "cat" / "nested" / "deeper").mkdir(parents=True)
    render(0, split="train", i=7, size=(32, 24), seed=0).save(src / "cat" / "nested" / "deep.jpg")
    render(0, split="train", i=8, size=(32, 24), seed=0).save(
        src / "cat" / "nested" / "deeper" / "d2.jpg"
    )
    (src / "cat" / "nested" / "loop").symlink_to(src / "cat")  # a link back up: read once
    tree = scan(src)
    cats = {i.name: i.key for i in tree.splits["train"] if i.label == 0}
    assert cats == {
        "cat/0.jpg": "cat_0", "cat/1.jpg": "cat_1",
        "cat/nested/deep.jpg": "nested_deep", "cat/nested/deeper/d2.jpg": "nested_deeper_d2",
    }  # fmt: skip
    report = write_dataset(src, tmp_path / "ds", processes=1)
    assert report.manifest.samples("train") == 6 and report.rejected == report.skipped == []


@pytest.mark.parametrize("name", ["train", "val"])
def test_a_class_folder_named_train_or_val_is_a_class_of_an_image_folder(tmp_path, name):
    src = make_folder(tmp_path / "photos", {name: 4, "zebra": 4})
    assert is_image_folder(src)
    assert [c.wnid for c in scan(src).classes] == sorted([name, "zebra"])
    report = write_dataset(src, tmp_path / "ds", processes=1, val_fraction=0.25)
    assert (report.manifest.samples("train"), report.manifest.samples("val")) == (6, 2)
