"""`SparknetModel`: a finished run as a Spark ML Transformer.

`transform(df)` adds the class index (`prediction`, a double as Spark ML's classifiers give it,
so `MulticlassClassificationEvaluator` and `IndexToString` take it), the class probabilities
(`probability`, a vector) and, with `topK`, the k likeliest classes, computed on the executors
(`predict.py`). A model comes from `SparknetEstimator.fit`, or from any finished run dir, local or
`s3://` (`SparknetModel.from_run`), with no training.

Saved (alone or in a `PipelineModel`) it holds its own copy of the model: the Params as Spark ML
writes them (`metadata/`) and `model.json` with the weights in one Parquet row (`data/`, as
Spark ML's own models keep their data), so a saved pipeline loads where the run dir is gone.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator

from pyspark.ml import Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasInputCol, HasPredictionCol, HasProbabilityCol
from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from sparknet.errors import SparknetError, first_line
from sparknet.ml.predict import (
    PREDICTION,
    PROBABILITY,
    TOP_K,
    checked_column,
    column_input,
    prediction_udf,
)
from sparknet.training.saved_model import ModelInfo, SavedModel

#: the devices a transform runs on (the `device` setting's words)
DEVICES = ("auto", "cpu", "cuda")
#: the struct column the UDF fills, spread into the output columns and dropped
_STRUCT = "_sparknet_prediction"


def add_setter(cls: type, name: str) -> None:
    """`cls.setName(value)` for the Param `name`, as every Spark ML stage has for its own
    (`setPredictionCol`, `setLr` for `lr`, `setBatchSize` for `batch_size`)."""
    words = name.split("_")
    method = "set" + "".join(w[:1].upper() + w[1:] for w in words)

    def setter(self, value):
        return self._set(**{name: value})

    setter.__name__ = method
    setter.__doc__ = f"Sets the value of :py:attr:`{name}`."
    setattr(cls, method, setter)


def check_names(stage: Params, params: dict[str, object], aliases: dict[str, str]) -> None:
    """One line for a keyword that is no Param of `stage`, with the Param it likely meant
    (`aliases`: names it may be given in `sparknet.fit`'s spelling, as `out` for `runsDir`)."""
    for name in params:
        if stage.hasParam(name):
            continue
        meant = aliases.get(name)
        if meant is None:
            close = difflib.get_close_matches(name, [p.name for p in stage.params], n=1)
            meant = close[0] if close else None
        hint = f" (did you mean {meant}?)" if meant else ""
        raise SparknetError(f"{type(stage).__name__} has no Param {name!r}{hint}")


class HasModelOutputs(HasPredictionCol, HasProbabilityCol):
    """The output columns a model adds; the estimator declares them too, for its model."""

    topK: Param[int] = Param(
        Params._dummy(), "topK",
        "also add the indices of the k likeliest classes, likeliest first (0: no such column)",
        typeConverter=TypeConverters.toInt,
    )  # fmt: skip
    topKCol: Param[str] = Param(
        Params._dummy(), "topKCol", "the top-k column's name", typeConverter=TypeConverters.toString
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(topK=0, topKCol="topK")

    def setPredictionCol(self, value: str):
        return self._set(predictionCol=value)

    def setProbabilityCol(self, value: str):
        return self._set(probabilityCol=value)

    def output_params(self) -> dict[str, object]:
        names = ("predictionCol", "probabilityCol", "topK", "topKCol")
        return {n: self.getOrDefault(n) for n in names}


class SparknetModel(Model, HasInputCol, HasModelOutputs, MLWritable, MLReadable):
    """A trained sparknet model that adds predictions to a DataFrame.

    Its input column holds encoded images (binary) for a model trained on images, else numbers
    (arrays or Spark ML vectors) that reshape to the model's input; default `image` or
    `features` as the model takes. Example::

        model = SparknetModel.from_run("s3://bucket/runs/resnet50", topK=5)
        model.transform(spark.read.format("binaryFile").load("s3a://bucket/new/")
                        .withColumnRenamed("content", "image"))
    """

    runDir: Param[str] = Param(
        Params._dummy(), "runDir", "the run dir the model came from (a local path or s3:// URI)",
        typeConverter=TypeConverters.toString,
    )  # fmt: skip
    batchSize: Param[int] = Param(
        Params._dummy(), "batchSize", "rows a forward pass takes at once on an executor",
        typeConverter=TypeConverters.toInt,
    )  # fmt: skip
    device: Param[str] = Param(
        Params._dummy(), "device", "auto (the GPU Spark gave the task, else the CPU), cpu, cuda",
        typeConverter=TypeConverters.toString,
    )  # fmt: skip

    def __init__(self, **params: object) -> None:
        super().__init__()
        self._setDefault(batchSize=64, device="auto")
        self._saved: SavedModel | None = None
        check_names(self, params, {"input_col": "inputCol", "top_k": "topK"})
        self._set(**params)

    @classmethod
    def from_run(cls, run: str, endpoint_url: str | None = None, **params: object) -> SparknetModel:
        """The model of a finished run dir (local or `s3://`), read on the driver now; one line
        where the dir holds none."""
        saved = SavedModel.read(run, endpoint_url)
        saved.build()  # a model its weights do not fit is refused here, not in every task
        model = cls(runDir=str(run), **params)
        model._saved = saved
        return model

    @property
    def info(self) -> ModelInfo:
        """What the model takes and gives: its name, input, number of classes and their names."""
        return self._model().info

    @property
    def saved(self) -> SavedModel:
        """The model as data: `model.json` and the weights' bytes."""
        return self._model()

    def module(self):
        """The `torch.nn.Module` with the model's weights, in eval mode on the CPU."""
        return self._model().build()

    def _model(self) -> SavedModel:
        if self._saved is None:
            if not self.isDefined(self.runDir):
                raise SparknetError(
                    "this SparknetModel has no model: make it with SparknetModel.from_run(RUN) "
                    "or SparknetEstimator.fit(df)"
                )
            saved = SavedModel.read(self.getOrDefault(self.runDir))
            saved.build()  # as from_run
            self._saved = saved
        return self._saved

    def _transform(self, dataset):
        from pyspark.ml.functions import array_to_vector  # lazy: a JVM function
        from pyspark.sql import functions as F  # lazy: pyspark

        saved = self._model()
        outputs = self._checked_outputs(dataset, saved.info)
        default = "image" if saved.info.input.kind == "image" else "features"
        column = self.getOrDefault(self.inputCol) if self.isDefined(self.inputCol) else default
        inp = column_input(dataset, column, saved.info, saved.where)
        top_k = self.getOrDefault(self.topK)
        udf = prediction_udf(
            saved, inp, top_k=top_k, batch_size=self.getOrDefault(self.batchSize),
            device=self.getOrDefault(self.device),
        )  # fmt: skip
        struct = F.col(_STRUCT)
        out = dataset.withColumn(_STRUCT, udf(checked_column(inp, saved.where)))
        out = out.withColumn(outputs[PREDICTION], struct[PREDICTION]).withColumn(
            outputs[PROBABILITY], array_to_vector(struct[PROBABILITY])
        )
        if top_k:
            out = out.withColumn(outputs[TOP_K], struct[TOP_K])
        return out.drop(_STRUCT)

    def _checked_outputs(self, dataset, info: ModelInfo) -> dict[str, str]:
        """The output columns by role; one line for a setting no transform could run with."""
        top_k, batch = self.getOrDefault(self.topK), self.getOrDefault(self.batchSize)
        if not 0 <= top_k <= info.num_classes:
            raise SparknetError(
                f"topK={top_k}, but the model has {info.num_classes} classes: set topK from 0 "
                f"(no column) to {info.num_classes}"
            )
        if batch < 1:
            raise SparknetError(f"batchSize={batch}: set it to 1 or more rows")
        device = self.getOrDefault(self.device)
        if device not in DEVICES:
            raise SparknetError(f"device={device!r}: set it to one of {', '.join(DEVICES)}")
        master = dataset.sparkSession.sparkContext.master
        if device == "cuda" and master.startswith("local") and not _cuda():
            raise SparknetError(
                f"device='cuda', but torch sees no GPU on this machine ({master}): set device "
                "to auto or cpu"
            )
        outputs = {PREDICTION: self.getPredictionCol(), PROBABILITY: self.getProbabilityCol()}
        if top_k:
            outputs[TOP_K] = self.getOrDefault(self.topKCol)
        params = {PREDICTION: "predictionCol", PROBABILITY: "probabilityCol", TOP_K: "topKCol"}
        # Spark matches names without regard to case (spark.sql.caseSensitive is off)
        have = {c.lower(): c for c in dataset.columns}
        if _STRUCT.lower() in have:
            raise SparknetError(f"the DataFrame has a column {_STRUCT!r}, a name sparknet uses")
        for role, name in outputs.items():
            if not name.strip():
                raise SparknetError(f"{params[role]} is empty: name the column")
            if name.lower() in have:
                raise SparknetError(
                    f"the DataFrame already has a column {have[name.lower()]!r}; set "
                    f"{params[role]} to another name (or drop the column)"
                )
        if len({n.lower() for n in outputs.values()}) < len(outputs):
            raise SparknetError(f"two output columns share a name ({outputs}); name each apart")
        return outputs

    def write(self) -> MLWriter:
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _ModelReader(cls)


class _ModelWriter(MLWriter):
    """Params as Spark ML writes them, and the model itself as one Parquet row."""

    def __init__(self, instance: SparknetModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        saved = self.instance._model()
        jvm = self.sc._jvm
        where = jvm.org.apache.hadoop.fs.Path(path)
        if where.getFileSystem(self.sc._jsc.hadoopConfiguration()).exists(where):
            raise SparknetError(f"{path} exists: save with model.write().overwrite().save(...)")
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        row = [(saved.info_json(), bytearray(saved.weights))]
        frame = self.sparkSession.createDataFrame(row, "model string, weights binary")
        frame.coalesce(1).write.parquet(f"{path}/data")


class _ModelReader(MLReader):
    def __init__(self, cls: type[SparknetModel]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> SparknetModel:
        """The saved model; one line where `path` is no saved SparknetModel or is damaged."""
        with saved_stage(path, SparknetModel, self.sparkSession) as metadata:
            model = self.cls()
            model._resetUid(metadata["uid"])
            DefaultParamsReader.getAndSetParams(model, metadata)
            rows = self.sparkSession.read.parquet(f"{path}/data").collect()
            if len(rows) != 1 or not {"model", "weights"} <= set(rows[0].asDict()):
                raise SparknetError(f"{path}/data is not one saved model: save it again")
            saved = SavedModel.of(rows[0].model, bytes(rows[0].weights), path)
        saved.build()  # weights that do not fit are refused here, not in every task
        model._saved = saved
        return model


@contextlib.contextmanager
def saved_stage(path: str, stage: type, spark) -> Iterator[dict]:
    """The Spark ML metadata of a stage saved at `path`, for the block that loads it: one
    line where `path` holds another stage, or is damaged (Spark's and Python's many words
    for a missing file, a schema, a param that is none, made one)."""
    try:
        metadata = DefaultParamsReader.loadMetadata(path, spark)
        made, wanted = metadata.get("class"), f"{stage.__module__}.{stage.__name__}"
        if made != wanted:
            raise SparknetError(f"{path} holds a {made}, not a {stage.__name__}")
        yield metadata
    except SparknetError:
        raise
    except Exception as exc:
        raise SparknetError(
            f"{path} is not a saved {stage.__name__}, or is damaged: {first_line(exc)}"
        ) from exc


def _cuda() -> bool:
    import torch  # lazy: torch is imported where a model is built

    return torch.cuda.is_available()


for _name in ("inputCol", "topK", "topKCol", "batchSize", "device", "runDir"):
    add_setter(SparknetModel, _name)
