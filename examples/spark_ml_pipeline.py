"""Train and use a model as Spark ML stages: docs/model.md, "A Spark ML pipeline", whole.

    python examples/spark_ml_pipeline.py --runs runs --pipeline pipelines/digits

The bundled digits become a frame of 64 numeric columns and a label, as a table of features
would be; a `VectorAssembler` and a `SparknetEstimator` make the pipeline, fit on 80% of the rows.
The fitted pipeline scores the other 20% on the executors, is saved, loaded back, and scores them
again; it prints the accuracy (Spark ML's own evaluator) and where the run dir and the pipeline
are. Run it under `spark-submit --master ...` to use a cluster (`--runs` then a path every
executor reaches: s3:// or a shared file system).
"""

from __future__ import annotations

import argparse

from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import DataFrame, SparkSession

from sparknet.ml import SparknetEstimator

COLUMNS = [f"px{i}" for i in range(64)]


def digits_table(spark: SparkSession) -> tuple[DataFrame, DataFrame]:
    """The digits as (train, test) frames: a double column a pixel (0..1) and an int label."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = [
        (*(float(v) / 16.0 for v in x), int(y))
        for x, y in zip(digits.data, digits.target, strict=True)
    ]
    schema = ", ".join(f"{c} double" for c in COLUMNS) + ", label int"
    frame = spark.createDataFrame(rows, schema)
    return frame.randomSplit([0.8, 0.2], seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs", help="where each fit makes its run dir")
    parser.add_argument("--pipeline", required=True, help="where the fitted pipeline is saved")
    parser.add_argument("--workers", type=int, default=2, help="Spark partitions, one worker each")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    spark = SparkSession.builder.appName("sparknet-spark-ml").getOrCreate()
    train, test = digits_table(spark)
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=COLUMNS, outputCol="pixels"),
        SparknetEstimator(model="mlp", workers=args.workers, tau=10, rounds=args.rounds,
                          batch_size=32, lr=0.1, inputCol="pixels", topK=3, runsDir=args.runs),
    ])  # fmt: skip
    fitted = pipeline.fit(train)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy")
    first = accuracy.evaluate(fitted.transform(test))
    fitted.write().overwrite().save(args.pipeline)
    again = accuracy.evaluate(PipelineModel.load(args.pipeline).transform(test))
    print(f"run dir: {fitted.stages[-1].getOrDefault('runDir')}")
    print(f"pipeline: {args.pipeline}")
    print(f"accuracy: {first:.4f} (loaded again: {again:.4f})")
    spark.stop()


if __name__ == "__main__":
    main()
