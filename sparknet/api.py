"""`sparknet.fit(df, ...)`: train on a Spark DataFrame from Python, the paper's promise.

The frame stays in Spark: its rows reach the tasks as Arrow batches (see `data/frames.py`),
so data from SQL, a table or any query trains with no copy to another system.

It says what it does as the CLI does, through `logging` (the `sparknet` logger), so a
notebook's cell and a `spark-submit` job's log both show a line a round; Spark's own log is
kept at WARN meanwhile (under `spark-submit` its INFO lines, a few per task, bury them).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pyspark.sql import DataFrame

from sparknet.config import TrainConfig, load_train_config
from sparknet.errors import SparknetError, as_keyword, worded
from sparknet.training.driver import RunResult, train
from sparknet.training.problem import FrameInput
from sparknet.training.round_line import round_line
from sparknet.training.rundir import read_run_config

#: where `fit` says what it does: a line a round, and what it waits for before the first
log = logging.getLogger("sparknet")

#: log4j's levels, most verbose first, as `SparkContext.setLogLevel` takes them
SPARK_LOG_LEVELS = ("ALL", "TRACE", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF")


def fit(
    df,
    *,
    label_col: str = "label",
    input_col: str | None = None,
    eval_df=None,
    feature_shape: tuple[int, ...] | None = None,
    resume: bool = False,
    allow_change: bool = False,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    spark_log_level: str | None = None,
    **settings: Any,
) -> RunResult:
    """Train `settings["model"]` (default `cnn`) on `df` with synchronized local SGD.

    Args:
        df: a pyspark DataFrame with a label column of class indices and an input column of
            encoded images (binary), fixed-length numeric arrays or Spark ML vectors.
        label_col: the label column.
        input_col: the input column; default `image` or `features`, whichever `df` has.
        eval_df: a frame of the same columns to report test loss, top-1 and top-5 on.
        feature_shape: the shape each feature array is reshaped to (default: flat).
        resume: continue the run in `settings["out"]` from its last checkpoint.
        allow_change: with `resume`, accept settings that change the weights (`workers`, `lr`,
            ...); recorded in metrics.jsonl.
        on_round: called with each round's metrics.jsonl row as the round ends (to stop
            early, raise from it: the run keeps its last checkpoint).
        spark_log_level: Spark's log level while `fit` runs, put back after (default: WARN
            where it is more verbose, so Spark's INFO lines do not bury the round lines).
        settings: any `sparknet train` setting (`workers`, `tau`, `rounds`, `lr`, ...).

    Runs on `df`'s own Spark session, which it leaves running. Example::

        result = sparknet.fit(spark.read.parquet("s3://b/features"), model="mlp", workers=4)
        print(result.final["eval_accuracy"])
    """
    flags = {**settings, "label_col": label_col, "input_col": input_col, "data": "dataframe"}
    try:
        _check_keywords(settings)
        _check_log_level(spark_log_level)
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
        _shown(log)
        with _spark_log_at(df.sparkSession.sparkContext, spark_log_level):
            return train(
                cfg, resume=resume, spark=df.sparkSession, frames=frames,
                allow_change=allow_change, on_warning=_warn, on_status=log.info,
                on_round=_reporting(cfg.rounds, on_round),
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


def _check_log_level(level: str | None) -> None:
    if level is not None and level.upper() not in SPARK_LOG_LEVELS:
        raise SparknetError(
            f"spark_log_level {level!r} is not a log level; use one of "
            f"{', '.join(SPARK_LOG_LEVELS)} (or leave it out: WARN)"
        )


def _reporting(
    rounds: int, on_round: Callable[[dict[str, Any]], None] | None
) -> Callable[[dict[str, Any]], None]:
    """A round's line to the logger, then the caller's callback with the row."""

    def report(row: dict[str, Any]) -> None:
        log.info(round_line(row, rounds))
        if on_round is not None:
            on_round(row)

    return report


class _FitHandler(logging.StreamHandler):
    """The handler `fit` gives its logger where nothing else would show its lines."""


def _shown(logger: logging.Logger) -> None:
    """Make `fit`'s INFO lines reach the user where logging was never set up (a notebook, a
    plain script under spark-submit: no handler anywhere, so Python shows only warnings): a
    handler on stderr, once. Logging that the user set up (a root handler, one of their own
    on this logger) is theirs: ours is then taken away, so no line shows twice."""
    ours = [h for h in logger.handlers if isinstance(h, _FitHandler)]
    theirs = logging.getLogger().handlers or [h for h in logger.handlers if h not in ours]
    if theirs:
        for handler in ours:
            logger.removeHandler(handler)
        return
    if not ours:
        handler = _FitHandler()  # stderr
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


@contextlib.contextmanager
def _spark_log_at(sc, level: str | None) -> Iterator[None]:
    """Spark's driver log at `level` (None: WARN, where it is more verbose) while the block
    runs, put back after. The user's session: its level is theirs once `fit` returns."""
    root = sc._jvm.org.apache.logging.log4j.LogManager.getRootLogger()
    before = str(root.getLevel().toString()).upper()
    if level is None:
        verbose = SPARK_LOG_LEVELS[: SPARK_LOG_LEVELS.index("WARN")]
        level = "WARN" if before in verbose else None
    if level is None or level.upper() == before:
        yield
        return
    sc.setLogLevel(level.upper())
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a session the run stopped has no JVM to ask
            sc.setLogLevel(before)


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
