"""ImageNet layouts, labels, decoding and transforms (on small synthetic trees)."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from sparknet.data.decode import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TrainDecoder,
    decode_image,
    eval_transform,
    normalize,
)
from sparknet.data.imagenet import KAGGLE_DATA, scan
from sparknet.errors import SparknetError
from tests.imagenet_tree import class_name, corrupt_jpeg, make_tree, render

SMALL = {"classes": 6, "train_per_class": 4, "val_per_class": 3, "size": (48, 36)}
TINY = {"classes": 2, "train_per_class": 2, "val_per_class": 1, "size": (32, 24)}


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> tuple[list[str], Path, Path]:
    """The same images in both layouts (one seed): the folder layout is the ground truth."""
    root = tmp_path_factory.mktemp("imagenet")
    wnids = make_tree(root / "folders", layout="folders", **SMALL)
    assert make_tree(root / "kaggle", layout="kaggle", **SMALL) == wnids
    return wnids, root / "folders", root / "kaggle"


def _labels(images) -> dict[str, int]:
    return {image.key: image.label for image in images}


def test_both_layouts_give_the_same_classes_and_labels(trees):
    wnids, folders, kaggle = trees
    a, b = scan(folders), scan(kaggle)
    assert [c.wnid for c in a.classes] == wnids  # sorted wnids, index = position
    assert [c.index for c in a.classes] == list(range(len(wnids)))
    assert a.classes == b.classes
    assert set(a.splits) == set(b.splits) == {"train", "val"}
    assert _labels(a.splits["train"]) == _labels(b.splits["train"])
    assert len(a.splits["train"]) == 6 * 4
    assert _labels(a.splits["val"]) == _labels(b.splits["val"])


def test_flat_val_labels_come_from_the_kaggle_csv(trees):
    """Each flat val image is byte-identical to one sorted into val/<wnid>/ in the other tree:
    that directory is the truth the CSV-derived label must match."""
    wnids, folders, kaggle = trees
    flat = scan(kaggle).splits["val"]
    assert len(flat) == 6 * 3
    truth = {p.name: p for p in (folders / "val").glob("*/*.JPEG")}
    for image in flat:
        assert image.path.parent == kaggle / KAGGLE_DATA / "val"
        twin = truth[image.path.name]
        assert twin.read_bytes() == image.path.read_bytes()
        assert image.label == wnids.index(twin.parent.name)
    assert len({image.label for image in flat}) == 6


def test_the_cls_loc_dir_itself_finds_the_csv_at_the_kaggle_root(trees):
    _, _, kaggle = trees
    inner = scan(kaggle / KAGGLE_DATA)
    assert _labels(inner.splits["val"]) == _labels(scan(kaggle).splits["val"])
    assert inner.classes[0].name == class_name(0)


def test_class_names_come_from_loc_synset_mapping(trees):
    wnids, folders, kaggle = trees
    for tree in (scan(folders), scan(kaggle)):
        assert [c.name for c in tree.classes] == [class_name(k) for k in range(len(wnids))]


def test_class_names_come_from_words_txt_or_are_none(tmp_path):
    wnids = make_tree(tmp_path, **TINY)
    (tmp_path / "LOC_synset_mapping.txt").unlink()
    assert [c.name for c in scan(tmp_path).classes] == [None, None]
    (tmp_path / "words.txt").write_text(f"{wnids[0]}\tgoldfish, Carassius auratus\nn99\tother\n")
    assert [c.name for c in scan(tmp_path).classes] == ["goldfish, Carassius auratus", None]


def test_keys_are_unique_dotless_and_any_jpeg_suffix_counts(tmp_path):
    jpeg = io.BytesIO()
    render(0, split="train", i=0, size=(16, 16), seed=0).save(jpeg, format="JPEG")
    names = (
        "cat/1.jpg",
        "cat/1.jpeg",
        "cat/a.b.jpeg",
        "dog/1.JPG",
        "dog/a_b.Jpeg",
        "dog/notes.txt",
    )
    for rel in names:
        path = tmp_path / "train" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg.getvalue())
    tree = scan(tmp_path)
    assert [c.wnid for c in tree.classes] == ["cat", "dog"]
    assert [c.name for c in tree.classes] == [None, None]
    assert set(tree.splits) == {"train"}  # no val/: no val split
    images = tree.splits["train"]
    assert [i.label for i in images] == [0, 0, 0, 1, 1]
    keys = [i.key for i in images]
    assert len(set(keys)) == 5
    assert not any("." in k or "/" in k for k in keys)


def _no_train(root: Path) -> Path:
    make_tree(root, **TINY)
    shutil.rmtree(root / "train")
    return root


def _val_dir_not_a_class(root: Path) -> Path:
    wnids = make_tree(root, **TINY)
    (root / "val" / wnids[1]).rename(root / "val" / "n09999999")
    return root


def _csv_wnid_not_a_class(root: Path) -> Path:
    wnids = make_tree(root, layout="kaggle", **TINY)
    csv = root / "LOC_val_solution.csv"
    csv.write_text(csv.read_text().replace(wnids[1], "n09999999"))
    return root


def _flat_val_without_csv(root: Path) -> Path:
    make_tree(root, layout="kaggle", **TINY)
    (root / "LOC_val_solution.csv").unlink()
    return root


def _flat_val_image_not_in_csv(root: Path) -> Path:
    make_tree(root, layout="kaggle", **TINY)
    val = root / KAGGLE_DATA / "val"
    shutil.copy(val / "ILSVRC2012_val_00000001.JPEG", val / "ILSVRC2012_val_00009999.JPEG")
    return root


def _empty_class_dir(root: Path) -> Path:
    make_tree(root, **TINY)
    (root / "train" / "n00000005").mkdir()
    return root


@pytest.mark.parametrize(
    ("make_bad", "message"),
    [
        (lambda root: root / "missing", "no such directory"),
        (_no_train, "no train/ directory"),
        (_val_dir_not_a_class, "n09999999 is not a class in train/"),
        (_csv_wnid_not_a_class, "1 of 2 validation images are labelled with classes that are not"),
        (_flat_val_without_csv, "holds val images directly but nothing labels them"),
        (_flat_val_image_not_in_csv, "ILSVRC2012_val_00009999.JPEG is not labelled by"),
        (_empty_class_dir, "n00000005 has no images"),
    ],
    ids=[
        "src-missing",
        "no-train",
        "val-dir-not-a-class",
        "csv-wnid-not-a-class",
        "flat-val-without-csv",
        "flat-val-image-not-in-csv",
        "empty-class-dir",
    ],
)
def test_a_bad_layout_is_a_one_line_error_that_says_what_to_fix(tmp_path, make_bad, message):
    src = make_bad(tmp_path)
    with pytest.raises(SparknetError, match=message) as info:
        scan(src)
    assert "\n" not in str(info.value)
    assert ": " in str(info.value)  # "<what is wrong>: <what to do>"


def _jpeg(size: tuple[int, int], mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    render(1, split="val", i=0, size=size, seed=0).convert(mode).save(out, format="JPEG")
    return out.getvalue()


def test_decode_image_with_min_size_decodes_smaller_but_not_below_it():
    data = _jpeg((640, 480))
    full = decode_image(data)
    assert (full.size, full.mode) == ((640, 480), "RGB")
    for min_size in (32, 100, 120, 200, 479):
        image = decode_image(data, min_size=min_size)
        assert image.mode == "RGB"
        assert min(image.size) >= min_size
    assert decode_image(data, min_size=100).size == (160, 120)  # libjpeg's 1/4 scale
    assert decode_image(data, min_size=1000).size == (640, 480)  # never upscales


def test_decode_image_gives_rgb_for_grayscale_jpegs():
    image = decode_image(_jpeg((64, 48), mode="L"), min_size=16)
    assert image.mode == "RGB"


def test_decode_image_raises_on_a_corrupt_jpeg(tmp_path):
    path = tmp_path / "bad.JPEG"
    path.write_bytes(_jpeg((160, 120)))
    corrupt_jpeg(path)
    for min_size in (None, 32):
        with pytest.raises(Exception):  # noqa: B017 - PIL raises OSError or SyntaxError
            decode_image(path.read_bytes(), min_size=min_size)
    with pytest.raises(Exception):  # noqa: B017
        decode_image(b"not an image at all")


def test_eval_transform_gives_a_square_uint8_image_that_normalize_scales():
    image = Image.open(io.BytesIO(_jpeg((100, 60)))).convert("RGB")
    out = eval_transform(32)(image)
    assert out.shape == (3, 32, 32)
    assert out.dtype == torch.uint8
    batch = normalize(torch.stack([out, out]))
    assert batch.dtype == torch.float32 and batch.shape == (2, 3, 32, 32)
    reference = v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)(
        v2.ToDtype(torch.float32, scale=True)(out)
    )
    torch.testing.assert_close(batch[1], reference)


def test_the_train_decoder_is_deterministic_under_a_fixed_torch_seed():
    decode, data = TrainDecoder(24), _jpeg((100, 60))

    def sample(seed: int) -> torch.Tensor:
        torch.default_generator.manual_seed(seed)
        return decode(data)

    first = sample(7)
    assert first.shape == (3, 24, 24)
    assert first.dtype == torch.uint8
    assert torch.equal(first, sample(7))
    assert any(not torch.equal(first, sample(s)) for s in range(8, 12))


def test_the_train_decoder_makes_torchvisions_crops_and_flips():
    """The same draws as RandomResizedCrop + RandomHorizontalFlip on the fully decoded image:
    where no crop allows a reduced decode (crops under twice the output), the same pixels."""
    data = _jpeg((60, 45))
    full = v2.functional.pil_to_tensor(decode_image(data))
    recipe = v2.Compose([v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip()])
    for seed in range(20):
        torch.default_generator.manual_seed(seed)
        ours = TrainDecoder(32)(data)
        torch.default_generator.manual_seed(seed)
        assert torch.equal(ours, recipe(full)), seed


def test_the_train_decoder_decodes_big_crops_at_reduced_scale_only(monkeypatch):
    """A crop with 4x the output's pixels a side decodes at 1/4 scale; a small crop in full."""
    data = _jpeg((640, 480))
    from PIL.JpegImagePlugin import JpegImageFile

    drafts: list = []
    real = JpegImageFile.draft

    def spy(self, mode, size):
        drafts.append(size)
        return real(self, mode, size)

    monkeypatch.setattr(JpegImageFile, "draft", spy)
    for seed in range(30):
        torch.default_generator.manual_seed(seed)
        assert TrainDecoder(56)(data).shape == (3, 56, 56)
    assert drafts and all(size[0] in (320, 160, 80) for size in drafts)  # 1/2, 1/4, 1/8
    drafts.clear()
    for seed in range(30):
        torch.default_generator.manual_seed(seed)
        TrainDecoder(400)(data)  # no crop is 800 px a side
    assert drafts == []


@pytest.mark.parametrize("what", ["image", "class"])
def test_a_name_that_is_not_utf8_is_refused_naming_it(tmp_path, what):
    """JSON cannot hold such a name: the manifest would be written and then unreadable."""
    make_tree(tmp_path, classes=2, train_per_class=2, val_per_class=1, size=(16, 16))
    cls = tmp_path / "train" / "n00000001"
    bad = os.fsdecode(b"caf\xe9")  # Latin-1, not UTF-8: a lone surrogate in Python
    if what == "image":
        next(cls.iterdir()).rename(cls / f"{bad}.JPEG")
    else:
        cls.rename(tmp_path / "train" / bad)
    with pytest.raises(SparknetError) as info:
        scan(tmp_path)
    text = str(info.value)
    assert "caf\\xe9" in text and "not valid UTF-8: rename it" in text
    text.encode("utf-8")  # the message itself prints anywhere
