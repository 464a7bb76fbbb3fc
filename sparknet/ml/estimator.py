"""`SparknetEstimator`: `sparknet.fit` as a Spark ML Estimator, a stage of a `Pipeline`.

Its Params are sparknet's settings, declared once from `TrainConfig` (the same names and
keywords as `sparknet.fit`'s: `workers`, `tau`, `lr`, ...), plus Spark ML's own `labelCol`,
`inputCol` and output columns. Two settings are not Params: `data` (the frame `fit` is given)
and `master` (the frame's own session runs it). `out` becomes `runsDir`: an estimator is fit
again and again (a refit, each fold of a `CrossValidator`), so each fit makes a new run dir
in it, and the model it returns says which (`runDir`).
"""

from __future__ import annotations

import difflib
import os
import uuid
from datetime import datetime
from typing import Any

from pyspark.ml import Estimator
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasInputCol, HasLabelCol
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable

from sparknet.config import TrainConfig, load_train_config
from sparknet.errors import SparknetError, as_keyword
from sparknet.ml.model import HasModelOutputs, SparknetModel

#: settings that are no Param: see the module's docstring (and `fail_once`, a test drill)
NOT_PARAMS = frozenset({"data", "label_col", "input_col", "out", "master", "fail_once"})
SETTINGS = tuple(name for name in TrainConfig.model_fields if name not in NOT_PARAMS)


class _HasSettings(Params):
    """A Param for each sparknet setting, named as the setting; unset ones take the setting's
    own default when `fit` runs."""


for _name in SETTINGS:
    assert not hasattr(_HasSettings, _name), _name  # a setting that would hide a Params member
    _field = TrainConfig.model_fields[_name]
    setattr(_HasSettings, _name, Param(Params._dummy(), _name, _field.description or _name))


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
        typeConverter=TypeConverters.toString,
    )  # fmt: skip

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self._setDefault(labelCol="label", runsDir="runs")
        self.setParams(**params)

    def setParams(self, **params: Any) -> SparknetEstimator:
        """Set Params by name; a name that is none, or a setting value sparknet refuses, is one
        line naming it."""
        for name in params:
            if not self.hasParam(name):
                close = difflib.get_close_matches(name, [p.name for p in self.params], n=1)
                meant = f" (did you mean {close[0]}?)" if close else ""
                raise SparknetError(f"SparknetEstimator has no Param {name!r}{meant}")
        values = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in params.items()}
        self._set(**values)
        self.settings()  # checked as they are set, not minutes later in fit
        return self

    def settings(self) -> dict[str, Any]:
        """The settings Params set on this estimator, checked as `sparknet.fit` checks them."""
        chosen = {n: self.getOrDefault(n) for n in SETTINGS if self.isSet(getattr(self, n))}
        try:
            load_train_config(flags={**chosen, "data": "dataframe"}, environ={})
        except SparknetError as exc:
            exc.respell(as_keyword)
            raise
        return chosen

    def _fit(self, dataset) -> SparknetModel:
        from sparknet.api import fit  # lazy: the training driver

        settings = self.settings()
        input_col = self.getOrDefault(self.inputCol) if self.isDefined(self.inputCol) else None
        result = fit(
            dataset, label_col=self.getLabelCol(), input_col=input_col,
            out=self._new_run_dir(settings.get("model", TrainConfig.model_fields["model"].default)),
            **settings,
        )  # fmt: skip
        outputs = self.output_params()
        if input_col is not None:
            outputs["inputCol"] = input_col
        model = SparknetModel.from_run(str(result.run_dir), settings.get("endpoint_url"), **outputs)
        return model

    def _new_run_dir(self, model: str) -> str:
        """A run dir of its own for this fit: `runsDir/<model>-<time>-<6 hex>`."""
        root = self.getOrDefault(self.runsDir).rstrip("/")
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = "".join(c if c.isalnum() else "_" for c in model.split(":")[-1])
        return f"{root}/{name}-{stamp}-{uuid.uuid4().hex[:6]}"
