"""`SparknetEstimator`: `sparknet.fit` as a Spark ML Estimator, a stage of a `Pipeline`.

Its Params are sparknet's settings, declared once from `TrainConfig` (the same names and
keywords as `sparknet.fit`'s: `workers`, `tau`, `lr`, ...), plus Spark ML's own `labelCol`,
`inputCol` and output columns. Two settings are not Params: `data` (the frame `fit` is given)
and `master` (the frame's own session runs it). `out` becomes `runsDir`: an estimator is fit
again and again (a refit, each fold of a `CrossValidator`), so each fit makes a new run dir
in it, and the model it returns says which (`runDir`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import numpy as np
from pyspark.ml import Estimator
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasInputCol, HasLabelCol
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsReader, DefaultParamsWritable

from sparknet.config import TrainConfig, load_train_config
from sparknet.errors import NO_VALUE, SettingError, SparknetError, as_keyword
from sparknet.ml.model import (
    HasModelOutputs,
    SparknetModel,
    add_setter,
    check_names,
    saved_stage,
)

#: settings that are no Param: see the module's docstring (and `fail_once`, a test drill)
NOT_PARAMS = frozenset({"data", "label_col", "input_col", "out", "master", "fail_once"})
SETTINGS = tuple(name for name in TrainConfig.model_fields if name not in NOT_PARAMS)
#: the settings an error may name that are Spark ML's Params here, by their Param's name
SPARK_NAMES = {"label_col": "labelCol", "input_col": "inputCol", "out": "runsDir"}


def as_param(setting: str, value: Any = NO_VALUE) -> str:
    """The estimator's spelling of a setting in a message: its Param (`labelCol`, `runsDir`
    where `fit` would say `label_col=`, `out=`), else `fit`'s keyword (`tau=`)."""
    name = SPARK_NAMES.get(setting)
    if name is None:
        return as_keyword(setting, value)
    return name if value is NO_VALUE else f"{name}={value!r}"


def plain(value: Any) -> Any:
    """A Param's value as JSON writes it (Spark ML saves Params as JSON): numpy's numbers
    (ParamGridBuilder over `np.arange`) as Python's, a path as text, a tuple as a list."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def _checked(name: str) -> Callable[[Any], Any]:
    """A setting's type converter: the value checked alone as `sparknet.fit` checks it (a
    check across settings waits for `fit`), so a bad value fails where it is set, a
    ParamGridBuilder's or a loaded estimator's too."""
    field = TrainConfig.model_fields[name]

    def convert(value: Any) -> Any:
        value = plain(value)
        if value is None:
            if field.default is None:
                return None
            raise TypeError(f"{name}=None: leave {name} unset for its default")
        if isinstance(value, bool) and field.annotation is not bool:
            raise TypeError(f"{name}={value}: a {name} is not true or false")
        try:
            load_train_config(flags={name: value, "data": "dataframe"}, environ={})
        except SettingError as exc:
            if exc.setting == name:
                raise TypeError(exc.respell(as_param)) from None
        except SparknetError:
            pass  # a check across settings: `fit` makes it with all of them
        return value

    return convert


def _runs_dir(value: Any) -> str:
    value = plain(value)
    if not isinstance(value, str) or not value.strip():
        raise TypeError(f"runsDir={value!r}: name a dir (a local path or s3:// prefix)")
    return value


class _HasSettings(Params):
    """A Param for each sparknet setting, named as the setting; unset ones take the setting's
    own default when `fit` runs."""


for _name in SETTINGS:
    assert not hasattr(_HasSettings, _name), _name  # a setting that would hide a Params member
    _field = TrainConfig.model_fields[_name]
    _param = Param(Params._dummy(), _name, _field.description or _name, _checked(_name))
    setattr(_HasSettings, _name, _param)
    add_setter(_HasSettings, _name)


class SparknetEstimator(
    Estimator, _HasSettings, HasLabelCol, HasInputCol, HasModelOutputs,
    DefaultParamsReadable, DefaultParamsWritable,
):  # fmt: skip
    """Trains a model with synchronized local SGD on the frame it is fit on.

    The input column holds encoded images (binary), numeric arrays, or Spark ML vectors (what
    `VectorAssembler` makes); default `image` or `features`. Example::

        est = SparknetEstimator(model="mlp", workers=4, tau=10, rounds=20, inputCol="vec")
        model = Pipeline(stages=[VectorAssembler(inputCols=cols, outputCol="vec"), est]).fit(df)
        model.transform(test_df).select("prediction", "probability")
    """

    runsDir: Param[str] = Param(
        Params._dummy(), "runsDir",
        "where each fit makes its run dir (a local path or s3:// prefix the executors reach)",
        typeConverter=_runs_dir,
    )  # fmt: skip

    featureShape: Param[list[int]] = Param(
        Params._dummy(), "featureShape",
        "the shape each row's numbers are reshaped to (default: flat), as sparknet.fit's "
        "feature_shape",
        typeConverter=TypeConverters.toListInt,
    )  # fmt: skip

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self._setDefault(labelCol="label", runsDir="runs")
        self.setParams(**params)

    @classmethod
    def read(cls) -> DefaultParamsReader:
        return _EstimatorReader(cls)

    def setParams(self, **params: Any) -> SparknetEstimator:
        """Set Params by name; a name that is none, or a setting value sparknet refuses, is one
        line naming it."""
        check_names(self, params, SPARK_NAMES)
        try:
            self._set(**params)
        except TypeError as exc:  # pyspark's words around the converter's line
            raise SparknetError(str(exc.__cause__ or exc).split(". ", 1)[-1]) from None
        self.settings()  # checked together as they are set, not minutes later in fit
        return self

    def settings(self) -> dict[str, Any]:
        """The settings Params set on this estimator, checked as `sparknet.fit` checks them."""
        chosen = {n: self.getOrDefault(n) for n in SETTINGS if self.isSet(getattr(self, n))}
        for name, value in chosen.items():  # pyspark sets None without the converter
            if value is None and TrainConfig.model_fields[name].default is not None:
                raise SparknetError(f"{name}=None: leave {name} unset for its default")
        try:
            load_train_config(flags={**chosen, "data": "dataframe"}, environ={})
        except SparknetError as exc:
            exc.respell(as_param)
            raise
        return chosen

    def _fit(self, dataset) -> SparknetModel:
        from sparknet.api import fit  # lazy: the training driver

        settings = self.settings()
        input_col = self.getOrDefault(self.inputCol) if self.isDefined(self.inputCol) else None
        model_name = settings.get("model", TrainConfig.model_fields["model"].default)
        shape = self.getOrDefault(self.featureShape) if self.isSet(self.featureShape) else None
        try:
            result = fit(
                dataset, label_col=self.getLabelCol(), input_col=input_col,
                feature_shape=tuple(shape) if shape else None,
                out=self._new_run_dir(model_name), **settings,
            )  # fmt: skip
        except SparknetError as exc:
            exc.respell(as_param)  # the estimator's Params, not fit's keywords
            raise
        outputs = self.output_params()
        if input_col is not None:
            outputs["inputCol"] = input_col
        model = SparknetModel.from_run(str(result.run_dir), settings.get("endpoint_url"), **outputs)
        return model

    def _new_run_dir(self, model: str) -> str:
        """A run dir of its own for this fit: `runsDir/<model>-<time>-<6 hex>`."""
        from sparknet.training.driver import slug  # lazy: the training driver

        root = self.getOrDefault(self.runsDir).rstrip("/")
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        return f"{root}/{slug(model)}-{stamp}-{uuid.uuid4().hex[:6]}"


for _name in ("labelCol", "inputCol", "runsDir", "featureShape"):
    add_setter(SparknetEstimator, _name)


class _EstimatorReader(DefaultParamsReader):
    """Spark ML's reader, but a path that holds another stage is one line, not that stage."""

    def load(self, path: str) -> SparknetEstimator:
        with saved_stage(path, SparknetEstimator, self.sparkSession):
            return super().load(path)
