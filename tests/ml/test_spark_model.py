"""Spark ML stages on real local Spark: a Pipeline with a feature stage and `SparknetEstimator`
fits, transforms (predictions equal a plain PyTorch forward pass of the same weights on the same
inputs), saves and loads as a whole after its run dir is gone; a saved, loaded and refit
estimator gives the same weights; a model made from a run dir without training; images decoded
as the run's evaluation decodes them; and the refusals, one line each."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.linalg import VectorUDT
from safetensors.torch import load_file

import sparknet
from sparknet.data.decode import EvalDecoder, normalize
from sparknet.errors import SparknetError
from sparknet.ml import SparknetEstimator, SparknetModel

pytestmark = pytest.mark.integration

SMALL = {"model": "mlp", "workers": 2, "tau": 5, "rounds": 3, "batch_size": 8, "lr": 0.1,
         "eval_every": 0, "checkpoint_every": 0, "seed": 3}  # fmt: skip


def _blobs(spark, n: int, seed: int):
    """Three classes of 4 numbers around three centres, as four double columns and a label."""
    rng = np.random.default_rng(seed)
    centres = np.array([[2, 0, 0, 1], [0, 2, 0, -1], [0, 0, 2, 0]], dtype=float)
    labels = rng.integers(0, 3, n)
    x = centres[labels] + rng.normal(0, 0.7, (n, 4))
    rows = [(*map(float, xi), int(y)) for xi, y in zip(x, labels, strict=True)]
    return spark.createDataFrame(rows, "a double, b double, c double, d double, label int")


def _forward(module: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return module(torch.as_tensor(x, dtype=torch.float32)).softmax(1)


def _outputs(frame, *cols) -> list[np.ndarray]:
    """Each column as an array (a vector or array column: one row a row)."""
    rows = frame.select(*cols).collect()
    return [np.array([r[c] for r in rows]) for c in cols]


def test_a_pipeline_fits_transforms_as_torch_does_and_loads_without_its_run_dir(spark, tmp_path):
    train_df, test_df = _blobs(spark, 96, 0), _blobs(spark, 40, 1)
    stages = [
        VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="vec"),
        SparknetEstimator(inputCol="vec", topK=2, runsDir=str(tmp_path / "runs"), **SMALL),
    ]
    fitted = Pipeline(stages=stages).fit(train_df)
    model = fitted.stages[-1]
    assert isinstance(model, SparknetModel)
    run = model.getOrDefault("runDir")
    assert run.startswith(str(tmp_path / "runs") + "/mlp-")
    assert model.info.input.kind == "features" and model.info.input.shape == (4,)

    out = fitted.transform(test_df)
    assert out.schema["prediction"].dataType.simpleString() == "double"
    assert isinstance(out.schema["probability"].dataType, VectorUDT)
    feats, pred, prob, top = _outputs(out, "vec", "prediction", "probability", "topK")
    want = _forward(sparknet.load_model(run), feats)
    assert np.array_equal(pred, want.argmax(1).numpy().astype(float))
    assert np.allclose(prob, want.numpy(), atol=1e-6)
    assert np.array_equal(np.stack(top), want.topk(2, dim=1).indices.numpy())
    labels = np.array([r.label for r in test_df.select("label").collect()])
    assert (pred == labels).mean() > 0.8  # trained: chance is 1/3

    fitted.write().save(str(tmp_path / "pipeline"))
    shutil.rmtree(run)  # the saved pipeline holds its own copy of the model
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    again = _outputs(loaded.transform(test_df), "prediction", "probability", "topK")
    assert np.array_equal(again[0], pred)
    assert np.array_equal(again[1],
                          prob)  # fmt: skip
    assert loaded.stages[-1].getOrDefault("runDir") == run


def test_a_feature_shape_reaches_the_model(spark, tmp_path):
    df = _blobs(spark, 32, 4).selectExpr("array(a, b, c, d) as Features", "label")
    est = SparknetEstimator(runsDir=str(tmp_path / "runs"), featureShape=[1, 2, 2],
                            inputCol="Features", **{**SMALL, "rounds": 1})  # fmt: skip
    model = est.fit(df)
    assert model.info.input.shape == (1, 2, 2)
    out = model.setInputCol("features").transform(df)  # found as Spark finds it: any case
    assert out.count() == 32


def test_an_estimator_saved_loaded_and_refit_trains_the_same_weights(spark, tmp_path):
    df = _blobs(spark, 64, 2).selectExpr("array(a, b, c, d) as features", "label")
    est = SparknetEstimator(runsDir=str(tmp_path / "runs"), **SMALL)
    est.save(str(tmp_path / "est"))
    loaded = SparknetEstimator.load(str(tmp_path / "est"))
    assert loaded.settings() == est.settings() == SMALL
    first, second = est.fit(df), loaded.fit(df)
    a, b = first.getOrDefault("runDir"), second.getOrDefault("runDir")
    assert a != b  # a run dir a fit
    wa, wb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    other = est.copy({est.seed: 4}).fit(df)  # the seed is what makes them equal
    wc = load_file(f"{other.getOrDefault('runDir')}/model.safetensors")
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def _png(colour: tuple[int, int, int], seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + rng.normal(0, 30, (*size[::-1], 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _images(spark, n: int, seed: int):
    colours = [(220, 40, 40), (40, 40, 220)]
    rows = [(_png(colours[i % 2], seed * 1000 + i, (24 + i % 5, 20)), i % 2) for i in range(n)]
    return spark.createDataFrame(rows, "image binary, label int")


def test_a_run_dirs_model_predicts_images_decoded_as_its_evaluation_decodes_them(spark, tmp_path):
    run = tmp_path / "run"
    sparknet.fit(_images(spark, 32, 0), out=run, model="cnn", image_size=16, workers=2, tau=4,
                 rounds=2, batch_size=8, eval_every=0, checkpoint_every=0)  # fmt: skip
    model = SparknetModel.from_run(str(run), batchSize=5)
    test_df = _images(spark, 12, 1)
    images, pred, prob = _outputs(model.transform(test_df), "image", "prediction", "probability")
    decode = EvalDecoder(16)
    x = normalize(torch.stack([decode(bytes(b)) for b in images]))
    want = _forward(sparknet.load_model(run), x.numpy())
    assert np.array_equal(pred, want.argmax(1).numpy().astype(float))
    assert np.allclose(prob, want.numpy(), atol=1e-6)


@pytest.fixture(scope="module")
def features_run(tmp_path_factory, spark):
    run = tmp_path_factory.mktemp("ml") / "run"
    df = _blobs(spark, 32, 3).selectExpr("array(a, b, c, d) as features", "label")
    sparknet.fit(df, out=run, **{**SMALL, "rounds": 1})
    return str(run)


@pytest.mark.parametrize(
    ("frame", "params", "message"),
    [
        ("select array(1.0, 2.0) as features", {},
         None),  # a length only the rows show: see the next test
        ("select 'x' as features", {},
         "column 'features' is string, but the model of {run} takes 4 numbers a row (shape 4) "
         "as an array or a Spark ML vector; set inputCol to such a column"),
        ("select array(1.0, 2.0, 3.0, 4.0) as f", {},
         "the DataFrame has no column 'features' (it has: f); set inputCol to the column the "
         "model reads"),
        ("select array(1.0, 2.0, 3.0, 4.0) as features, 1 as prediction", {},
         "the DataFrame already has a column 'prediction'; set predictionCol to another name "
         "(or drop the column)"),
        ("select array(1.0, 2.0, 3.0, 4.0) as features", {"topK": 4},
         "topK=4, but the model has 3 classes: set topK from 0 (no column) to 3"),
        ("select array(1.0, 2.0, 3.0, 4.0) as features", {"device": "gpu"},
         "device='gpu': set it to one of auto, cpu, cuda"),
    ],
    ids=["short-rows", "string", "no-column", "taken-output", "top-k", "device"],
)  # fmt: skip
def test_a_column_the_model_cannot_take_is_one_line_before_any_job(
    spark, features_run, frame, params, message
):
    model = SparknetModel.from_run(features_run, **params)
    df = spark.sql(frame)
    if message is None:
        model.transform(df)  # lazy: nothing runs yet
        return
    with pytest.raises(SparknetError) as exc:
        model.transform(df)
    assert str(exc.value) == message.format(run=features_run)


def test_rows_the_model_cannot_take_fail_the_job_with_a_line_saying_which(spark, features_run):
    model = SparknetModel.from_run(features_run)
    for frame, says in [
        ("select array(1.0, 2.0) as features",
         f"sparknet: a row's 'features' holds 2 values, but the model of {features_run} takes 4"),
        ("select cast(null as array<double>) as features",
         "sparknet: a row's 'features' is null; drop or fill it"),
    ]:  # fmt: skip
        with pytest.raises(Exception, match="sparknet: ") as exc:
            model.transform(spark.sql(frame)).collect()
        assert says in str(exc.value)


def test_a_vector_of_another_size_and_a_dir_without_a_model_are_refused(spark, features_run,
                                                                         tmp_path):  # fmt: skip
    df = VectorAssembler(inputCols=["a", "b"], outputCol="features").transform(
        spark.sql("select 1.0 as a, 2.0 as b")
    )
    with pytest.raises(SparknetError, match=r"holds vectors of 2 values, but the model of .* "
                       r"takes 4: assemble the features it trained on"):  # fmt: skip
        SparknetModel.from_run(features_run).transform(df)
    with pytest.raises(SparknetError, match=f"^{tmp_path} has no model.json: it is not a "):
        SparknetModel.from_run(str(tmp_path))
    with pytest.raises(SparknetError, match="this SparknetModel has no model: make it with"):
        SparknetModel().transform(df)


def test_rows_with_nan_or_null_numbers_or_a_null_vector_fail_with_a_line(spark, features_run):
    model = SparknetModel.from_run(features_run)
    for frame, says in [
        ("select array(1.0, double('NaN'), 3.0, 4.0) as features", "null, NaN or infinite"),
        ("select array(1.0, double('inf'), 3.0, 4.0) as features", "null, NaN or infinite"),
        ("select array(1.0, null, 3.0, 4.0) as features", "null, NaN or infinite"),
    ]:  # fmt: skip
        with pytest.raises(Exception, match="sparknet: ") as exc:
            model.transform(spark.sql(frame)).collect()
        assert f"sparknet: a row's 'features' holds a {says} number; fill or drop it" in str(
            exc.value
        )
    vectors = VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features").transform(
        spark.sql("select 1.0 as a, 2.0 as b, 3.0 as c, 4.0 as d")
    )
    nulls = vectors.selectExpr("if(a > 0, null, features) as features")
    with pytest.raises(Exception, match="sparknet: a row's 'features' is null; drop or fill it"):
        model.transform(nulls).collect()


def test_names_spark_would_confuse_or_misread_are_handled(spark, features_run):
    model = SparknetModel.from_run(features_run, inputCol="f.x%d")
    odd = spark.sql("select array(1.0, 2.0, 3.0, 4.0) as `f.x%d`, 1 as Prediction")
    with pytest.raises(SparknetError, match="already has a column 'Prediction'; set predictionCol"):
        model.transform(odd)  # Spark matches names regardless of case
    out = model.setPredictionCol("pred").transform(odd)
    assert out.select("pred").first().pred in (0.0, 1.0, 2.0)
    with pytest.raises(Exception, match=r"holds 2 values, but the model of .* takes 4"):
        model.transform(spark.sql("select array(1.0, 2.0) as `f.x%d`")).collect()
    # a filter on the prediction does not run the model a second time
    plan = out.filter("pred > 0")._jdf.queryExecution().executedPlan().toString()
    assert plan.count("predict(") == 1, plan


def test_params_from_numpy_save_and_errors_name_the_estimators_params(spark, tmp_path):
    est = SparknetEstimator(runsDir=str(tmp_path / "runs"), **SMALL)
    grid = est.copy({est.lr: np.float32(0.5), est.workers: np.int64(2)})
    grid.save(str(tmp_path / "est"))
    loaded = SparknetEstimator.load(str(tmp_path / "est"))
    assert loaded.settings()["workers"] == 2 and loaded.getOrDefault("lr") == pytest.approx(0.5)
    assert est.setLr(0.2).setBatchSize(16).settings()["batch_size"] == 16
    with pytest.raises(SparknetError, match=r"^invalid setting lr: Input should be greater"):
        SparknetEstimator(lr=-1)
    with pytest.raises(SparknetError, match=r"has no Param 'out' \(did you mean runsDir\?\)"):
        SparknetEstimator(out="x")
    with pytest.raises(SparknetError, match=r"^runsDir='': name a dir"):
        SparknetEstimator(runsDir="")
    with pytest.raises(SparknetError, match=r"^model=None: leave model unset for its default"):
        SparknetEstimator(model=None)
    frame = spark.sql("select array(1.0, 2.0) as features, 1 as y")
    with pytest.raises(SparknetError, match=r"has no column 'label' \(it has: features, y\); set "
                       r"labelCol$"):  # fmt: skip
        est.fit(frame)


def test_a_saved_model_is_not_overwritten_and_a_damaged_one_is_one_line(spark, features_run,
                                                                         tmp_path):  # fmt: skip
    model = SparknetModel.from_run(features_run)
    (tmp_path / "taken").mkdir()
    with pytest.raises(SparknetError, match=r"taken exists: save with model\.write\(\)\.overwrite"):
        model.save(str(tmp_path / "taken"))
    model.save(str(tmp_path / "m"))
    with pytest.raises(SparknetError, match=r"m holds a sparknet\.ml\.model\.SparknetModel, not a "
                       r"SparknetEstimator$"):  # fmt: skip
        SparknetEstimator.load(str(tmp_path / "m"))
    shutil.rmtree(tmp_path / "m" / "data")
    with pytest.raises(SparknetError, match=r"m is not a saved SparknetModel, or is damaged: "):
        SparknetModel.load(str(tmp_path / "m"))
