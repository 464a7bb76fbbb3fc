"""Writing WebDataset shards and the manifest: contents, sizes, mixing, resume, determinism."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from sparknet.data.imagenet import ImageTree, SourceImage, scan
from sparknet.data.manifest import MANIFEST_NAME, Manifest, sha256_file
from sparknet.data.shard_files import write_shard
from sparknet.data.shard_plan import ShardPlan, plan_shards
from sparknet.data.shards import WriteReport, write_dataset
from sparknet.errors import SparknetError
from tests.imagenet_tree import corrupt_jpeg, make_tree

CLASSES = 10
#: the shard target, as a fraction of the train images' bytes: small JPEGs nearly double in tar
#: (a 512-byte header each, padding, and a .cls member), so this gives 4-5 train shards
TARGET_FRACTION = 1 / 2


@dataclass(frozen=True)
class Written:
    src: Path
    dest: Path
    tree: ImageTree
    target: int
    report: WriteReport
    progress: list[tuple[str, int, int]]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Written:
    """One small tree written once (serially); tests that change things work on copies."""
    root = tmp_path_factory.mktemp("shards")
    src, dest = root / "src", root / "dest"
    make_tree(src, classes=CLASSES, train_per_class=16, val_per_class=4, size=(64, 48))
    tree = scan(src)
    source_bytes = sum(os.path.getsize(i.path) for i in tree.splits["train"])
    target = int(source_bytes * TARGET_FRACTION)
    progress: list[tuple[str, int, int]] = []
    report = write_dataset(
        src,
        dest,
        shard_bytes=target,
        seed=3,
        processes=1,
        on_progress=lambda phase, done, total: progress.append((phase, done, total)),
    )
    return Written(src, dest, tree, target, report, progress)


def _read_shard(path: Path) -> dict[str, tuple[bytes, int]]:
    """key -> (jpg bytes, label), checking every sample has exactly a .jpg and a .cls."""
    members: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            key, ext = member.name.split(".", 1)
            data = tar.extractfile(member).read()
            members.setdefault(key, {})[ext] = data
    assert all(set(m) == {"jpg", "cls"} for m in members.values())
    return {k: (m["jpg"], int(m["cls"].decode("ascii"))) for k, m in members.items()}


def test_train_shards_are_near_the_target_size(written):
    shards = written.report.manifest.splits["train"]
    assert len(shards) >= 3
    for shard in shards:
        assert 0.7 * written.target <= shard.bytes <= written.target


def test_every_image_is_in_exactly_one_shard_with_its_label(written):
    for split, images in written.tree.splits.items():
        seen: dict[str, tuple[bytes, int]] = {}
        for shard in written.report.manifest.splits[split]:
            samples = _read_shard(written.dest / shard.name)
            assert not set(samples) & set(seen)
            seen.update(samples)
        assert set(seen) == {i.key for i in images}
        for image in images:
            assert seen[image.key] == (image.path.read_bytes(), image.label)


def test_each_shard_mixes_most_classes(written):
    for shard in written.report.manifest.splits["train"]:
        labels = {label for _, label in _read_shard(written.dest / shard.name).values()}
        assert len(labels) >= 0.7 * CLASSES


def test_the_manifest_matches_the_files(written):
    manifest = Manifest.loads((written.dest / MANIFEST_NAME).read_text(), "manifest")
    assert manifest == written.report.manifest
    assert manifest.classes == written.tree.classes
    assert set(manifest.splits) == {"train", "val"}
    for split, images in written.tree.splits.items():
        assert manifest.samples(split) == len(images)
        for shard in manifest.shards(split):
            path = written.dest / shard.name
            assert path.stat().st_size == shard.bytes
            assert sha256_file(path) == shard.sha256
            assert len(_read_shard(path)) == shard.samples
    assert written.report.reused == []
    assert written.report.written == [s.name for s in manifest.splits["train"]] + [
        s.name for s in manifest.splits["val"]
    ]
    assert not [n for n in os.listdir(written.dest) if n.endswith(".tmp")]


def test_progress_counts_images_checked_then_written_from_zero_to_all(written):
    """Images, not shards: a full ImageNet run is hours, and images/s and its ETA need a count
    that moves. The check phase reports every 64 images and its last; the write phase each
    shard as it is finished."""
    images = sum(len(v) for v in written.tree.splits.values())
    check = [p for p in written.progress if p[0] == "check"]
    write = [p for p in written.progress if p[0] == "write"]
    assert written.progress == check + write  # all checking before any writing
    assert [c[1] for c in check] == [0, *range(64, images, 64), images]
    assert {c[2] for c in check} == {images}
    per_shard = [s.samples for v in written.report.manifest.splits.values() for s in v]
    assert [w[1] for w in write] == [sum(per_shard[:n]) for n in range(len(per_shard) + 1)]
    assert {w[2] for w in write} == {images}


def test_a_rerun_reuses_every_shard_and_rewrites_a_damaged_one(written, tmp_path):
    dest = tmp_path / "dest"
    shutil.copytree(written.dest, dest)
    # a shard of an older plan has a sidecar like every shard sparknet writes
    (dest / "train-999999.tar").write_bytes(b"stale shard of an older plan")
    shutil.copy(dest / ".train-000000.tar.json", dest / ".train-999999.tar.json")
    again = write_dataset(written.src, dest, shard_bytes=written.target, seed=3, processes=1)
    assert again.written == []
    assert again.reused == written.report.written
    assert again.manifest == written.report.manifest
    assert again.removed == ["train-999999.tar"]  # an older plan's shard is not left behind
    assert not (dest / "train-999999.tar").exists()

    damaged = written.report.manifest.splits["train"][1]
    with open(dest / damaged.name, "r+b") as f:  # same size, different bytes
        f.seek(damaged.bytes // 2)
        f.write(b"garbage!")
    (dest / written.report.manifest.splits["val"][0].name).unlink()
    fixed = write_dataset(written.src, dest, shard_bytes=written.target, seed=3, processes=1)
    assert fixed.written == [damaged.name, written.report.manifest.splits["val"][0].name]
    assert fixed.manifest == written.report.manifest  # rewritten byte-identically


def test_another_seed_rewrites_every_shard(written, tmp_path):
    dest = tmp_path / "dest"
    shutil.copytree(written.dest, dest)
    other = write_dataset(written.src, dest, shard_bytes=written.target, seed=4, processes=1)
    assert other.reused == []
    old = {s.name: s.sha256 for s in written.report.manifest.splits["train"]}
    assert all(old.get(s.name) != s.sha256 for s in other.manifest.splits["train"])


def test_the_same_seed_gives_byte_identical_shards(written, tmp_path):
    again = write_dataset(
        written.src, tmp_path / "again", shard_bytes=written.target, seed=3, processes=1
    )
    assert again.manifest == written.report.manifest
    for name in again.written:
        assert (tmp_path / "again" / name).read_bytes() == (written.dest / name).read_bytes()


def test_a_process_pool_writes_the_same_dataset(written, tmp_path):
    pooled = write_dataset(
        written.src, tmp_path / "pooled", shard_bytes=written.target, seed=3, processes=2
    )
    assert pooled.manifest == written.report.manifest


def _jpeg(size: int, seed: int = 0) -> bytes:
    """A real 8x8 JPEG padded to `size` bytes: PIL ignores bytes after the end-of-image marker,
    so planning sees any size it needs and the decode check still passes."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (seed % 256, 0, 0)).save(buf, format="JPEG")
    data = buf.getvalue()
    assert size >= len(data)
    return data + bytes(size - len(data))


def _images(n: int, tmp_path: Path, size: int = 1000) -> list[SourceImage]:
    out = []
    for i in range(n):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(_jpeg(size + i, seed=i))
        out.append(SourceImage(path=path, label=i % 3, key=f"img_{i}"))
    return out


def test_plans_are_a_seeded_shuffle_cut_by_bytes(tmp_path):
    images = _images(40, tmp_path)

    def order(plans: list[ShardPlan]) -> list[str]:
        return [i.key for p in plans for i in p.images]

    plans = plan_shards(images, split="train", seed=1, target_bytes=30_000)
    assert [p.name for p in plans] == [f"train-{n:06d}.tar" for n in range(len(plans))]
    assert sorted(order(plans)) == sorted(i.key for i in images)
    assert order(plans) == order(plan_shards(images, split="train", seed=1, target_bytes=30_000))
    assert order(plans) != order(plan_shards(images, split="train", seed=2, target_bytes=30_000))
    assert order(plans) != order(plan_shards(images, split="val", seed=1, target_bytes=30_000))
    # a sample takes 2.5 or 3 KiB of tar (110 KiB in all) and a shard keeps ~10 KiB for the tar's
    # end: 6 shards would hold it, 7 if an even cut overshoots; even sizes, no runt last shard
    assert len(plans) in (6, 7)
    counts = [len(p.images) for p in plans]
    assert max(counts) - min(counts) <= 2
    assert len({p.fingerprint for p in plans}) == len(plans)


def test_no_shard_outgrows_the_target_except_for_one_oversized_image(tmp_path):
    rng = random.Random(0)
    images = []
    for i in range(60):
        size = 120_000 if i == 7 else rng.randint(1000, 20_000)
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(_jpeg(size, seed=i))
        images.append(SourceImage(path=path, label=0, key=f"k{i}"))
    target = 60_000
    plans = plan_shards(images, split="train", seed=5, target_bytes=target)
    for plan in plans:
        info = write_shard(plan, tmp_path / "dest").info
        if any(image.key == "k7" for image in plan.images):
            assert info.samples == 1
        else:
            assert info.bytes <= target


def test_a_target_below_one_image_gives_one_image_per_shard(tmp_path):
    plans = plan_shards(_images(5, tmp_path), split="train", seed=0, target_bytes=1)
    assert [len(p.images) for p in plans] == [1] * 5
    assert plan_shards([], split="train", seed=0, target_bytes=1) == []


def test_an_unreadable_image_fails_the_shard_and_leaves_nothing_behind(tmp_path):
    images = _images(3, tmp_path)
    plan = plan_shards(images, split="train", seed=0, target_bytes=10**6)[0]
    images[1].path.unlink()
    dest = tmp_path / "dest"
    with pytest.raises(SparknetError, match="cannot read"):
        write_shard(plan, dest)
    assert os.listdir(dest) == []


def _copy_src(written: Written, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(written.src, src)
    return src


def test_images_that_do_not_decode_are_left_out_and_listed_in_the_manifest(written, tmp_path):
    src = _copy_src(written, tmp_path)
    train = sorted((src / "train").rglob("*.JPEG"))
    empty, garbage, cut, broken = train[3], train[20], train[41], train[77]
    empty.write_bytes(b"")
    garbage.write_bytes(os.urandom(3000))
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    corrupt_jpeg(broken)
    report = write_dataset(src, tmp_path / "dest", shard_bytes=written.target, seed=3, processes=1)
    m = report.manifest
    assert {(r.split, r.path) for r in m.rejected} == {
        ("train", p.relative_to(src).as_posix()) for p in (empty, garbage, cut, broken)
    }
    assert all(r.reason for r in m.rejected)
    assert m.samples("train") == len(written.tree.splits["train"]) - 4
    packed = {k for s in m.shards("train") for k in _read_shard(tmp_path / "dest" / s.name)}
    assert not packed & {p.stem for p in (empty, garbage, cut, broken)}
    on_disk = Manifest.loads((tmp_path / "dest" / MANIFEST_NAME).read_text(), "m")
    assert on_disk == m and on_disk.version == 2
    again = write_dataset(src, tmp_path / "dest", shard_bytes=written.target, seed=3, processes=1)
    assert again.written == [] and again.manifest == m  # a re-run still lists the rejects


def test_a_clean_manifest_stays_version_1_for_older_readers(written):
    raw = json.loads((written.dest / MANIFEST_NAME).read_text())
    assert raw["version"] == 1 and "rejected" not in raw


def test_a_source_image_changed_at_the_same_size_rewrites_its_shard(written, tmp_path):
    src = _copy_src(written, tmp_path)
    dest = tmp_path / "dest"
    shutil.copytree(written.dest, dest)
    first = write_dataset(src, dest, shard_bytes=written.target, seed=3, processes=1)
    image = sorted((src / "train").rglob("*.JPEG"))[5]
    data = bytearray(image.read_bytes())
    data[-3] ^= 0xFF  # inside the entropy-coded data, before the end marker: same size
    stat = image.stat()
    image.write_bytes(bytes(data))
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = write_dataset(src, dest, shard_bytes=written.target, seed=3, processes=1)
    owner = next(
        s.name for s in first.manifest.shards("train")
        if image.stem in _read_shard(dest / s.name)
    )  # fmt: skip
    assert again.written == [owner]
    assert _read_shard(dest / owner)[image.stem][0] == bytes(data)


def test_shards_and_manifest_are_readable_by_everyone(written):
    names = [MANIFEST_NAME, *written.report.written]
    assert {oct(os.stat(written.dest / n).st_mode & 0o777) for n in names} == {oct(0o644)}


def test_a_reshard_into_bigger_shards_removes_the_old_extra_ones(written, tmp_path):
    dest = tmp_path / "dest"
    shutil.copytree(written.dest, dest)
    bigger = write_dataset(written.src, dest, shard_bytes=written.target * 4, seed=3, processes=1)
    listed = {s.name for v in bigger.manifest.splits.values() for s in v}
    on_disk = {p.name for p in dest.glob("*.tar")}
    assert on_disk == listed
    assert bigger.removed == sorted(set(written.report.written) - listed)
    assert not [p for p in dest.glob(".*.tar.json") if p.name[1:-5] not in listed]


def test_a_reshard_leaves_user_files_with_shard_like_names_alone(written, tmp_path):
    """Only shards sparknet wrote (a sidecar beside them) are removed as orphans."""
    dest = tmp_path / "dest"
    shutil.copytree(written.dest, dest)
    mine = {"imagenet-000000.tar": b"the user's own tar", "train-000999.tar": b"also theirs"}
    for name, data in mine.items():
        (dest / name).write_bytes(data)
    again = write_dataset(written.src, dest, shard_bytes=written.target, seed=3, processes=1)
    assert again.removed == []
    assert {name: (dest / name).read_bytes() for name in mine} == mine


def test_shard_writing_processes_never_import_torch():
    """Each pool process imports this module; torch would cost it seconds (webdataset imports
    it), which made the default of all cores slower than one process on two cores."""
    code = "import sys, sparknet.data.shards; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_default_writes_with_threads_and_starts_no_process(written, tmp_path, monkeypatch):
    """On 2 cores a spawned pool lost to one process (each pays ~0.5 s of CPU to start); threads
    cost nothing to start and decode/hash outside the GIL. Same bytes as one process."""
    import multiprocessing

    def no_processes(*args, **kwargs):
        raise AssertionError("the default must not start processes")

    monkeypatch.setattr(multiprocessing, "get_context", no_processes)
    threaded = write_dataset(written.src, tmp_path / "t", shard_bytes=written.target, seed=3)
    assert threaded.manifest == written.report.manifest


def test_images_are_checked_before_the_cut_so_no_shard_is_empty(tmp_path):
    """A class whose every image is bad, and a mostly-bad split: shards hold only good images,
    none is empty, and the class is warned about."""
    src = tmp_path / "src"
    make_tree(src, classes=3, train_per_class=6, val_per_class=2, size=(32, 24))
    for path in sorted((src / "train" / "n00000001").iterdir()):
        path.write_bytes(b"not a jpeg")
    report = write_dataset(src, tmp_path / "dest", shard_bytes=4000, seed=0, processes=1)
    m = report.manifest
    assert all(s.samples > 0 for v in m.splits.values() for s in v)
    assert m.samples("train") == 12 and len(m.rejected) == 6
    assert report.warnings == [
        "warning: class n00000001 has no train image that decodes: the model cannot learn it"
    ]


def test_an_image_overwritten_with_its_mtime_kept_is_decode_checked_again(tmp_path):
    """`cp -p` over an image keeps size and mtime: the ctime it sets makes the re-run decode it
    again, so the undecodable bytes are rejected instead of packed into a shard."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    make_tree(src, classes=2, train_per_class=4, val_per_class=2, size=(32, 24))
    write_dataset(src, dest, shard_bytes=4000, seed=0, processes=1)
    image = sorted((src / "train").rglob("*.JPEG"))[2]
    st = image.stat()
    image.write_bytes(b"\0" * st.st_size)
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (image.stat().st_size, image.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    report = write_dataset(src, dest, shard_bytes=4000, seed=0, processes=1)
    rel = image.relative_to(src).as_posix()
    assert [r.path for r in report.manifest.rejected] == [rel]
    packed = {k for s in report.manifest.shards("train") for k in _read_shard(dest / s.name)}
    assert image.stem not in packed and report.manifest.samples("train") == 7


def test_a_directory_where_the_checks_file_goes_is_named_not_the_temp(tmp_path):
    from sparknet.data.shard_checks import CHECKS_NAME, JOURNAL_NAME

    src, dest = tmp_path / "src", tmp_path / "dest"
    make_tree(src, classes=2, train_per_class=2, val_per_class=1, size=(32, 24))
    (dest / CHECKS_NAME).mkdir(parents=True)
    with pytest.raises(SparknetError) as info:
        write_dataset(src, dest, shard_bytes=4000, seed=0, processes=1)
    text = str(info.value)
    assert f"cannot write {dest / CHECKS_NAME} " in text and "directory" in text, text
    assert ".tmp" not in text and "\n" not in text
    # the checks made are kept in the journal, for the run after the directory is moved away
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [CHECKS_NAME, JOURNAL_NAME, ".sparknet-shard.lock"]
    )


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_with_no_image_that_decodes_is_refused(tmp_path, split):
    src = tmp_path / "src"
    make_tree(src, classes=2, train_per_class=3, val_per_class=2, size=(32, 24))
    for path in (src / split).rglob("*.JPEG"):
        path.write_bytes(b"")
    with pytest.raises(SparknetError) as info:
        write_dataset(src, tmp_path / "dest", shard_bytes=4000, seed=0, processes=1)
    assert f"no image of the {split} split" in str(info.value)
    assert "\n" not in str(info.value) and "empty file" in str(info.value)
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()
    assert not list((tmp_path / "dest").glob("*.tar"))


def test_reject_reasons_hold_no_addresses_and_paths_are_relative_to_the_source(tmp_path):
    src = tmp_path / "src"
    make_tree(src, classes=2, train_per_class=3, val_per_class=2, size=(32, 24))
    bad = sorted((src / "train").rglob("*.JPEG"))[0]
    bad.write_bytes(os.urandom(2000))
    m = write_dataset(src, tmp_path / "dest", shard_bytes=4000, seed=0, processes=1).manifest
    (rejected,) = m.rejected
    assert rejected.path == bad.relative_to(src).as_posix()
    assert " at 0x" not in rejected.reason and rejected.reason


def test_a_second_writer_into_the_same_destination_is_refused(tmp_path):
    """The lock is an flock: a second open of it (another run) cannot take it while held."""
    import fcntl

    from sparknet.data.shards import LOCK_NAME

    src, dest = tmp_path / "src", tmp_path / "dest"
    make_tree(src, classes=2, train_per_class=3, val_per_class=2, size=(32, 24))
    dest.mkdir()
    (dest / ".train-000000.tar.abc.tmp").write_bytes(b"the first run's in-flight temp")
    with open(dest / LOCK_NAME, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SparknetError) as info:
            write_dataset(src, dest, shard_bytes=4000, seed=0, processes=1)
    assert "another `sparknet data shard` or `data upload` is using" in str(info.value)
    assert (dest / ".train-000000.tar.abc.tmp").exists()  # the other run's temp is untouched
    write_dataset(src, dest, shard_bytes=4000, seed=0, processes=1)  # free again: it runs
    assert (dest / MANIFEST_NAME).exists()


def test_a_full_disk_is_one_line_and_leaves_no_temp(tmp_path, monkeypatch):
    """ENOSPC is simulated (a mock: tests cannot mount a small file system): fsync fails."""
    import errno

    src, dest = tmp_path / "src", tmp_path / "dest"
    make_tree(src, classes=2, train_per_class=3, val_per_class=2, size=(32, 24))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SparknetError) as info:
        write_dataset(src, dest, shard_bytes=4000, seed=0, processes=1)
    text = str(info.value)
    assert "No space left on device" in text and "free some space" in text
    assert "\n" not in text and info.value.__cause__ is None
    assert not list(dest.glob("*.tmp")) and not list(dest.glob(".*.tmp"))


def test_an_io_error_reading_an_image_does_not_blame_permissions(tmp_path, monkeypatch):
    """EIO is simulated (a mock: no failing disk here); EACCES keeps the permissions advice."""
    import errno

    src = tmp_path / "src"
    make_tree(src, classes=2, train_per_class=2, val_per_class=1, size=(16, 16))
    victim = sorted((src / "train").rglob("*.JPEG"))[0]
    real = Path.read_bytes
    for code, advice in [(errno.EIO, "replace it or remove it"),
                         (errno.EACCES, "fix its permissions or remove it")]:  # fmt: skip

        def failing(self: Path, code: int = code) -> bytes:
            if self == victim:
                raise OSError(code, os.strerror(code))
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", failing)
        with pytest.raises(SparknetError) as info:
            write_dataset(src, tmp_path / "dest", shard_bytes=4000, seed=0, processes=1)
        assert f"cannot read {victim}" in str(info.value) and advice in str(info.value)


def test_a_rerun_after_images_were_added_or_removed_warns_that_shards_were_rewritten(tmp_path):
    """The shuffle spans the whole split, so one image less rewrites most shards: say so."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    make_tree(src, classes=3, train_per_class=8, val_per_class=2, size=(32, 24))
    assert write_dataset(src, dest, shard_bytes=8000, seed=0, processes=1).warnings == []
    assert write_dataset(src, dest, shard_bytes=8000, seed=0, processes=1).warnings == []
    sorted((src / "train").rglob("*.JPEG"))[0].unlink()
    again = write_dataset(src, dest, shard_bytes=8000, seed=0, processes=1)
    (warning,) = again.warnings
    assert warning.startswith("warning: 1 source images were added or removed since the last run")
    total = len(again.written) + len(again.reused)
    assert again.written and f"{len(again.written)} of {total} shards were rewritten" in warning


def test_the_default_uses_threads_for_a_small_source_and_processes_for_a_big_one(monkeypatch):
    """From the figures in PROCESS_MIN_IMAGES's comment: a pool's start-up is paid back only
    over many images; `--processes N` means N processes for both phases, 1 serially."""
    from sparknet.data.shard_pool import MAX_DEFAULT_PROCESSES, PROCESS_MIN_IMAGES, phase_workers

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert phase_workers(None, PROCESS_MIN_IMAGES - 1, 50) == ("threads", 4)
    assert phase_workers(None, PROCESS_MIN_IMAGES, 50) == ("processes", 4)
    assert phase_workers(None, 10**6, 3) == ("processes", 3)  # never more workers than jobs
    assert phase_workers(None, 10**6, 1) == ("threads", 1)
    assert phase_workers(2, 10, 50) == ("processes", 2)
    assert phase_workers(1, 10**6, 50) == ("threads", 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 96)
    assert phase_workers(None, 10**6, 5000) == ("processes", MAX_DEFAULT_PROCESSES)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert phase_workers(None, 10**6, 5000) == ("threads", 1)
