"""`sparknet evaluate`: a finished run's model over a whole split on real local Spark gives the
run's own final evaluation, with each class's accuracy and the confusion counts; its report files;
and the refusals before Spark. (Shards on S3 and DataFrames: tests/data/test_imagenet_s3.py.)"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from sparknet.data.sources import digits
from sparknet.errors import SparknetError
from sparknet.training.evaluation import evaluate
from tests.conftest import REPO, SPARKNET

pytestmark = pytest.mark.integration


def test_the_evaluation_is_the_runs_own_final_one_with_each_class(spark, digits_run):
    run, final = digits_run
    ev = evaluate(run, "digits", spark=spark)
    assert (ev.samples, ev.top1, ev.top5) == (
        final["eval_samples"],
        final["eval_accuracy"],
        final["eval_top5"],
    )
    assert ev.loss == pytest.approx(final["eval_loss"], rel=1e-12)
    assert ev.confusion.shape == (10, 10) and ev.confusion.sum() == ev.samples
    assert np.trace(ev.confusion) == round(ev.top1 * ev.samples)
    per_class = ev.per_class()
    assert [c.samples for c in per_class] == [36, 36, 35, 37, 36, 37, 36, 36, 35, 36]
    assert sum(c.correct for c in per_class) == np.trace(ev.confusion)
    # another K splits the test set otherwise: the same samples, the same count right
    other = evaluate(run, "digits", workers=3, spark=spark)
    assert (other.samples, other.top1) == (ev.samples, ev.top1)
    assert np.array_equal(other.confusion, ev.confusion)


def test_a_frame_of_flat_numbers_evaluates_in_the_models_shape(spark, digits_run, tmp_path):
    run, final = digits_run
    inputs, labels = digits()[1].tensors
    rows = [(x.flatten().tolist(), int(y)) for x, y in zip(inputs, labels, strict=True)]
    spark.createDataFrame(rows, "features array<float>, label int").write.parquet(
        str(tmp_path / "test")
    )
    ev = evaluate(run, f"parquet:{tmp_path / 'test'}", spark=spark)
    assert (ev.samples, ev.top1) == (360, final["eval_accuracy"])


def test_a_report_dir_that_cannot_take_it_is_refused_before_spark(digits_run, tmp_path):
    run, _ = digits_run
    (tmp_path / "file").write_bytes(b"")
    done = subprocess.run(
        [str(SPARKNET), "evaluate", str(run), "--data", "digits", "--report",
         str(tmp_path / "file" / "report")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "file" in done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert "starting Spark" not in done.stderr


def test_the_cli_prints_the_figures_and_writes_its_report(digits_run, tmp_path):
    run, final = digits_run
    done = subprocess.run(
        [str(SPARKNET), "evaluate", str(run), "--data", "digits", "--report",
         str(tmp_path / "report")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{final['eval_accuracy']:.4f}" in done.stdout
    report = json.loads((tmp_path / "report" / "evaluation.json").read_text())
    assert report["top1"] == final["eval_accuracy"]
    assert report["samples"] == 360 and len(report["classes"]) == 10
    assert sum(map(sum, report["confusion"])) == 360
    assert (tmp_path / "report" / "confusion.png").read_bytes()[:4] == b"\x89PNG"
    assert not (run / "evaluations").exists()


@pytest.mark.parametrize(
    ("data", "extra", "message"),
    [
        ("digits", {"split": "train"},
         "--split names a split of a shard dataset; digits is not one"),
        ("parquet:/tmp", {"split": "val"},
         "--split names a split of a shard dataset; parquet:/tmp is not one"),
        ("parquet:/nowhere", {}, "parquet:/nowhere: no such file or directory; fix the path"),
        ("no-such-data", {}, "unknown dataset 'no-such-data': use digits, "),
    ],
    ids=["split-of-digits", "split-of-a-frame", "no-frame", "unknown-data"],
)  # fmt: skip
def test_what_cannot_be_evaluated_is_one_line_before_spark(digits_run, data, extra, message):
    run, _ = digits_run
    with pytest.raises(SparknetError) as exc:
        evaluate(run, data, spark=object(), **extra)  # no Spark call is made
    assert str(exc.value).startswith(message)


def test_a_run_without_a_model_is_one_line(tmp_path):
    with pytest.raises(SparknetError, match=f"^{tmp_path} has no model.json: it is not a"):
        evaluate(tmp_path, "digits", spark=object())
