"""`sparknet.fit(df, ...)`: train on a Spark DataFrame from Python, the paper's promise.

The frame stays in Spark: its rows reach the tasks as Arrow batches (see `data/frames.py`),
so data from SQL, a table or any query trains with no copy to another system.
"""

from __future__ import annotations

from typing import Any

from sparknet.config import load_train_config
from sparknet.training.driver import FrameInput, RunResult, train


def fit(
    df,
    *,
    label_col: str = "label",
    input_col: str | None = None,
    eval_df=None,
    feature_shape: tuple[int, ...] | None = None,
    resume: bool = False,
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
        settings: any `sparknet train` setting (`workers`, `tau`, `rounds`, `lr`, ...).

    Runs on `df`'s own Spark session, which it leaves running. Example::

        result = sparknet.fit(spark.read.parquet("s3://b/features"), model="mlp", workers=4)
        print(result.final["eval_accuracy"])
    """
    flags = {**settings, "label_col": label_col, "input_col": input_col, "data": "dataframe"}
    cfg = load_train_config(flags=flags, environ={})
    frames = FrameInput(df, eval_df, feature_shape)
    return train(cfg, resume=resume, spark=df.sparkSession, frames=frames)
