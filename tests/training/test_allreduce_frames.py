"""DataFrames on the allreduce transport, on a real local Spark (local[2,2]): rank k trains on
frame partition k exactly as task k of the spark transport does, so the two transports agree;
a resume continues bit for bit; a rank that dies restarts from the checkpoint with the very
model of a run without the death; `--compress` takes a DataFrame now."""

from __future__ import annotations

import filecmp
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from sparknet.config import TrainConfig, load_train_config
from sparknet.data.sources import digits
from sparknet.training.driver import train
from sparknet.training.report import read_metrics
from sparknet.training.rundir import read_run_config
from tests.helpers import assert_state_close, assert_state_equal, load_run_model

pytestmark = pytest.mark.integration

SETTINGS = dict(model="mlp", workers=2, tau=3, batch_size=16, momentum=0.9, seed=5)


def _transport(run_dir: Path) -> str:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["transport"]


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, str]:
    """digits as Parquet: feature arrays (train, test), and a small set of encoded images."""
    out = tmp_path_factory.mktemp("frames")
    for name, ds in zip(("train", "test"), digits(), strict=True):
        x, y = ds.tensors
        features = pa.array(x.reshape(len(x), -1).numpy().tolist(), pa.list_(pa.float32()))
        pq.write_table(pa.table({"features": features, "label": y.numpy()}), out / f"{name}.pq")
    rng = np.random.default_rng(0)
    images = []
    for i in range(48):
        buf = io.BytesIO()
        pixels = rng.integers(0, 255, (24, 24, 3), dtype=np.uint8) // (1 + i % 3)
        Image.fromarray(pixels).save(buf, format="JPEG")
        images.append(buf.getvalue())
    labels = [i % 3 for i in range(48)]
    pq.write_table(pa.table({"image": images, "label": labels}), out / "images.pq")
    return {name: f"parquet:{out / name}.pq" for name in ("train", "test", "images")}


def test_both_transports_agree_on_a_dataframe_with_its_eval_frame(spark, tmp_path, tables):
    results = {}
    for transport in ("spark", "allreduce"):
        cfg = TrainConfig(
            out=tmp_path / transport, transport=transport, rounds=4, eval_every=2,
            data=tables["train"], eval_data=tables["test"], **SETTINGS,
        )  # fmt: skip
        results[transport] = train(cfg, spark=spark).metrics
        assert _transport(tmp_path / transport) == transport
    got, want = results["allreduce"], results["spark"]
    assert [r.get("eval_samples") for r in got] == [None, 360, None, 360]
    assert [r.get("eval_accuracy") for r in got] == [r.get("eval_accuracy") for r in want]
    assert [r["samples"] for r in got] == [r["samples"] for r in want] == [96] * 4
    assert np.allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)
    assert_state_close(
        load_run_model(tmp_path / "allreduce"), load_run_model(tmp_path / "spark"), rtol=1e-5
    )
    assert not spark.sparkContext._jsc.getPersistentRDDs(), "the persisted frames were released"


def test_an_image_frame_without_an_eval_frame_trains_the_same_batches(spark, tmp_path, tables):
    """Encoded images: each rank decodes its partition's rows with the seeds task k would use;
    without an eval frame no round is evaluated, under either transport."""
    for transport in ("spark", "allreduce"):
        cfg = TrainConfig(
            out=tmp_path / transport, transport=transport, rounds=2, eval_every=1,
            data=tables["images"], image_size=16, loader_workers=0,
            **{**SETTINGS, "model": "cnn", "batch_size": 4, "tau": 2},
        )  # fmt: skip
        rows = train(cfg, spark=spark).metrics
        assert not any("eval_accuracy" in r for r in rows)
    assert_state_close(
        load_run_model(tmp_path / "allreduce"), load_run_model(tmp_path / "spark"), rtol=1e-5
    )


def test_a_dataframe_run_resumes_bit_for_bit_on_allreduce(spark, tmp_path, tables):
    settings = dict(
        transport="allreduce", data=tables["train"], eval_data=tables["test"], outer="nesterov",
        eval_every=2, checkpoint_every=0, **{**SETTINGS, "tau": 2},
    )  # fmt: skip
    train(TrainConfig(out=tmp_path / "full", rounds=6, **settings), spark=spark)
    part = TrainConfig(out=tmp_path / "part", rounds=3, **settings)
    train(part, spark=spark)
    resumed = load_train_config(
        base=read_run_config(part.out), flags={"rounds": 6, "transport": "allreduce"}, environ={}
    )
    result = train(resumed, resume=True, spark=spark)
    assert [r["round"] for r in result.metrics] == [1, 2, 3, 4, 5, 6]
    assert all(r["inner_state_misses"] == 0 for r in result.metrics)
    assert filecmp.cmp(
        tmp_path / "full/model.safetensors", tmp_path / "part/model.safetensors", shallow=False
    )


def test_a_rank_that_dies_restarts_from_the_checkpoint_with_the_same_rows(spark, tmp_path, tables):
    """The drill kills worker 1's process in round 3: the stage runs again from round 2's
    checkpoint, rank 1 gets its partition again (the shuffle's output is kept), and the run
    ends with the model of a run without the death."""
    clean = TrainConfig(
        out=tmp_path / "clean", transport="allreduce", rounds=5, checkpoint_every=2,
        data=tables["train"], **SETTINGS,
    )  # fmt: skip
    train(clean, spark=spark)
    warned: list[str] = []
    drill = clean.model_copy(update={"out": str(tmp_path / "drill"), "fail_once": "2:1"})
    train(drill, spark=spark, on_warning=warned.append)
    assert len(warned) == 1 and "running it again from round 2" in warned[0], warned
    assert [r["round"] for r in read_metrics(tmp_path / "drill")] == [1, 2, 3, 4, 5]
    assert_state_equal(load_run_model(tmp_path / "drill"), load_run_model(tmp_path / "clean"))


def test_compress_takes_a_dataframe(spark, tmp_path, tables):
    base = dict(rounds=2, data=tables["train"], **SETTINGS)
    train(TrainConfig(out=tmp_path / "full", transport="allreduce", **base), spark=spark)
    train(TrainConfig(out=tmp_path / "bf16", compress="bf16", **base), spark=spark)
    assert _transport(tmp_path / "bf16") == "allreduce"
    got, want = load_run_model(tmp_path / "bf16"), load_run_model(tmp_path / "full")
    assert any(not (got[k] == want[k]).all() for k in want)
    assert_state_close(got, want, rtol=0.05, atol=2e-3)
