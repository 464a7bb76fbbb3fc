"""ImageNet-layout data end to end: shard, upload to S3 (moto's server), train on local Spark.

Spark's Python workers and the CLI subprocesses reach moto only through AWS_ENDPOINT_URL (set by
the `moto_endpoint` fixture before Spark starts), exactly as they would reach S3.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import sparknet
from sparknet.config import TrainConfig
from sparknet.data.manifest import MANIFEST_NAME, Manifest, ShardInfo, sha256_file
from sparknet.data.shards import write_dataset
from sparknet.data.store import LocalStore
from sparknet.data.stream import epoch_shards, read_positions
from sparknet.errors import SparknetError
from sparknet.ml.batch_predict import predict
from sparknet.training.driver import train
from sparknet.training.evaluation import evaluate
from sparknet.training.report import read_metrics
from sparknet.training.saved_model import read_info, write_info
from tests.conftest import SPARKNET
from tests.imagenet_tree import corrupt_jpeg, make_tree, wnid

pytestmark = pytest.mark.integration

CLASSES = 10
SHARD_BYTES = 150_000
#: settings that learn the synthetic classes in a few seconds on two CPU cores
FAST = dict(model="cnn", image_size=32, workers=2, tau=10, batch_size=32, lr=0.05, seed=0)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagenet")
    make_tree(root, classes=CLASSES, train_per_class=60, val_per_class=10)
    return root


@pytest.fixture(scope="module")
def shards(tree, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("shards")
    write_dataset(tree, dest, shard_bytes=SHARD_BYTES, seed=0, processes=2)
    return dest


def _cli(*args: str, cwd: Path, env: dict | None = None, timeout: int = 300):
    return subprocess.run(
        [str(SPARKNET), *args], cwd=cwd, env=env or os.environ.copy(), capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def _upload(shards: Path, uri: str, cwd: Path) -> None:
    done = _cli("data", "upload", str(shards), uri, cwd=cwd)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_named_s3_dataset_trains_well_above_chance(shards, bucket, tmp_path):
    uri = f"s3://{bucket}/imagenet"
    _upload(shards, uri, tmp_path)
    (tmp_path / "sparknet.yaml").write_text(
        yaml.safe_dump({"datasets": {"imagenet": {"uri": uri}}})
    )
    listed = _cli("data", "ls", "imagenet", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "train" in listed.stdout and "val" in listed.stdout

    cache = tmp_path / "cache"
    done = _cli(
        "train", "--data", "imagenet", "--model", "cnn", "--image-size", "32", "--workers", "2",
        "--tau", "10", "--rounds", "10", "--batch-size", "32", "--eval-every", "5",
        "--loader-workers", "1", "--cache-dir", str(cache), "--out", "run", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = read_metrics(tmp_path / "run")
    final = rows[-1]
    assert final["eval_samples"] == CLASSES * 10
    assert final["eval_accuracy"] >= 0.6, final  # chance is 0.1
    assert final["eval_top5"] >= final["eval_accuracy"]
    assert sum(r["skipped_samples"] for r in rows) == 0
    manifest = Manifest.loads((shards / MANIFEST_NAME).read_text(), "manifest")
    cached = [p for p in cache.rglob("*") if p.is_file()]
    assert len(cached) == len(manifest.shards("train")) + len(manifest.shards("val"))

    # the run dir is the model: its recorded transform (torchvision's, not sparknet's decoder)
    # on the val shards' images gives the run's own accuracy, with the dataset's class names
    info = read_info(tmp_path / "run")
    assert (info.input.kind, info.input.shape, info.input.resize) == ("image", (3, 32, 32), 37)
    assert info.classes == manifest.classes
    assert [c.wnid for c in info.classes] == sorted(wnid(k) for k in range(CLASSES))
    accuracy = _accuracy(sparknet.load_model(tmp_path / "run"), info, shards)
    assert accuracy == pytest.approx(final["eval_accuracy"], abs=0.03)  # JPEG draft decoding

    # `sparknet evaluate` over the same split on S3 is the run's own final evaluation, each
    # class named as the manifest names it; its report goes into the run dir
    done = _cli("evaluate", "run", "--data", "imagenet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "run/evaluations/imagenet/evaluation.json").read_text())
    assert (report["top1"], report["top5"], report["samples"]) == (
        final["eval_accuracy"],
        final["eval_top5"],
        final["eval_samples"],
    )
    assert [(c["wnid"], c["name"]) for c in report["classes"]] == [
        (c.wnid, c.name) for c in info.classes
    ]
    assert [c["samples"] for c in report["classes"]] == [10] * CLASSES


def _accuracy(model, info, shards: Path) -> float:
    """Top-1 of `model` over the val shards, each image made an input as `info` says."""
    from PIL import Image
    from torchvision.transforms import v2

    spec = info.input
    transform = v2.Compose([
        v2.Resize(spec.resize, antialias=True), v2.CenterCrop(spec.image_size), v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(spec.mean, spec.std),
    ])  # fmt: skip
    inputs, labels = [], []
    for shard in sorted(shards.glob("val-*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        for name, data in members.items():
            if name.endswith(".jpg"):
                image = Image.open(io.BytesIO(data)).convert("RGB")
                inputs.append(transform(image))
                labels.append(int(members[name[: -len("jpg")] + "cls"]))
    with torch.no_grad():
        predicted = model(torch.stack(inputs)).argmax(1)
    return float((predicted == torch.tensor(labels)).float().mean())


@pytest.mark.slow
def test_verify_names_a_shard_changed_on_s3(shards, bucket, tmp_path):
    uri = f"s3://{bucket}/ds"
    _upload(shards, uri, tmp_path)
    assert _cli("data", "verify", uri, cwd=tmp_path).returncode == 0
    s3 = boto3.client("s3")
    body = bytearray((shards / "train-000002.tar").read_bytes())
    body[1000] ^= 0xFF
    s3.put_object(Bucket=bucket, Key="ds/train-000002.tar", Body=bytes(body))
    done = _cli("data", "verify", uri, cwd=tmp_path)
    assert done.returncode == 1
    assert "train-000002.tar" in done.stdout and "sha256" in done.stdout
    assert "train-000001.tar" not in done.stdout


def test_missing_bucket_fails_in_one_line_before_spark_starts(tmp_path):
    done = _cli("train", "--data", "s3://no-such-bucket-here/x", "--out", "run", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-bucket-here" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_missing_credentials_fail_in_one_line(tmp_path, moto_endpoint):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=moto_endpoint,
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    done = _cli("train", "--data", "s3://some-bucket/x", "--out", "run", cwd=tmp_path, env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "credentials" in lines[0].lower(), done.stderr


def _bad_dataset(tree: Path, dest: Path, monkeypatch) -> tuple[Path, str]:
    """A copy of the shards with one corrupt JPEG and one shard cut inside its last member,
    its manifest updated to the cut bytes: what an older sparknet or another tool may write
    (`data shard` itself now leaves undecodable images out, so its check is switched off)."""
    from sparknet.data import shard_checks

    src = dest / "tree"
    shutil.copytree(tree, src)
    victim = sorted((src / "train").rglob("*.JPEG"))[7]
    corrupt_jpeg(victim)
    out = dest / "shards"
    from sparknet.data.decode import ImageCheck

    monkeypatch.setattr(shard_checks, "inspect_image", lambda data: ImageCheck(None, 1, 1))
    write_dataset(src, out, shard_bytes=SHARD_BYTES, seed=0, processes=1)
    manifest = Manifest.loads((out / MANIFEST_NAME).read_text(), "manifest")
    cut = manifest.splits["train"][1]
    path = out / cut.name
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    path.write_bytes(path.read_bytes()[: last.offset_data + last.size // 2])  # inside a member
    fixed = ShardInfo(
        name=cut.name, samples=cut.samples, bytes=path.stat().st_size, sha256=sha256_file(path)
    )
    splits = dict(manifest.splits)
    splits["train"] = [fixed if s.name == cut.name else s for s in splits["train"]]
    (out / MANIFEST_NAME).write_text(Manifest(classes=manifest.classes, splits=splits).dumps())
    return out, victim.stem.replace(".", "_")


def _expected_skips(out: Path, corrupt_key: str, cfg: TrainConfig) -> int:
    """Positions read in the run that are unreadable (None) or the corrupt image."""
    manifest = Manifest.loads((out / MANIFEST_NAME).read_text(), "manifest")
    shards = manifest.shards("train")
    store = LocalStore(out)
    per_partition = cfg.rounds * cfg.tau * cfg.batch_size
    bad = 0
    for k in range(cfg.workers):
        stream = read_positions(
            shards, lambda s: store.open(s.name), seed=cfg.seed, workers=cfg.workers,
            partition=k, start=0,
        )  # fmt: skip
        for _ in range(per_partition):
            item = next(stream)
            bad += item is None or item.key == corrupt_key
    return bad


def test_corrupt_jpeg_and_truncated_member_are_skipped_and_counted(
    spark, tree, tmp_path, monkeypatch
):
    out, corrupt_key = _bad_dataset(tree, tmp_path, monkeypatch)
    cfg = TrainConfig(data=str(out), rounds=2, eval_every=2, loader_workers=0, cache_gb=0,
                      out=tmp_path / "run", **FAST)  # fmt: skip
    result = train(cfg, spark=spark)
    skipped = sum(r["skipped_samples"] for r in result.metrics)
    expected = _expected_skips(out, corrupt_key, cfg)
    assert expected >= 2  # one epoch is read in full: both kinds of damage are met
    assert skipped == expected
    assert result.final["samples"] == 2 * 10 * 32 - result.final["skipped_samples"]


def test_missing_shard_on_s3_is_named(spark, shards, bucket, tmp_path):
    uri = f"s3://{bucket}/gone"
    _upload(shards, uri, tmp_path)
    counts = [
        s.samples for s in Manifest.loads((shards / MANIFEST_NAME).read_text(), "m").shards("train")
    ]
    first = epoch_shards(counts, seed=0, epoch=0, workers=2, partition=0)[0]
    name = f"train-{first:06d}.tar"
    boto3.client("s3").delete_object(Bucket=bucket, Key=f"gone/{name}")
    cfg = TrainConfig(
        data=uri, rounds=1, cache_gb=0, loader_workers=0, out=tmp_path / "run", **FAST
    )
    with pytest.raises(SparknetError, match=name):
        train(cfg, spark=spark)


def _image_parquet(tree: Path, split: str, path: Path) -> None:
    from sparknet.data.imagenet import scan

    images = scan(tree).splits[split]
    table = pa.table(
        {
            "image": pa.array([p.path.read_bytes() for p in images], pa.binary()),
            "label": pa.array([p.label for p in images], pa.int32()),
        }
    )
    pq.write_table(table, path)


@pytest.mark.slow
def test_dataframe_of_the_same_images_reaches_the_same_band(spark, tree, tmp_path):
    import sparknet

    _image_parquet(tree, "train", tmp_path / "train.parquet")
    _image_parquet(tree, "val", tmp_path / "val.parquet")
    df = spark.read.parquet(str(tmp_path / "train.parquet"))
    eval_df = spark.read.parquet(str(tmp_path / "val.parquet"))
    result = sparknet.fit(
        df, eval_df=eval_df, rounds=10, eval_every=5, loader_workers=1,
        out=tmp_path / "run", **FAST,
    )  # fmt: skip
    assert result.final["eval_samples"] == CLASSES * 10
    assert result.final["eval_accuracy"] >= 0.6, result.final
    assert not spark.sparkContext._jsc.getPersistentRDDs(), "the persisted frame was released"
    # the same frame evaluated after the run: its final evaluation, in this session
    ev = evaluate(tmp_path / "run", f"parquet:{tmp_path / 'val.parquet'}", spark=spark)
    assert (ev.samples, ev.top1, ev.top5) == (
        CLASSES * 10,
        result.final["eval_accuracy"],
        result.final["eval_top5"],
    )
    assert ev.loss == pytest.approx(result.final["eval_loss"], rel=1e-9)
    assert not spark.sparkContext._jsc.getPersistentRDDs()


def test_any_split_evaluates_and_other_classes_are_refused_before_spark(spark, shards, tmp_path):
    run = tmp_path / "run"
    train(TrainConfig(data=str(shards), rounds=1, eval_every=0, loader_workers=1, out=run, **FAST),
          spark=spark)  # fmt: skip
    ev = evaluate(run, str(shards), split="train", spark=spark)
    assert ev.split == "train" and ev.samples == CLASSES * 60
    assert ev.confusion.sum(1).tolist() == [60] * CLASSES
    # `sparknet predict` of the val split: a row per sample, keyed as the shards key it, right
    # as often as the evaluation counts
    val = evaluate(run, str(shards), spark=spark)
    done = predict(run, str(shards), f"parquet:{tmp_path / 'p'}", spark=spark)
    table = pq.read_table(tmp_path / "p").to_pandas()
    assert done.rows == len(table) == CLASSES * 10 and done.skipped == 0
    keys = set()
    for shard in shards.glob("val-*.tar"):
        with tarfile.open(shard) as tar:
            keys |= {m.name.rsplit(".", 1)[0] for m in tar.getmembers() if m.isfile()}
    assert set(table["key"]) == keys
    assert (table["prediction"] == table["label"]).mean() == pytest.approx(val.top1, abs=1e-12)
    with pytest.raises(SparknetError, match=r"has no split 'test' \(it has: train, val\); pass"):
        evaluate(run, str(shards), split="test", spark=object())

    info = read_info(run)
    swapped = [*info.classes]  # classes 3 and 4 named the other way round
    swapped[3], swapped[4] = (
        swapped[3].model_copy(update={"wnid": info.classes[4].wnid}),
        swapped[4].model_copy(update={"wnid": info.classes[3].wnid}),
    )
    renamed = info.model_copy(update={"classes": swapped})
    write_info(LocalStore(run), renamed)
    with pytest.raises(SparknetError) as exc:
        evaluate(run, str(shards), spark=object())  # refused before any Spark call
    assert str(exc.value) == (
        f"the classes of {shards} are not the model's: class 3 is {wnid(3)!r} there and "
        f"{wnid(4)!r} in {run}; use a dataset sharded with the same classes"
    )


def test_feature_table_trains_from_cli_flags(spark, tmp_path):
    """digits as a numeric-array Parquet dataset: `--data parquet:` and `--eval-data parquet:`
    as the CLI makes them a config, trained in this process (a CLI run of a `parquet:` dataset
    is test_standalone.py's)."""
    from sparknet.data.sources import digits
    from tests.helpers import cli_config

    for name, ds in zip(("train", "test"), digits(), strict=True):
        x, y = ds.tensors
        table = pa.table(
            {
                "features": pa.array(
                    x.reshape(len(x), -1).numpy().tolist(), pa.list_(pa.float32())
                ),
                "label": pa.array(y.numpy(), pa.int64()),
            }
        )
        pq.write_table(table, tmp_path / f"{name}.parquet")
    flags = (
        "--data", f"parquet:{tmp_path / 'train.parquet'}",
        "--eval-data", f"parquet:{tmp_path / 'test.parquet'}", "--model", "mlp",
        "--workers", "2", "--rounds", "20", "--eval-every", "20", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    train(cli_config(flags), spark=spark)
    final = read_metrics(tmp_path / "run")[-1]
    assert final["eval_accuracy"] >= 0.9, final
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["samples"]


def test_shard_cli_writes_a_manifest_and_a_rerun_keeps_every_shard(tree, tmp_path):
    dest = tmp_path / "ds"
    first = _cli("data", "shard", str(tree), str(dest), "--shard-mb", "1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    manifest = Manifest.loads((dest / MANIFEST_NAME).read_text(), "manifest")
    n = len(manifest.shards("train")) + len(manifest.shards("val"))
    assert manifest.samples("train") == CLASSES * 60 and manifest.samples("val") == CLASSES * 10
    assert f"{n} written, 0 kept" in first.stdout
    again = _cli("data", "shard", str(tree), str(dest), "--shard-mb", "1", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"0 written, {n} kept" in again.stdout


def test_table_name_trains_in_the_callers_session(spark, tmp_path):
    """`table:NAME` resolves in the session's catalog; the persisted partitions are released."""
    from sparknet.data.sources import digits

    train_set, test_set = digits()
    for name, ds in (("digits_train", train_set), ("digits_test", test_set)):
        x, y = ds.tensors
        flat = x.reshape(len(x), -1).tolist()
        rows = [(v, int(label)) for v, label in zip(flat, y.tolist(), strict=True)]
        spark.createDataFrame(rows, "features array<float>, label int").createOrReplaceTempView(
            name
        )
    cfg = TrainConfig(data="table:digits_train", eval_data="table:digits_test", model="mlp",
                      rounds=20, eval_every=20, out=tmp_path / "run")  # fmt: skip
    result = train(cfg, spark=spark)
    assert result.final["eval_samples"] == len(test_set)
    assert result.final["eval_accuracy"] >= 0.9, result.final
    assert not spark.sparkContext._jsc.getPersistentRDDs()


def test_unknown_table_is_one_line(spark, tmp_path):
    cfg = TrainConfig(data="table:no_such_table", out=tmp_path / "run")
    with pytest.raises(SparknetError, match="cannot read table:no_such_table"):
        train(cfg, spark=spark)
    assert not (tmp_path / "run").exists()


def test_a_dataset_of_only_bad_images_fails_naming_the_fix(spark, tmp_path):
    import webdataset as wds

    from sparknet.data.manifest import ClassInfo

    infos = []
    for i in range(2):
        path = tmp_path / f"train-{i:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for j in range(8):
                sink.write({"__key__": f"k{i}_{j}", "jpg": b"not a jpeg", "cls": str(j % 2)})
        infos.append(
            ShardInfo(
                name=path.name, samples=8, bytes=path.stat().st_size, sha256=sha256_file(path)
            )
        )
    classes = [ClassInfo(index=k, wnid=f"n{k:08d}") for k in range(2)]
    (tmp_path / MANIFEST_NAME).write_text(
        Manifest(classes=classes, splits={"train": infos}).dumps()
    )
    cfg = TrainConfig(data=str(tmp_path), rounds=1, loader_workers=0, out=tmp_path / "run", **FAST)
    with pytest.raises(
        SparknetError, match=r"could not read a single sample.*sparknet data verify"
    ):
        train(cfg, spark=spark)


def test_shard_cli_names_the_images_it_left_out(tree, tmp_path):
    src = tmp_path / "tree"
    shutil.copytree(tree, src)
    bad = sorted((src / "train").rglob("*.JPEG"))[3]
    bad.write_bytes(b"")
    done = _cli("data", "shard", str(src), str(tmp_path / "ds"), "--shard-mb", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1 images do not decode and were left out" in done.stdout
    assert f"  {bad}: empty file" in done.stdout
    manifest = Manifest.loads((tmp_path / "ds" / MANIFEST_NAME).read_text(), "m")
    assert [r.path for r in manifest.rejected] == [bad.relative_to(src).as_posix()]
    assert manifest.samples("train") == CLASSES * 60 - 1


def test_a_local_shard_changed_at_its_size_fails_the_run_naming_it(spark, shards, tmp_path):
    """It used to train to rc 0, its samples counted as skipped."""
    ds = tmp_path / "ds"
    shutil.copytree(shards, ds)
    victim = Manifest.loads((ds / MANIFEST_NAME).read_text(), "m").shards("train")[0]
    data = bytearray((ds / victim.name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ds / victim.name).write_bytes(bytes(data))
    cfg = TrainConfig(data=str(ds), rounds=2, eval_every=0, loader_workers=0, cache_gb=0,
                      out=tmp_path / "run", **FAST)  # fmt: skip
    with pytest.raises(SparknetError) as exc:
        train(cfg, spark=spark)
    text = str(exc.value)
    assert victim.name in text and "sha256" in text and "sparknet data verify" in text, text
