"""Sharding ImageNet as image-net.org hands it out: the train and val tars and the devkit, read
in place, on replicas built here with the real files' quirks (see tests/ilsvrc_downloads.py)."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sparknet.data import shard_checks, shard_files
from sparknet.data.decode import decode_image, inspect_image
from sparknet.data.imagenet import scan
from sparknet.data.manifest import MANIFEST_NAME, Manifest
from sparknet.data.shard_checks import JOURNAL_NAME
from sparknet.data.shard_plan import Resize
from sparknet.data.shards import write_dataset
from sparknet.errors import SparknetError
from tests.conftest import SPARKNET
from tests.ilsvrc_downloads import DEVKIT_TAR, TRAIN_TAR, VAL_TAR, make_downloads
from tests.imagenet_tree import class_name, make_tree, render

CLASSES = 10
ROOT = Path(__file__).resolve().parents[2]


def _encode(image: Image.Image, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


@dataclass(frozen=True)
class Downloads:
    folders: Path  # the ground truth: the same images, extracted and sorted into class dirs
    dl: Path  # the three downloads
    wnids: list[str]
    ids: dict[str, int]
    quirks: dict[str, str]  # file name -> what it is


@pytest.fixture(scope="module")
def downloads(tmp_path_factory) -> Downloads:
    root = tmp_path_factory.mktemp("ilsvrc")
    folders = root / "folders"
    wnids = make_tree(folders, classes=CLASSES, train_per_class=4, val_per_class=2, size=(96, 64))
    picture = render(1, split="train", i=99, size=(96, 64), seed=0)
    full = _encode(picture)
    quirks = {  # the train set's known oddities, and broken files
        f"{wnids[0]}_png.JPEG": ("png inside .JPEG", _encode(picture, "PNG")),
        f"{wnids[1]}_cmyk.JPEG": ("CMYK", _encode(picture.convert("CMYK"))),
        f"{wnids[2]}_gray.JPEG": ("grayscale", _encode(picture.convert("L"))),
        f"{wnids[3]}_cut.JPEG": ("truncated", full[: len(full) // 2]),
        f"{wnids[4]}_empty.JPEG": ("zero bytes", b""),
    }
    for name, (_, data) in quirks.items():
        (folders / "train" / name.split("_")[0] / name).write_bytes(data)
    ids = make_downloads(folders, root / "dl", wnids)
    return Downloads(folders, root / "dl", wnids, ids, {k: v[0] for k, v in quirks.items()})


def _labels(images) -> dict[str, int]:
    return {image.key: image.label for image in images}


def _shard_samples(dest: Path, manifest: Manifest, split: str) -> dict[str, tuple[bytes, int]]:
    out = {}
    for info in manifest.shards(split):
        with tarfile.open(dest / info.name) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        for name, data in members.items():
            key, ext = name.split(".", 1)
            if ext == "jpg":
                out[key] = (data, int(members[f"{key}.cls"]))
    return out


def test_the_downloads_give_the_classes_labels_and_names_of_the_extracted_tree(downloads):
    assert sorted(downloads.ids, key=downloads.ids.get) != sorted(downloads.wnids)  # id order
    truth, tars = scan(downloads.folders), scan(downloads.dl)
    assert [c.wnid for c in tars.classes] == downloads.wnids  # sorted wnids, index = position
    assert [c.name for c in tars.classes] == [class_name(k) for k in range(CLASSES)]  # meta.mat
    assert set(tars.splits) == {"train", "val"}
    for split in ("train", "val"):
        assert _labels(tars.splits[split]) == _labels(truth.splits[split]), split
    member = tars.splits["train"][0]
    assert member.path == downloads.dl / TRAIN_TAR and member.offset is not None
    assert member.name == f"{TRAIN_TAR}/{downloads.wnids[0]}.tar/{Path(member.name).name}"


def test_sharding_the_downloads_labels_val_by_the_devkit_and_keeps_every_image_byte(
    downloads, tmp_path
):
    report = write_dataset(downloads.dl, tmp_path / "ds", shard_bytes=30_000, seed=1)
    m = report.manifest
    index = {w: i for i, w in enumerate(downloads.wnids)}
    val = _shard_samples(tmp_path / "ds", m, "val")
    truth_val = {p.stem: (p.read_bytes(), index[p.parent.name])
                 for p in (downloads.folders / "val").glob("*/*")}  # fmt: skip
    assert val == truth_val  # every val label equals its ground truth, bytes as downloaded
    train = _shard_samples(tmp_path / "ds", m, "train")
    broken = {n for n, what in downloads.quirks.items() if what in ("truncated", "zero bytes")}
    all_train = list((downloads.folders / "train").glob("*/*"))
    assert len(train) + len(broken) == len(all_train) == m.samples("train") + len(broken)
    assert sorted(Path(r.path).name for r in m.rejected) == sorted(broken)
    assert all(r.path.startswith(f"{TRAIN_TAR}/") and r.split == "train" for r in m.rejected)
    reasons = {Path(r.path).name: r.reason for r in m.rejected}
    assert reasons[next(n for n in broken if "empty" in n)] == "empty file"
    for name, what in downloads.quirks.items():
        if name in broken:
            continue
        data, label = train[Path(name).stem]
        assert label == index[name.split("_")[0]]
        assert decode_image(data).mode == "RGB", what  # PNG, CMYK and grayscale train as RGB
    assert [c.name for c in m.classes] == [class_name(k) for k in range(CLASSES)]


def test_a_half_extracted_train_dir_of_synset_tars_reads_the_same(downloads, tmp_path):
    src = tmp_path / "half"
    (src / "train").mkdir(parents=True)
    with tarfile.open(downloads.dl / TRAIN_TAR) as outer:
        outer.extractall(src / "train", filter="data")  # train/<wnid>.tar, as people stop
    shutil.copy(downloads.dl / VAL_TAR, src)
    shutil.copy(downloads.dl / DEVKIT_TAR, src)
    got, truth = scan(src), scan(downloads.folders)
    for split in ("train", "val"):
        assert _labels(got.splits[split]) == _labels(truth.splits[split])
    assert got.splits["train"][0].name.startswith(f"train/{downloads.wnids[0]}.tar/")


def test_the_train_tar_alone_shards_train_and_a_val_tar_without_devkit_is_one_line(
    downloads, tmp_path
):
    alone = tmp_path / "alone"
    alone.mkdir()
    os.symlink(downloads.dl / TRAIN_TAR, alone / TRAIN_TAR)
    tree = scan(alone)
    assert set(tree.splits) == {"train"} and tree.num_classes == CLASSES
    os.symlink(downloads.dl / VAL_TAR, alone / VAL_TAR)
    with pytest.raises(SparknetError, match=f"put the ILSVRC2012 devkit \\({DEVKIT_TAR}\\)") as e:
        scan(alone)
    assert "\n" not in str(e.value)


def test_an_incomplete_train_tar_is_one_line_saying_so(downloads, tmp_path):
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (downloads.dl / TRAIN_TAR).read_bytes()
    (cut / TRAIN_TAR).write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(SparknetError, match="the download is incomplete") as e:
        scan(cut)
    assert "\n" not in str(e.value)
    (cut / TRAIN_TAR).write_bytes(b"<html>403 Forbidden</html>" * 40)
    with pytest.raises(SparknetError, match="not a readable tar"):
        scan(cut)


def test_an_extracted_flat_val_is_labelled_by_the_devkit(downloads, tmp_path):
    src = tmp_path / "tv"
    shutil.copytree(downloads.folders / "train", src / "train")
    (src / "val").mkdir()
    with tarfile.open(downloads.dl / VAL_TAR) as tar:
        tar.extractall(src / "val", filter="data")
    shutil.copy(downloads.dl / DEVKIT_TAR, src)
    assert _labels(scan(src).splits["val"]) == _labels(scan(downloads.folders).splits["val"])


def test_class_names_come_from_torchvisions_meta_bin(downloads, tmp_path):
    import torch

    src = tmp_path / "torchvision-root"
    shutil.copytree(downloads.folders / "train", src / "train")
    shutil.copytree(downloads.folders / "val", src / "val")
    torch.save(({w: (f"name {w}", "other words") for w in downloads.wnids}, []), src / "meta.bin")
    names = [c.name for c in scan(src).classes]
    assert names == [f"name {w}, other words" for w in downloads.wnids]


def test_classes_keeps_a_subset_in_train_and_val_indexed_from_zero(downloads, tmp_path):
    keep = [downloads.wnids[7], downloads.wnids[2], downloads.wnids[5]]
    report = write_dataset(downloads.dl, tmp_path / "ds", shard_bytes=30_000, classes=keep)
    m = report.manifest
    assert [c.wnid for c in m.classes] == sorted(keep)
    assert [c.index for c in m.classes] == [0, 1, 2]
    assert m.subset_of == CLASSES and m.version == 3
    assert json.loads((tmp_path / "ds" / MANIFEST_NAME).read_text())["subset_of"] == CLASSES
    for split in ("train", "val"):
        labels = {label for _, label in _shard_samples(tmp_path / "ds", m, split).values()}
        assert labels == {0, 1, 2}
    assert m.samples("val") == 3 * 2
    assert report.other_classes_val == (CLASSES - 3) * 2
    with pytest.raises(SparknetError, match="n09999999, which is not a train class"):
        scan(downloads.dl, ["n09999999", downloads.wnids[0]])


def test_a_symlinked_class_subset_with_a_flat_val_needs_classes_and_then_counts_the_rest(
    tmp_path,
):
    full = tmp_path / "kaggle"
    wnids = make_tree(full, layout="kaggle", classes=6, train_per_class=2, val_per_class=2,
                      size=(32, 24))  # fmt: skip
    sub = tmp_path / "imagenet-4"
    (sub / "train").mkdir(parents=True)
    for w in wnids[:4]:
        os.symlink(full / "ILSVRC/Data/CLS-LOC/train" / w, sub / "train" / w)
    os.symlink(full / "ILSVRC/Data/CLS-LOC/val", sub / "val")
    shutil.copy(full / "LOC_val_solution.csv", sub)
    with pytest.raises(SparknetError) as e:
        scan(sub)
    assert str(e.value).startswith("4 of 12 validation images are labelled with classes")
    assert "--classes" in str(e.value) and "\n" not in str(e.value)
    listing = tmp_path / "classes.txt"
    listing.write_text("# ImageNet-4\n" + "".join(f"{w}\n" for w in wnids[:4]))
    from sparknet.data.imagenet import read_class_list

    tree = scan(sub, read_class_list(str(listing)))
    assert tree.num_classes == 4 and len(tree.splits["val"]) == 8
    assert tree.other_classes_val == 4


def test_files_that_are_not_jpegs_are_skipped_counted_and_listed(tmp_path):
    src = tmp_path / "src"
    make_tree(src, classes=2, train_per_class=3, val_per_class=1, size=(32, 24))
    w = sorted(p.name for p in (src / "train").iterdir())[0]
    for name in ("x.png", "y.jpe", f"{w}_0.JPEG.bak"):
        (src / "train" / w / name).write_bytes(b"not read")
    (src / "train" / w / ".DS_Store").write_bytes(b"")
    report = write_dataset(src, tmp_path / "ds", shard_bytes=10_000)
    skipped = sorted(r.path for r in report.skipped)
    assert skipped == sorted(f"train/{w}/{n}" for n in ("x.png", "y.jpe", f"{w}_0.JPEG.bak"))
    listed = {r.path: r.reason for r in report.manifest.rejected}
    assert all(listed[p].startswith("skipped: ") for p in skipped)
    assert report.manifest.samples("train") == 6
    out = subprocess.run(
        [str(SPARKNET), "data", "shard", str(src), str(tmp_path / "ds")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "3 files are not .JPEG/.jpg and were skipped" in out.stdout


def test_an_interrupted_check_resumes_where_it_stopped(downloads, tmp_path, monkeypatch):
    dest = tmp_path / "ds"
    calls: list[int] = []
    stop_at = [11]

    def counting(data: bytes):
        calls.append(1)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        return inspect_image(data)

    monkeypatch.setattr(shard_checks, "inspect_image", counting)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(downloads.dl, dest, shard_bytes=30_000, processes=1)
    assert not (dest / MANIFEST_NAME).exists()
    calls.clear()
    stop_at[0] = 0
    report = write_dataset(downloads.dl, dest, shard_bytes=30_000, processes=1)
    total = report.manifest.samples("train") + report.manifest.samples("val") + 2  # 2 broken
    assert len(calls) == total - 10  # the 10 checked before Ctrl-C are not decoded again
    assert not (dest / JOURNAL_NAME).exists()  # folded into the checks file
    assert not [w for w in report.warnings if "added or removed" in w]  # nothing was


def test_a_killed_check_keeps_what_it_checked(downloads, tmp_path):
    """kill -9 mid-check (a slowed check in a real process): the next run decodes only the
    images the journal does not hold."""
    dest = tmp_path / "ds"
    script = (
        "import sys, time\n"
        "from sparknet.data import shard_checks, shards\n"
        "real = shard_checks.inspect_image\n"
        "shard_checks.inspect_image = lambda d: (time.sleep(0.05), real(d))[1]\n"
        f"shards.write_dataset({str(downloads.dl)!r}, {str(dest)!r}, shard_bytes=30000,"
        " processes=1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            journal = dest / JOURNAL_NAME
            if journal.exists() and journal.read_text().count("\n") > 15:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    kept = (dest / JOURNAL_NAME).read_text().count("\n") - 1  # the header line
    assert kept > 10
    calls: list[int] = []
    real = shard_checks.inspect_image

    def counting(data: bytes):
        calls.append(1)
        return real(data)

    shard_checks.inspect_image = counting
    try:
        report = write_dataset(downloads.dl, dest, shard_bytes=30_000, processes=1)
    finally:
        shard_checks.inspect_image = real
    total = report.manifest.samples("train") + report.manifest.samples("val") + 2
    assert len(calls) == total - kept


def test_an_interrupted_write_keeps_the_shards_it_finished(downloads, tmp_path, monkeypatch):
    dest = tmp_path / "ds"
    real = shard_files.write_shard
    done: list[str] = []

    def stop_at_the_third(plan, dest_dir):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(plan.name)
        return real(plan, dest_dir)

    monkeypatch.setattr(shard_files, "write_shard", stop_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(downloads.dl, dest, shard_bytes=30_000, processes=1)
    monkeypatch.setattr(shard_files, "write_shard", real)
    report = write_dataset(downloads.dl, dest, shard_bytes=30_000, processes=1)
    assert report.reused == done and len(report.written) > 0


def test_max_side_stores_big_images_shrunk_and_small_ones_as_they_are(tmp_path):
    src = tmp_path / "src"
    make_tree(src, classes=3, train_per_class=3, val_per_class=1, size=(200, 150))
    small = src / "train" / "n00000000" / "small.JPEG"
    small.write_bytes(_encode(render(0, split="train", i=50, size=(60, 40), seed=0)))
    report = write_dataset(src, tmp_path / "ds", shard_bytes=1 << 20, resize=Resize(64, 80))
    m = report.manifest
    assert (m.max_side, m.quality, m.version) == (64, 80, 3)
    sizes = {}
    for split in ("train", "val"):
        for key, (data, _) in _shard_samples(tmp_path / "ds", m, split).items():
            with Image.open(io.BytesIO(data)) as image:
                sizes[key] = image.size
    assert sizes.pop("small") == (60, 40)  # not larger than max_side: its bytes as they were
    assert set(sizes.values()) == {(64, 48)}
    assert _shard_samples(tmp_path / "ds", m, "train")["small"][0] == small.read_bytes()
    again = write_dataset(src, tmp_path / "ds", shard_bytes=1 << 20, resize=Resize(64, 80))
    assert again.written == [] and again.reused
    other = write_dataset(src, tmp_path / "ds", shard_bytes=1 << 20, resize=Resize(96, 80))
    assert other.reused == []  # another size: other bytes, every shard rewritten


def test_max_side_shards_are_planned_near_the_target(tmp_path):
    src = tmp_path / "src"
    make_tree(src, classes=4, train_per_class=30, val_per_class=0, size=(320, 240))
    report = write_dataset(src, tmp_path / "ds", shard_bytes=60_000, resize=Resize(80))
    sizes = np.array([s.bytes for s in report.manifest.shards("train")])
    assert len(sizes) >= 2
    assert sizes.max() <= 60_000 * 1.3 and sizes.mean() >= 60_000 * 0.5, sizes


def test_a_bad_source_leaves_no_destination_behind(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / TRAIN_TAR).write_bytes(b"")
    for src in (tmp_path / "missing", tmp_path / "src"):
        with pytest.raises(SparknetError):
            write_dataset(src, tmp_path / "new" / "ds")
        assert not (tmp_path / "new" / "ds").exists()


def test_a_member_name_that_is_not_utf8_is_refused_naming_it(tmp_path):
    src = tmp_path / "src"
    (src / "train").mkdir(parents=True)
    tar_path = src / "train" / "n00000001.tar"
    with tarfile.open(tar_path, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        data = _encode(render(1, split="train", i=0, size=(32, 24), seed=0))
        info = tarfile.TarInfo("caf\xe9.JPEG")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SparknetError, match="whose name is not valid UTF-8") as e:
        scan(src)
    assert "\n" not in str(e.value)


def test_empty_train_and_val_dirs_beside_the_tars_do_not_hide_them(downloads, tmp_path):
    """Someone made train/ and val/ to extract into, then did not: the tars are read."""
    src = tmp_path / "dl"
    src.mkdir()
    for name in (TRAIN_TAR, VAL_TAR, DEVKIT_TAR):
        os.symlink(downloads.dl / name, src / name)
    (src / "train").mkdir()
    (src / "val").mkdir()
    tree = scan(src)
    assert _labels(tree.splits["val"]) == _labels(scan(downloads.folders).splits["val"])
    assert len(tree.splits["train"]) == len(scan(downloads.folders).splits["train"])


def test_val_files_that_are_not_jpegs_are_skipped_too(tmp_path):
    src = tmp_path / "src"
    wnids = make_tree(src, classes=2, train_per_class=2, val_per_class=1, size=(32, 24))
    (src / "val" / wnids[0] / "x.png").write_bytes(b"not read")
    tree = scan(src)
    assert [(r.split, r.path) for r in tree.skipped] == [("val", f"val/{wnids[0]}/x.png")]


def _retar(src: Path, dest: Path, extra: list[tuple[str, bytes]]) -> None:
    """A copy of the tar `src` with `extra` members appended."""
    with tarfile.open(src) as old, tarfile.open(dest, "w", format=tarfile.GNU_FORMAT) as new:
        for m in old:
            new.addfile(m, old.extractfile(m))
        for name, data in extra:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            new.addfile(info, io.BytesIO(data))


def test_a_class_or_image_twice_in_a_tar_is_refused_not_merged(downloads, tmp_path):
    """Probe finding: a second `n...0.tar` (even under another dir) replaced the first one's
    images with another class's, labelled wrongly, exit 0."""
    with tarfile.open(downloads.dl / TRAIN_TAR) as tar:
        other = tar.extractfile(f"{downloads.wnids[1]}.tar").read()
    for name in (f"sub/{downloads.wnids[0]}.tar", f"{downloads.wnids[0]}.tar"):
        src = tmp_path / name.replace("/", "_")
        src.mkdir()
        _retar(downloads.dl / TRAIN_TAR, src / TRAIN_TAR, [(name, other)])
        with pytest.raises(
            SparknetError, match=r"download (it|ILSVRC2012_img_train\.tar) again"
        ) as e:
            scan(src)
        assert "twice" in str(e.value) or "two tars of class" in str(e.value)
    src = tmp_path / "valdup"
    src.mkdir()
    os.symlink(downloads.dl / TRAIN_TAR, src / TRAIN_TAR)
    os.symlink(downloads.dl / DEVKIT_TAR, src / DEVKIT_TAR)
    _retar(downloads.dl / VAL_TAR, src / VAL_TAR, [("ILSVRC2012_val_00000001.JPEG", b"x")])
    with pytest.raises(SparknetError, match=r"holds ILSVRC2012_val_00000001\.JPEG twice"):
        scan(src)


def test_a_damaged_devkit_is_one_line_that_still_says_what_to_do(downloads, tmp_path):
    src = tmp_path / "dk"
    src.mkdir()
    os.symlink(downloads.dl / TRAIN_TAR, src / TRAIN_TAR)
    for data in (b"\x1f\x8b garbage", b""):
        (src / DEVKIT_TAR).write_bytes(data)
        with pytest.raises(SparknetError) as e:
            scan(src)
        assert "\n" not in str(e.value) and str(e.value).endswith("download it again")


def test_classes_files_and_lists_are_read_as_people_write_them(tmp_path):
    from sparknet.data.imagenet import read_class_list

    f = tmp_path / "c.txt"
    f.write_bytes("\ufeffn01 n02,n03\r\n# comment\r\nn04 # four\r\n".encode())
    assert read_class_list(str(f)) == ["n01", "n02", "n03", "n04"]
    assert read_class_list("n01 n02, n03") == ["n01", "n02", "n03"]
    f.write_bytes(b"\xff\xfen01")
    with pytest.raises(SparknetError, match="cannot be read as UTF-8 text"):
        read_class_list(str(f))
    with pytest.raises(SparknetError, match="is a directory"):
        read_class_list(str(tmp_path))


def test_a_dest_inside_the_sources_train_dir_is_refused(tmp_path):
    src = tmp_path / "src"
    make_tree(src, classes=2, train_per_class=2, val_per_class=1, size=(32, 24))
    with pytest.raises(SparknetError, match="give a DEST outside it"):
        write_dataset(src, src / "train" / "shards")
    assert not (src / "train" / "shards").exists()


def test_quality_needs_max_side_and_max_side_has_a_ceiling(tmp_path):
    src = tmp_path / "src"
    make_tree(src, classes=2, train_per_class=2, val_per_class=1, size=(32, 24))
    for args, needle in (
        (["--quality", "5"], "--quality is the quality of images --max-side shrinks"),
        (["--max-side", "99999999999"], "--max-side"),
    ):
        done = subprocess.run(
            [str(SPARKNET), "data", "shard", str(src), str(tmp_path / "ds"), *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        lines = done.stderr.splitlines()
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
    assert not (tmp_path / "ds").exists()
