"""`sparknet.fit(df, ...)`: train on a Spark DataFrame from Python, the paper's promise.

The frame stays in Spark: its rows reach the tasks as Arrow batches (see `data/frames.py`),
so data from SQL, a table or any query trains with no copy to another system.
"""

from __future__ import annotations

import re
from typing import Any

from pyspark.sql import DataFrame

from sparknet.config import load_train_config
from sparknet.errors import SparknetError
from sparknet.training.driver import RunResult, train
from sparknet.training.problem import FrameInput
from sparknet.training.rundir import read_run_config

#: a CLI flag in a message, and the value that follows it (a number, a path, a placeholder)
_FLAG = re.compile(r"--([a-z][a-z0-9-]*)(?: ([0-9/.~'][^\s;:,]*|[A-Z]+\b))?")
_SWITCHES = {"resume", "allow-change"}
#: flags whose values are words (`--transport spark`): `_FLAG` takes only values that cannot be
#: prose, so these are spelt first, as `transport='spark'`
_WORD_FLAG = re.compile(
    r"--(transport|compress|outer|optimizer|precision|inner-state|device) ([a-z][a-z0-9]*)\b"
)
#: a path flag and its value up to the colon that ends it (`--out runs/a: ...`); an s3:// URI's
#: own colon is not followed by a space
_PATH_FLAG = re.compile(r"--(out) (\S+?):(?=\s|$)")


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
            cfg, resume=resume, spark=df.sparkSession, frames=frames, allow_change=allow_change
        )
    except SparknetError as exc:
        raise SparknetError(as_fit_arguments(str(exc))) from exc


def _check_frame(frame: Any, name: str) -> None:
    """A pandas frame (or anything else) would fail deep inside with an AttributeError."""
    if not isinstance(frame, DataFrame):
        kind = f"{type(frame).__module__}.{type(frame).__qualname__}"
        raise SparknetError(
            f"fit() needs a pyspark DataFrame as {name}, got {kind}; convert it with "
            "spark.createDataFrame(...) first"
        )


def as_fit_arguments(message: str) -> str:
    """The message with every CLI flag spelt as the `fit()` argument it is (`--label-col` ->
    `label_col=`, `--workers 5` -> `workers=5`, `--resume` -> `resume=True`, `--out PATH:` ->
    `out='PATH':`), and the CLI's help as `help(sparknet.fit)`."""
    message = message.replace("`sparknet train --help`", "help(sparknet.fit)")
    message = _PATH_FLAG.sub(lambda m: f"{m.group(1)}={m.group(2)!r}:", message)

    def spell(m: re.Match) -> str:
        name = m.group(1)
        if name in _SWITCHES:
            arg = f"{name.replace('-', '_')}=True"
            return f"{arg} {m.group(2)}" if m.group(2) else arg
        return f"{name.replace('-', '_')}={m.group(2) or ''}"

    message = _WORD_FLAG.sub(lambda m: f"{m.group(1).replace('-', '_')}={m.group(2)!r}", message)
    return _FLAG.sub(spell, message)
