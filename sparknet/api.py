"""`sparknet.fit(df, ...)`: train on a Spark DataFrame from Python, the paper's promise.

The frame stays in Spark: its rows reach the tasks as Arrow batches (see `data/frames.py`),
so data from SQL, a table or any query trains with no copy to another system.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

from pyspark.sql import DataFrame

from sparknet.config import TrainConfig, load_train_config
from sparknet.errors import SparknetError, as_keyword, worded
from sparknet.training.driver import RunResult, train
from sparknet.training.problem import FrameInput
from sparknet.training.rundir import read_run_config


def fit(
    df,
    *,
    label_col: str = "label",
    input_col: str | None = None,
    eval_df=None,
    feature_shape: tuple[int, ...] | None = None,
    resume: bool = False,
    allow_change: bool = False,
    **settings: Any,
) -> RunResult:
    """Train `settings["model"]` (default `cnn`) on `df` with synchronized local SGD.

    Args:
        df: a pyspark DataFrame with a label column of class indices and an input column of
            encoded images (binary) or fixed-length numeric arrays.
        label_col: the label column.
        input_col: the input column; default `image` or `features`, whichever `df` has.
        eval_df: a frame of the same columns to report test loss, top-1 and top-5 on.
        feature_shape: the shape each feature array is reshaped to (default: flat).
        resume: continue the run in `settings["out"]` from its last checkpoint.
        allow_change: with `resume`, accept settings that change the weights (`workers`, `lr`,
            ...); recorded in metrics.jsonl.
        settings: any `sparknet train` setting (`workers`, `tau`, `rounds`, `lr`, ...).

    Runs on `df`'s own Spark session, which it leaves running. Example::

        result = sparknet.fit(spark.read.parquet("s3://b/features"), model="mlp", workers=4)
        print(result.final["eval_accuracy"])
    """
    flags = {**settings, "label_col": label_col, "input_col": input_col, "data": "dataframe"}
    try:
        _check_keywords(settings)
        out = settings.get("out")
        base = (
            read_run_config(str(out), settings.get("endpoint_url"))
            if resume and out is not None
            else None
        )
        cfg = load_train_config(flags=flags, environ={}, base=base)
        _check_frame(df, "df")
        if eval_df is not None:
            _check_frame(eval_df, "eval_df")
        frames = FrameInput(df, eval_df, feature_shape)
        return train(
            cfg, resume=resume, spark=df.sparkSession, frames=frames, allow_change=allow_change,
            on_warning=_warn,
        )  # fmt: skip
    except SparknetError as exc:
        exc.respell(as_keyword)  # the same error, its settings written as this function's keywords
        raise


def _check_keywords(settings: Mapping[str, Any]) -> None:
    """A keyword that is no setting, named with the keyword it most likely meant: a setting
    (`TrainConfig`'s fields) or one of `fit()`'s own arguments."""
    own = [p for p in inspect.signature(fit).parameters if p not in ("df", "settings")]
    for name in settings:
        if name not in TrainConfig.model_fields:
            close = difflib.get_close_matches(name, [*TrainConfig.model_fields, *own], n=1)
            meant = f" (did you mean {{@{close[0]}}}?)" if close else ""
            raise SparknetError(
                "unknown setting '{name}'" + meant + "; see {@help} for the settings", name=name
            )


def _warn(line: str) -> None:
    """`fit()` has no callback: a run's warning is a Python warning, its settings spelt as this
    function's keywords."""
    warnings.warn(worded(line, as_keyword), RuntimeWarning, stacklevel=2)


def _check_frame(frame: Any, name: str) -> None:
    """A pandas frame (or anything else) would fail deep inside with an AttributeError."""
    if not isinstance(frame, DataFrame):
        kind = f"{type(frame).__module__}.{type(frame).__qualname__}"
        raise SparknetError(
            f"fit() needs a pyspark DataFrame as {name}, got {kind}; convert it with "
            "spark.createDataFrame(...) first"
        )
