"""`sparknet.fit` on DataFrames: both frames checked before any training job, in one line that
names `fit()` arguments; integral float labels (StringIndexer's) train. Real local Spark."""

from __future__ import annotations

import logging

import pytest

import sparknet
from sparknet.errors import SparknetError
from sparknet.training.report import read_metrics

pytestmark = pytest.mark.integration

ROWS = [([float(i % 3), 1.0, 0.5, float(i % 2)], i % 2) for i in range(24)]
SMALL = {"model": "mlp", "workers": 2, "tau": 1, "batch_size": 4, "rounds": 1}


def _frame(spark, rows, schema="features array<float>, label int"):
    return spark.createDataFrame(rows, schema)


def test_fit_twice_in_one_process_with_float_labels(spark, tmp_path):
    doubles = _frame(spark, [(x, float(y)) for x, y in ROWS], "features array<float>, label double")
    first = sparknet.fit(doubles, eval_df=doubles, out=tmp_path / "a", **SMALL)
    second = sparknet.fit(_frame(spark, ROWS), out=tmp_path / "b", **SMALL)
    assert first.final["eval_samples"] == len(ROWS)
    assert [r["round"] for r in read_metrics(tmp_path / "b")] == [1] == [second.rounds]
    assert not spark.sparkContext._jsc.getPersistentRDDs()


@pytest.mark.parametrize(
    ("train_rows", "eval_rows", "eval_schema", "message"),
    [
        (ROWS, [(x, str(y)) for x, y in ROWS], "features array<float>, label string",
         "eval_df: label column 'label' is string; it must hold class indices (integers, or "
         "integral floats as StringIndexer makes)"),
        (ROWS, [(x[:3], y) for x, y in ROWS], None,
         "eval_df: feature arrays in 'features' hold 3 values, the training frame's 4"),
        (ROWS, [(x, y + 5) for x, y in ROWS], None,
         "eval_df: label 6 is out of range for the 2 classes of the DataFrame"),
        (ROWS, [(y,) for _x, y in ROWS], "label int",
         "eval_df has no column 'features' (it has: label); set input_col="),
        ([([None, 1.0, 0.5, 0.0], 1), *ROWS[1:]], None, None,
         "the DataFrame: 1 feature arrays in 'features' hold null or NaN elements; fill or drop "
         "them"),
        ([(x, y + 0.5) for x, y in ROWS], None, "features array<float>, label double",
         "the DataFrame: 24 labels in 'label' are not whole numbers; labels are class indices"),
    ],
    ids=["string-labels", "short-arrays", "label-range", "no-column", "null-element",
         "half-labels"],
)  # fmt: skip
def test_bad_frames_fail_before_training_naming_fit_arguments(
    spark, tmp_path, train_rows, eval_rows, eval_schema, message
):
    schema = "features array<float>, label int"
    train_schema = eval_schema if eval_rows is None and eval_schema else schema
    df = _frame(spark, train_rows, train_schema)
    eval_df = _frame(spark, eval_rows, eval_schema or schema) if eval_rows is not None else None
    with pytest.raises(SparknetError) as exc:
        sparknet.fit(df, eval_df=eval_df, out=tmp_path / "run", **SMALL)
    assert str(exc.value) == message
    assert not (tmp_path / "run").exists()
    assert not spark.sparkContext._jsc.getPersistentRDDs()


def test_fit_resume_continues_from_the_stored_settings_and_says_which_round(spark, tmp_path):
    from sparknet.config import load_train_config
    from sparknet.training.driver import train
    from sparknet.training.problem import FrameInput
    from sparknet.training.rundir import read_run_config

    df, out = _frame(spark, ROWS), tmp_path / "run"
    sparknet.fit(df, out=out, **{**SMALL, "tau": 2})
    # tau is not passed again: the run's own tau 2 is the base, not the default 10
    result = sparknet.fit(df, out=out, resume=True, rounds=2)
    assert [r["round"] for r in result.metrics] == [1, 2]
    assert "resumed_with_changes" not in result.metrics[1]

    events: list = []
    cfg = load_train_config(base=read_run_config(out), flags={"rounds": 3}, environ={})
    train(
        cfg, resume=True, spark=spark, frames=FrameInput(df),
        on_start=lambda done, total: events.append(("start", done, total)),
        on_status=lambda text: events.append(("status", text)),
    )  # fmt: skip
    assert events == [("start", 2, 3), ("status", "starting Python workers")]


def test_fit_logs_a_line_a_round_and_keeps_sparks_log_at_warn_meanwhile(spark, tmp_path, caplog):
    """Spark's INFO lines (a few per task) would bury the round lines: WARN while fit runs,
    the user's level again after; a level asked for is used as given, a wrong one refused."""
    sc = spark.sparkContext
    root = sc._jvm.org.apache.logging.log4j.LogManager.getRootLogger()
    before = str(root.getLevel().toString())
    seen: list[tuple[int, str]] = []

    def on_round(row):
        seen.append((row["round"], str(root.getLevel().toString())))

    caplog.set_level(logging.INFO, logger="sparknet")
    try:
        sc.setLogLevel("INFO")
        sparknet.fit(_frame(spark, ROWS), out=tmp_path / "a", on_round=on_round,
                     **{**SMALL, "rounds": 2})  # fmt: skip
        assert seen == [(1, "WARN"), (2, "WARN")]
        assert str(root.getLevel().toString()) == "INFO"
        lines = [r.getMessage() for r in caplog.records if r.name == "sparknet"]
        rounds = [line for line in lines if line.startswith("round ")]
        assert [line.split("  ")[0] for line in rounds] == ["round 1/2", "round 2/2"]
        assert all(" samples/s  " in line and line.endswith(" s") for line in rounds)

        seen.clear()
        sparknet.fit(_frame(spark, ROWS), out=tmp_path / "b", on_round=on_round,
                     spark_log_level="error", **SMALL)  # fmt: skip
        assert seen == [(1, "ERROR")]
        assert str(root.getLevel().toString()) == "INFO"
        with pytest.raises(SparknetError, match=r"^spark_log_level 'LOUD' is not a log level"):
            sparknet.fit(_frame(spark, ROWS), out=tmp_path / "c", spark_log_level="LOUD", **SMALL)
        assert not (tmp_path / "c").exists()

        class Enough(Exception):
            pass

        def stop(row):
            if row["round"] == 2:
                raise Enough

        with pytest.raises(Enough):  # the caller's own exception, as raised
            sparknet.fit(_frame(spark, ROWS), out=tmp_path / "d", on_round=stop,
                         **{**SMALL, "rounds": 3, "checkpoint_every": 1})  # fmt: skip
        assert str(root.getLevel().toString()) == "INFO"
        sparknet.fit(_frame(spark, ROWS), out=tmp_path / "d", resume=True)
        assert [r["round"] for r in read_metrics(tmp_path / "d")] == [1, 2, 3]
    finally:
        sc.setLogLevel(before)
